"""The run's weight loads watched (``driver/weight_sync.py``): a load far slower than the
run's median warns, naming the worker and the step, and the summary's trend line."""

from __future__ import annotations

from sluice.driver.weight_sync import WARMUP, SyncWatch


def _stream(pull_s: float, loads: float = 1.0, worker: int = 0) -> dict[str, float]:
    return {
        f"rollout/worker{worker}/weight_pull_s": pull_s,
        f"rollout/worker{worker}/weight_loads": loads,
    }


def test_a_load_far_slower_than_the_median_warns_once_the_median_is_known():
    watch = SyncWatch(factor=5.0)
    assert watch.observe(1, _stream(90.0)) == []  # no median yet: nothing to compare with
    for step in range(2, WARMUP + 2):
        assert watch.observe(step, _stream(0.6, loads=2)) == []  # 0.3 s a load
    assert watch.median() == 0.3
    [warning] = watch.observe(9, {**_stream(0.3), **_stream(2.7, worker=1)})
    assert warning == (
        "step 9: rollout worker 1 took 2.70 s to load a weight version, 9x the run's median "
        "(0.30 s)"
    )
    assert watch.observe(10, _stream(50.0, loads=0)) == []  # no load this step: nothing seen


def test_short_loads_never_warn_and_a_zero_median_never_divides():
    """The tiny policy's loads take milliseconds (or no measurable time): 5x of that is
    noise, not a slow sync."""
    watch = SyncWatch()
    for step in range(1, WARMUP + 1):
        watch.observe(step, {"perf/weight_sync_s": 0.0})
    assert watch.observe(WARMUP + 1, {"perf/weight_sync_s": 0.5}) == []
    assert watch.observe(WARMUP + 2, {"perf/weight_sync_s": 30.0}) == [
        f"step {WARMUP + 2}: the rollout workers took 30.00 s to load a weight version, the "
        "run's median (0.00 s)"
    ]


def test_the_batch_modes_watch_the_steps_weight_sync():
    watch = SyncWatch()
    for step in range(1, WARMUP + 1):
        watch.observe(step, {"perf/weight_sync_s": 0.25})
    [warning] = watch.observe(WARMUP + 1, {"perf/weight_sync_s": 1.5})
    assert warning.startswith(f"step {WARMUP + 1}: the rollout workers took 1.50 s")


def test_the_trend_compares_the_first_tenth_with_the_last():
    watch = SyncWatch()
    assert watch.trend() is None
    for step in range(1, 21):
        watch.observe(step, {"perf/weight_sync_s": 0.1 * step})
    assert watch.trend() == (
        "weight loads: 20, median 1.05 s; first tenth 0.15 s, last tenth 1.95 s; slowest "
        "2.00 s (step 20)"
    )
