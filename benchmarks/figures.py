"""The peer comparison's PNG plots, drawn from ``benchmarks.series.Series``.

- ``curves``: rollout reward (moving mean) and held-out accuracy against the training clock,
  one line per system and mode;
- ``staleness``: how many trained samples had each staleness, one panel per run;
- ``timeline``: a Gantt chart of a few consecutive steps per run, one bar row per process
  (rollout worker, trainer), coloured by what it was doing: the bubbles ``sync`` leaves
  and ``async`` fills.

Driven by ``benchmarks/peer_trl.py``; every function writes one file and returns its path.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: files only

import matplotlib.pyplot as plt

from benchmarks.series import WARMUP_STEPS, Series

# Steps of reward averaged per plotted point: one step's reward over 128 samples is noisy.
REWARD_SMOOTHING = 5
# Steps a timeline shows: enough to see the pattern repeat, few enough to see each step.
TIMELINE_STEPS = 6
COLOURS = {
    "generating": "tab:blue",
    "training": "tab:orange",
    "waiting for data": "0.85",
    "loading weights": "tab:red",
    "idle (share of the step)": "0.85",
}
DPI = 110


def _moving_mean(values: list[float], width: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - width + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def curves(runs: list[Series], threshold: float | None, out: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        steps = sorted(run.reward)
        left.plot(
            [run.clock_at(s) for s in steps],
            _moving_mean([run.reward[s] for s in steps], REWARD_SMOOTHING),
            label=run.label,
        )
        evaluated = sorted(run.evals)
        right.plot(
            [run.clock_at(s) for s in evaluated],
            [100 * run.evals[s] for s in evaluated],
            marker="o",
            label=run.label,
        )
    if threshold is not None:
        right.axhline(100 * threshold, color="0.5", linestyle="--", linewidth=1, label="threshold")
    left.set_ylabel(f"rollout reward (mean of {REWARD_SMOOTHING} steps)")
    right.set_ylabel("held-out accuracy, greedy (%)")
    for ax in (left, right):
        ax.set_xlabel("training wall-clock (s; held-out evaluations excluded)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("Same work, same cores: reward and held-out accuracy against time")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def staleness(runs: list[Series], out: Path) -> Path:
    fig, axes = plt.subplots(
        1, len(runs), figsize=(3.2 * len(runs), 3.2), sharex=True, sharey=True, squeeze=False
    )
    keys = list(range(max(k for run in runs for k in (*run.staleness, 0)) + 1))
    for ax, run in zip(axes[0], runs, strict=True):
        total = sum(run.staleness.values()) or 1
        ax.bar(keys, [100 * run.staleness.get(k, 0) / total for k in keys], color="tab:blue")
        ax.set_xticks(keys)
        ax.set_title(f"{run.label}\nmean {run.staleness_mean():.2f}", fontsize=9)
        ax.set_xlabel("staleness (versions)")
        ax.grid(alpha=0.3, axis="y")
    axes[0, 0].set_ylabel("% of trained samples")
    fig.suptitle("Staleness of trained samples (trainer version - generating version)")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def _window(run: Series, steps: int) -> int:
    """The first step (1-based) of ``steps`` consecutive steps past the warm-up none of which
    follows a held-out evaluation (an async stream restarts after one, and sync generated
    that step's batch during it)."""
    evals = set(run.evals)
    start = WARMUP_STEPS + 1
    while start + steps - 1 <= len(run.step_s):
        if not any(s - 1 in evals for s in range(start, start + steps)):
            return start
        start += 1
    return max(1, len(run.step_s) - steps + 1)


def timeline(runs: list[Series], out: Path, steps: int = TIMELINE_STEPS) -> Path:
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.2 + 1.1 * len(runs)), squeeze=False)
    span = 0.0
    for ax, run in zip(axes[:, 0], runs, strict=True):
        shown = min(steps, len(run.step_s))  # a run shorter than the window: all of it
        first = _window(run, shown)
        starts = [run.clock_at(s - 1) for s in range(first, first + shown)]
        origin = starts[0]
        rows = list(dict.fromkeys(p.row for p in run.phases))
        seen: set[str] = set()
        for phase in run.phases:
            y = rows.index(phase.row)
            bars = [
                (start - origin + offset, length)
                for start, (offset, length) in zip(
                    starts, phase.spans[first - 1 : first - 1 + shown], strict=True
                )
                if length > 0
            ]
            label = phase.label if phase.label not in seen else None
            seen.add(phase.label)
            ax.broken_barh(
                bars, (y - 0.35, 0.7), color=COLOURS.get(phase.label, "tab:gray"), label=label
            )
        for start in starts:
            ax.axvline(start - origin, color="black", linewidth=0.6, alpha=0.5)
        end = run.clock_at(first + shown - 1) - origin
        span = max(span, end)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.invert_yaxis()
        ax.set_title(
            f"{run.label}: steps {first}-{first + shown - 1}, {end / shown:.2f} s per step",
            fontsize=9,
            loc="left",
        )
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    for ax in axes[:, 0]:
        ax.set_xlim(0, span * 1.02)
    axes[-1, 0].set_xlabel("seconds (vertical lines: step boundaries)")
    fig.suptitle("What each process did, step by step")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out
