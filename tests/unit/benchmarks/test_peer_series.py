"""benchmarks/series.py: the statistics of a run, and reading Sluice and TRL runs into it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.series import (
    WARMUP_STEPS,
    WINDOW_STEPS,
    Series,
    sluice_series,
    trl_series,
    wall_steps,
)
from benchmarks.trl_grpo import RESULT_FILE
from sluice.driver.tracking import MlflowLogger


def _series(step_s: list[float], evals: dict[int, float]) -> Series:
    n = len(step_s)
    return Series("x", step_s, [128.0] * n, [1000.0] * n, {}, evals)


def test_clock_and_time_to_threshold_are_training_seconds_at_the_evaluated_step():
    run = _series([1.0, 1.0, 2.0, 2.0, 2.0, 2.0], {0: 0.2, 3: 0.25, 6: 0.3})
    assert run.clock == [1.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert run.time_to(0.2) == 0.0  # the starting policy already meets it
    assert run.time_to(0.25) == 4.0  # steps 1-3
    assert run.time_to(0.26) == 10.0  # first met at the step-6 evaluation
    assert run.time_to(0.5) is None


def test_throughput_counts_every_step_or_leaves_out_each_step_after_an_evaluation():
    # Step 4 follows the step-3 evaluation: sync generated its batch during the evaluation.
    run = _series([1.0, 1.0, 1.0, 0.1, 1.0, 1.0], {0: 0.2, 3: 0.25, 6: 0.3})
    assert run.timed_steps() == [0, 1, 2, 3, 4, 5]
    assert run.samples_per_s == pytest.approx(6 * 128 / 5.1)
    assert run.timed_steps(after_eval=False) == [0, 1, 2, 4, 5]
    assert run.rate("samples", after_eval=False) == pytest.approx(5 * 128 / 5.0)
    assert run.rate("tokens", after_eval=False) == pytest.approx(1000.0)


def test_window_medians_skip_the_warm_up_and_a_short_tail():
    # Windows of WINDOW_STEPS steps after WARMUP_STEPS: step times 1 s, then 2 s, then 4 s.
    step_s = [9.0] * WARMUP_STEPS + [1.0] * WINDOW_STEPS + [2.0] * WINDOW_STEPS
    step_s += [4.0] * WINDOW_STEPS + [0.5] * (WINDOW_STEPS - 1)
    run = _series(step_s, {0: 0.2})
    assert run.window_rates("samples") == [128.0, 64.0, 32.0]
    assert run.median_rate("samples") == 64.0
    assert math.isnan(_series([1.0] * WARMUP_STEPS, {0: 0.2}).median_rate("samples"))


@pytest.fixture
def wall(monkeypatch):
    """The logger's wall clock, set by the test: ``wall.now`` epoch seconds."""
    clock = SimpleNamespace(now=1_000.0)
    monkeypatch.setattr("sluice.driver.tracking.time", SimpleNamespace(time=lambda: clock.now))
    return clock


def _log_run(root: Path, name: str, mode: str, steps: list[dict[str, float]], wall=None) -> Path:
    """A Sluice run's MLflow metrics (the real logger, sqlite) and its summary.json; with
    ``wall``, each step is logged its ``perf/step_s`` plus its ``eval/seconds`` later."""
    tracker = MlflowLogger(f"sqlite:///{root / 'mlflow.db'}", (root / "art").as_uri(), "e", name)
    tracker.log_metrics(0, {"eval/accuracy": 0.2})
    for step, metrics in enumerate(steps, start=1):
        if wall is not None:
            wall.now += metrics["perf/step_s"] + metrics.get("eval/seconds", 0.0)
        tracker.log_metrics(step, metrics)
    tracker.close()
    run_dir = root / name
    run_dir.mkdir()
    summary = {"mlflow_run_id": tracker.run_id, "mode": mode}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def _step(**extra: float) -> dict[str, float]:
    return {
        "perf/step_s": 2.0,
        "perf/rollout_s": 0.8,
        "perf/train_s": 1.1,
        "perf/weight_sync_s": 0.1,
        "train/lease_s": 0.05,
        "train/step_s": 1.0,
        "train/samples": 128.0,
        "train/tokens": 3000.0,
        "rollout/reward": 0.3,
        **extra,
    }


