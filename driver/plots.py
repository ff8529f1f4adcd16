"""PNG plots of a run, drawn from its MLflow metric history (logged as run artifacts).

``training_curves``: rollout reward and held-out accuracy against step and against wall
clock. ``staleness``: how many trained samples had each staleness, over the whole run.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: files only

import matplotlib.pyplot as plt
from mlflow.tracking import MlflowClient

STALENESS_PREFIX = "train/staleness_count/"


def _history(
    client: MlflowClient, run_id: str, key: str
) -> tuple[list[int], list[float], list[float]]:
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    if not points:
        return [], [], []
    t0 = points[0].timestamp
    return (
        [m.step for m in points],
        [(m.timestamp - t0) / 1000 for m in points],
        [m.value for m in points],
    )


def training_curves(client: MlflowClient, run_id: str, out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label in (("rollout/reward", "rollout reward"), ("eval/accuracy", "held-out acc.")):
        steps, seconds, values = _history(client, run_id, key)
        axes[0].plot(steps, values, marker="." if key == "eval/accuracy" else None, label=label)
        axes[1].plot(seconds, values, marker="." if key == "eval/accuracy" else None, label=label)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall clock (s since the first point)")
    for ax in axes:
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle("reward and held-out accuracy")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def staleness(client: MlflowClient, run_id: str, out: Path) -> Path:
    counts: Counter[int] = Counter()
    for metric in client.get_run(run_id).data.metrics:
        if metric.startswith(STALENESS_PREFIX):
            k = int(metric.removeprefix(STALENESS_PREFIX))
            counts[k] += int(sum(m.value for m in client.get_metric_history(run_id, metric)))
    fig, ax = plt.subplots(figsize=(5, 3.8))
    keys = sorted(counts)
    ax.bar(keys, [counts[k] for k in keys])
    ax.set_xticks(keys)
    ax.set_xlabel("staleness (trainer version - behaviour version)")
    ax.set_ylabel("trained samples")
    ax.set_title("staleness of trained samples")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
