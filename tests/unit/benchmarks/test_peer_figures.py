"""benchmarks/figures.py: which steps a timeline shows, smoothing, and that each plot is drawn."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import figures
from benchmarks.figures import _moving_mean, _window
from benchmarks.series import WARMUP_STEPS, Phase, Series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(label: str, steps: int, evals: dict[int, float], staleness: dict[int, int]) -> Series:
    step_s = [1.0 + 0.1 * (i % 3) for i in range(steps)]
    return Series(
        label,
        step_s,
        [128.0] * steps,
        [3000.0] * steps,
        {s: 0.3 for s in range(1, steps + 1)},
        evals,
        phases=[
            Phase("trainer", "waiting for data", [(0.0, 0.4)] * steps),
            Phase("trainer", "training", [(0.4, 0.5)] * steps),
            Phase("rollout", "generating", [(0.0, 0.4)] * steps),
        ],
        staleness=staleness,
    )


@pytest.mark.parametrize(
    ("steps", "evals", "first"),
    [
        pytest.param(30, {0: 0.2, 30: 0.3}, WARMUP_STEPS + 1, id="no-eval-nearby"),
        # An evaluation at step 8: the window must start past step 8 + 1 (stream restart).
        pytest.param(30, {0: 0.2, 8: 0.2, 30: 0.3}, 10, id="skips-past-an-eval"),
        pytest.param(8, {0: 0.2}, 3, id="short-run-takes-the-last-steps"),
    ],
)
def test_timeline_window_avoids_warm_up_and_evaluations(steps, evals, first):
    assert _window(_run("x", steps, evals, {0: 1}), 6) == first


def test_moving_mean_averages_the_last_width_points():
    assert _moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_every_plot_is_written_as_a_png(tmp_path: Path):
    runs = [
        _run("sync", 30, {0: 0.2, 10: 0.22, 20: 0.24, 30: 0.25}, {0: 3840}),
        _run("async", 30, {0: 0.2, 10: 0.23, 20: 0.25, 30: 0.26}, {0: 1000, 1: 2000, 2: 840}),
    ]
    written = [
        figures.curves(runs, 0.24, tmp_path / "curves.png"),
        figures.staleness(runs, tmp_path / "staleness.png"),
        figures.timeline(runs, tmp_path / "timeline.png"),
    ]
    for path in written:
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert path.stat().st_size > 10_000  # axes, bars and text, not an empty canvas