def test_a_sync_run_reads_back_with_its_phases_laid_out_from_each_step_start(tmp_path, wall):
    evaluated = {"eval/accuracy": 0.3, "eval/seconds": 5.0}
    run_dir = _log_run(
        tmp_path,
        "sync",
        "sync",
        [
            _step(**{"train/staleness_count/0": 128.0}),
            _step(**{"train/staleness_count/0": 128.0}, **evaluated),
        ],
        wall,
    )
    run = sluice_series("Sluice sync", run_dir, tmp_path)
    # On the wall clock, from one step's logging to the next's, the evaluation taken off.
    assert run.step_s == pytest.approx([2.0, 2.0])
    assert run.samples_per_s == pytest.approx(128.0 / 2.0)
    assert run.evals == {0: 0.2, 2: 0.3}
    assert run.staleness == {0: 256}
    # From the step-0 accuracy to the last step, as logged (epoch seconds, ms precision).
    assert run.loop == pytest.approx((1_000.0, 1_009.0))
    spans = {(p.row, p.label): p.spans[0] for p in run.phases}
    # The trainer waits for the rollouts and its lease, then computes for train/step_s.
    assert spans["trainer", "waiting for data"] == pytest.approx((0.0, 0.85))
    assert spans["trainer", "training"] == pytest.approx((0.85, 1.0))
    assert spans["rollout", "generating"] == pytest.approx((0.0, 0.8))
    # Weights load after rollouts (0.8 s) and the trainer's call (1.1 s), to the step's end.
    assert spans["rollout", "loading weights"] == pytest.approx((1.9, 0.1))


def test_an_async_run_shows_the_workers_idle_share(tmp_path, wall):
    step = _step(
        **{
            "perf/rollout_s": 0.0,
            "rollout/worker0/idle_fraction": 0.25,
            "train/staleness_count/0": 32.0,
            "train/staleness_count/1": 96.0,
        }
    )
    run = sluice_series(
        "Sluice async", _log_run(tmp_path, "async", "async", [step], wall), tmp_path
    )
    spans = {(p.row, p.label): p.spans[0] for p in run.phases}
    assert spans["rollout", "generating"] == pytest.approx((0.0, 1.5))
    assert spans["rollout", "idle (share of the step)"] == pytest.approx((1.5, 0.5))
    assert run.staleness == {0: 32, 1: 96}
    assert run.staleness_mean() == pytest.approx(0.75)


def test_the_wall_clock_counts_what_the_driver_does_after_a_step():
    # Logged at 12.5 and 15.0 s; step 2 evaluated for 1.0 s before its logging.
    assert wall_steps(10.0, {1: 12.5, 2: 15.0}, {2: 1.0}, [1, 2]) == [2.5, 1.5]


def test_a_run_that_did_not_time_its_evaluations_is_refused(tmp_path):
    run_dir = _log_run(tmp_path, "old", "sync", [_step(**{"eval/accuracy": 0.3})])
    with pytest.raises(ValueError, match="logged no eval/seconds"):
        sluice_series("x", run_dir, tmp_path)


def test_a_run_without_a_summary_is_named(tmp_path):
    (tmp_path / "gone").mkdir()
    with pytest.raises(FileNotFoundError, match=r"gone/summary\.json"):
        sluice_series("x", tmp_path / "gone", tmp_path)


