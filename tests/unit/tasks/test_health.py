"""A collapse is seen: held-out accuracy far below its best, or entropy under its floor."""

import pytest

from sluice.tasks.health import ENTROPY_REFERENCE_STEPS, LearningHealth
from sluice.tasks.job import RunSummary
from sluice.tasks.step_log import step_line


def _health() -> LearningHealth:
    return LearningHealth(collapse_drop=0.10, entropy_floor=0.1)


def test_a_new_best_is_kept_and_a_small_dip_is_no_collapse():
    h = _health()
    assert h.held_out(0, 0.53)
    assert h.held_out(15, 0.766)
    assert not h.held_out(20, 0.70)  # 6.6 points below the best: noise, not a collapse
    assert (h.best_accuracy, h.best_step, h.collapsed) == (0.766, 15, False)
    assert h.warnings(0.70) == []


def test_accuracy_far_below_its_best_is_a_collapse_until_it_recovers():
    h = _health()
    h.held_out(0, 0.531)
    h.held_out(15, 0.766)
    h.held_out(30, 0.141)  # the small data-file run of the issue
    assert h.collapsed
    (warning,) = h.warnings(0.141)
    assert warning == "held-out 14.1% is 62.5 points below its best (76.6% at step 15)"
    assert h.metrics()["health/accuracy_collapsed"] == 1.0
    assert h.metrics()["eval/best_accuracy"] == 0.766
    h.held_out(45, 0.70)
    assert not h.collapsed


@pytest.mark.parametrize(
    ("later", "collapsed"), [(0.14, False), (0.12, True)], ids=["above-floor", "under-floor"]
)
def test_entropy_under_its_floor_of_the_first_steps_is_a_collapse(later, collapsed):
    h = _health()
    for value in [1.2, 1.4] * 2 + [1.3]:  # mean of the first 5 steps: 1.3
        h.entropy(value)
    assert h.reference_entropy == pytest.approx(1.3)
    assert not h.collapsed
    h.entropy(later)  # the floor is 0.13
    assert h.collapsed is collapsed
    if collapsed:
        assert h.warnings(None) == ["entropy 0.120 fell under 10% of its start (1.300)"]


def test_a_floor_of_zero_never_flags_entropy():
    h = LearningHealth(collapse_drop=0.1, entropy_floor=0.0)
    for _ in range(ENTROPY_REFERENCE_STEPS + 3):
        h.entropy(0.0)
    assert not h.collapsed


def test_a_resumed_run_keeps_its_best_and_its_reference():
    h = _health()
    h.held_out(50, 0.6)
    for _ in range(ENTROPY_REFERENCE_STEPS):
        h.entropy(1.0)
    again = _health()
    again.restore(h.state())
    assert again.state() == h.state()
    again.held_out(100, 0.45)
    assert again.collapsed


def test_the_step_line_and_the_summary_say_it():
    metrics = {
        "train/loss": 0.1,
        "train/kl_behaviour": 1e-3,
        "train/entropy": 0.1,
        "perf/tokens_per_s": 1000.0,
        "perf/step_s": 0.5,
        "eval/accuracy": 0.141,
    }
    line = step_line(30, 30, metrics, ["held-out 14.1% is 62.5 points below its best"])
    assert line.endswith("| COLLAPSE: held-out 14.1% is 62.5 points below its best")
    assert "COLLAPSE" not in step_line(30, 30, metrics)
    summary = RunSummary(
        run_dir="r",
        storage_url="file:///r",
        mode="async",
        steps=30,
        start_accuracy=0.531,
        end_accuracy=0.141,
        samples_per_s=1.0,
        tokens_per_s=1.0,
        wall_s=1.0,
        mlflow_uri="sqlite:///m.db",
        mlflow_run_id="x",
        policy="r/policy",
        best_accuracy=0.766,
        best_step=15,
        best_policy="r/best_policy",
        collapse=("held-out 14.1% is 62.5 points below its best (76.6% at step 15)",),
    )
    lines = summary.lines()
    assert lines[1].startswith("COLLAPSED: held-out 14.1%")
    assert lines[2] == "best held-out 76.6% at step 15: r/best_policy"
