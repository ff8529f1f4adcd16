"""A collapse is seen: held-out accuracy far below its best, or entropy under its floor."""

import pytest

from sluice.driver.health import ENTROPY_REFERENCE_STEPS, ENTROPY_WINDOW, LearningHealth
from sluice.driver.step_log import step_line
from sluice.tasks.job import RunSummary


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


def test_a_fall_of_half_what_was_gained_is_a_collapse_when_accuracies_are_low():
    """SmolLM2 at lr 1e-4: 1.6% -> 12.5% at step 15 -> 4.7% at step 30. 7.8 points is under
    collapse_drop, but the run lost most of what it had gained."""
    h = _health()
    h.held_out(0, 0.016)
    h.held_out(15, 0.125)
    h.held_out(30, 0.047)
    assert h.accuracy_collapsed
    h = _health()
    h.held_out(0, 0.33)
    h.held_out(50, 0.45)
    h.held_out(100, 0.40)  # 5 points: half of collapse_drop, but not half of the +12 gained
    assert not h.collapsed


def _entropies(h: LearningHealth, values: list[float]) -> None:
    for value in values:
        h.entropy(value)


def test_low_entropy_is_a_collapse_only_once_held_out_accuracy_stalls():
    h = _health()  # patience: 5 evaluations
    _entropies(h, [1.2, 1.4] * 2 + [1.3])  # the reference: the first 5 steps' mean, 1.3
    assert h.reference_entropy == pytest.approx(1.3)
    h.held_out(0, 0.30)
    _entropies(h, [0.10, 0.14] * (ENTROPY_WINDOW // 2))  # mean 0.12: under the floor 0.13
    assert h.recent_entropy == pytest.approx(0.12)
    for step, accuracy in enumerate([0.35, 0.40, 0.45, 0.50, 0.55, 0.60], start=1):
        h.held_out(step, accuracy)  # still improving: the default run's case
    assert not h.collapsed
    for step in range(7, 11):
        h.held_out(step, 0.58)
    assert not h.collapsed  # 4 evaluations without a new best
    h.held_out(11, 0.58)
    assert h.entropy_collapsed
    assert h.warnings(0.58) == [
        "entropy 0.120 is under 10% of its start (1.300) and held-out accuracy has not "
        "improved for 5 evaluations"
    ]
    _entropies(h, [0.2] * ENTROPY_WINDOW)  # exploring again
    assert not h.collapsed


def test_one_low_step_does_not_count_the_window_does():
    h = _health()
    _entropies(h, [1.0] * ENTROPY_REFERENCE_STEPS)
    h.held_out(0, 0.5)
    for step in range(1, 7):
        h.held_out(step, 0.5)
    _entropies(h, [0.2] * (ENTROPY_WINDOW - 1) + [0.01])  # mean 0.19: above the floor 0.1
    assert not h.collapsed


def test_a_floor_of_zero_never_flags_entropy():
    h = LearningHealth(collapse_drop=0.1, entropy_floor=0.0, patience=1)
    h.held_out(0, 0.5)
    h.held_out(1, 0.5)
    _entropies(h, [0.0] * (ENTROPY_REFERENCE_STEPS + ENTROPY_WINDOW))
    assert not h.collapsed


def test_a_resumed_run_keeps_its_start_best_and_reference():
    h = _health()
    h.held_out(0, 0.4)
    h.held_out(50, 0.6)
    _entropies(h, [1.0] * ENTROPY_REFERENCE_STEPS)
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