def test_a_trl_result_reads_back_as_one_process_generating_then_training(tmp_path):
    result = {
        "steps": 2,
        "threads": 1,
        "load_s": 3.0,
        "step_s": [4.0, 5.0],
        "generate_s": [3.0, 3.5],
        "samples": [128, 128],
        "tokens": [3000, 3500],
        "reward": [0.3, 0.4],
        "eval_steps": [0, 2],
        "eval_accuracy": [0.2, 0.22],
        "eval_s": [5.0, 5.0],
        "started_at": 1000.0,
        "ended_at": 1019.0,
    }
    (tmp_path / RESULT_FILE).write_text(json.dumps(result))
    run = trl_series("TRL", tmp_path)
    assert run.tokens_per_s == pytest.approx(6500 / 9.0)
    assert run.reward == {1: 0.3, 2: 0.4}
    assert run.evals == {0: 0.2, 2: 0.22}
    assert run.staleness == {0: 256}
    assert run.loop == (1000.0, 1019.0)
    assert [(p.label, p.spans[1]) for p in run.phases] == [
        ("generating", (0.0, 3.5)),
        ("training", (3.5, 1.5)),
    ]
    result["step_s"] = [4.0]
    (tmp_path / RESULT_FILE).write_text(json.dumps(result))
    with pytest.raises(ValueError, match="1 of 2 steps"):
        trl_series("TRL", tmp_path)


def test_a_sluice_run_and_a_trl_run_of_the_same_steps_read_back_alike(tmp_path, wall):
    """The methodology, both ways: the same steps (a fast one after the step-2 evaluation,
    the evaluation itself 5 s) give both systems the same clock and the same rates, every
    step counted or the step after each evaluation left out."""
    step_s, samples, tokens = [2.0, 2.0, 0.5, 2.0], [128, 128, 128, 128], [3000] * 4
    evaluated = {"eval/accuracy": 0.3, "eval/seconds": 5.0}
    steps = [_step(**{"perf/step_s": s}) for s in step_s]
    steps[1] |= evaluated
    sluice = sluice_series("Sluice", _log_run(tmp_path, "sync", "sync", steps, wall), tmp_path)
    result = {
        "steps": 4,
        "threads": 1,
        "load_s": 3.0,
        "step_s": step_s,  # trl_grpo.py's callback stops the clock while it evaluates
        "generate_s": [1.0] * 4,
        "samples": samples,
        "tokens": tokens,
        "reward": [0.3] * 4,
        "eval_steps": [0, 2],
        "eval_accuracy": [0.2, 0.3],
        "eval_s": [5.0, 5.0],
    }
    (tmp_path / RESULT_FILE).write_text(json.dumps(result))
    trl = trl_series("TRL", tmp_path)
    assert sluice.step_s == pytest.approx(trl.step_s)
    assert sluice.evals == trl.evals
    for after_eval in (True, False):
        assert sluice.timed_steps(after_eval) == trl.timed_steps(after_eval)
        for what in ("samples", "tokens"):
            mine, theirs = sluice.rate(what, after_eval), trl.rate(what, after_eval)
            assert mine == pytest.approx(theirs)
    assert sluice.rate("samples") == pytest.approx(512 / 6.5)
    assert sluice.rate("samples", after_eval=False) == pytest.approx(384 / 6.0)
    assert sluice.time_to(0.3) == trl.time_to(0.3) == pytest.approx(4.0)


def test_a_record_keeps_a_run_per_step_on_the_same_clock(tmp_path, wall):
    from benchmarks.records import run_record

    evaluated = {"eval/accuracy": 0.3, "eval/seconds": 5.0}
    steps = [
        _step(**{"train/staleness_count/0": 96.0, "train/staleness_count/1": 32.0}),
        _step(**{"train/staleness_count/1": 128.0}, **evaluated),
    ]
    run_dir = _log_run(tmp_path, "async", "async", steps, wall)
    kept = run_record(run_dir, tmp_path)
    assert kept["run"] == "async" and kept["mode"] == "async"
    assert kept["heldout"] == {"0": 0.2, "2": 0.3}
    first, second = kept["steps"]
    assert first == {
        "wall_s": pytest.approx(2.0),
        "samples": 128,
        "tokens": 3000,
        "trainer_wait_s": pytest.approx(0.85),  # perf/rollout_s + train/lease_s
        "staleness": {"0": 96, "1": 32},
    }
    assert second["wall_s"] == pytest.approx(2.0)  # the evaluation's 5 s taken off
    assert second["staleness"] == {"1": 128}
