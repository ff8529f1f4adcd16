"""The run's weight loads watched (``driver/weight_sync.py``): a load far slower than the
run's median warns, naming the worker and the step, and the summary's trend line; what a
worker serves is compared with what was published, and one that keeps an old version
too long is named."""

from __future__ import annotations

import pytest

from sluice.driver.weight_sync import WARMUP, ServedWeights, SyncWatch, WeightsMismatch
from sluice.storage.params import digest_number, version_digest


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


PUBLISHED = {v: version_digest(v, [f"bucket-of-{v}"]) for v in range(1, 4)}


def _served(asked: list[int] | None = None) -> ServedWeights:
    def published(version: int) -> str | None:
        if asked is not None:
            asked.append(version)
        return PUBLISHED.get(version)

    return ServedWeights(published, stale_after_s=120.0)


def test_a_worker_serving_the_published_bytes_passes_and_each_version_is_asked_once():
    asked: list[int] = []
    served = _served(asked)
    for worker in range(3):
        assert served.check(worker, 2, digest_number(PUBLISHED[2]), newest=2, now=0.0) == []
    assert asked == [2]
    assert served.check(0, 0, 0.0, newest=2, now=1.0) == []  # the starting policy: no digest
    assert served.check(0, 9, 0.0, newest=9, now=1.0) == []  # relay 0 has no record of it
    assert asked == [2, 9]


def test_a_worker_that_skipped_a_load_or_serves_other_bytes_fails_naming_it():
    served = _served()
    with pytest.raises(WeightsMismatch) as skipped:
        served.check(4, 3, 0.0, newest=3)  # the engine did not read the version
    assert str(skipped.value).startswith(
        "rollout worker 4 reports version 3, but what its engine loaded is not version 3 as "
        "the trainer published it (digest none: it did not read the whole version, published "
    )
    with pytest.raises(WeightsMismatch, match=r"rollout worker 1 reports version 3.*\(digest "):
        served.check(1, 3, digest_number(PUBLISHED[2]), newest=3)  # version 2's bytes


def test_a_worker_on_an_old_version_past_the_bound_is_named_once():
    served = _served()
    digest = digest_number(PUBLISHED[1])
    assert served.check(0, 1, digest, newest=1, now=0.0) == []
    assert served.check(0, 1, digest, newest=3, now=100.0) == []  # behind, within the bound
    [warning] = served.check(0, 1, digest, newest=3, now=130.0)
    assert warning == (
        "rollout worker 0 has served version 1 for 130 s while the trainer is at version 3: "
        "longer than weights.pull_timeout_s (120 s); is its weight pull stuck?"
    )
    assert served.check(0, 1, digest, newest=3, now=200.0) == []  # once
    assert served.check(0, 2, digest_number(PUBLISHED[2]), newest=3, now=210.0) == []
    assert served.check(0, 2, digest_number(PUBLISHED[2]), newest=3, now=300.0) == []
