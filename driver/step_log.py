"""What one RL step logs: its metrics (to MLflow through the tracker) and its console line."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Totals:
    """Throughput counters of the steps this session ran. ``loop_s`` is their wall clock:
    from the first step's start to the last step's end (its metrics logged), everything the
    driver does between steps included (draining metrics, logging, checkpoints), held-out
    evaluations taken off, the clock the benchmarks time every system by."""

    samples: int = 0
    tokens: int = 0
    loop_s: float = 0.0
    last_end: float | None = None
    """``time.monotonic()`` when the last step ended; None before the first."""

    def clock(self, started: float, eval_s: float) -> None:
        """Add the step that began at ``started`` and ends now, less its ``eval_s``."""
        now = time.monotonic()
        self.loop_s += now - (started if self.last_end is None else self.last_end) - eval_s
        self.last_end = now


@dataclass(frozen=True)
class StepTimes:
    """Wall-clock marks of one step (``time.monotonic``)."""

    start: float
    generated: float  # batch modes: the step's groups are in the store
    leased: float
    trained: float  # published and acknowledged
    synced: float  # batch modes: the workers hold the new version

    @property
    def step_s(self) -> float:
        return self.synced - self.start


def step_metrics(train: dict[str, float], times: StepTimes) -> dict[str, float]:
    """The trainer's metrics under ``train/``, and the step's timings under ``perf/``."""
    step_s = times.step_s
    lease_s = times.leased - times.generated
    return {
        **{f"train/{k}": v for k, v in train.items()},
        "train/lease_s": lease_s,
        # Time the trainer sat waiting for a full batch in the store, over the step.
        "perf/trainer_idle_fraction": min(1.0, (times.generated - times.start + lease_s) / step_s),
        "perf/rollout_s": times.generated - times.start,
        "perf/train_s": times.trained - times.generated,
        "perf/weight_sync_s": times.synced - times.trained,
        "perf/step_s": step_s,
        "perf/tokens_per_s": train["tokens"] / step_s,
        "perf/samples_per_s": train["samples"] / step_s,
    }


def step_line(
    step: int, total: int, metrics: dict[str, float], warnings: list[str] | None = None
) -> str:
    """The step's one line on the console; ``warnings`` (a collapse, ``driver/health.py``)
    go at its end."""
    acc = metrics.get("eval/accuracy")
    shown = f" | held-out {100 * acc:5.1f}%" if acc is not None else ""
    reward = metrics.get("rollout/reward")  # async: no group may have finished this step
    rewarded = "  -  " if reward is None else f"{reward:.3f}"
    return (
        f"step {step:>4}/{total} | reward {rewarded}{shown} | "
        f"loss {metrics['train/loss']:+.4f} | kl {metrics['train/kl_behaviour']:.2e} | "
        f"entropy {metrics['train/entropy']:.3f} | {metrics['perf/tokens_per_s']:6.0f} tok/s | "
        f"{metrics['perf/step_s']:.2f} s" + "".join(f" | COLLAPSE: {w}" for w in warnings or ())
    )


class StoreMetrics:
    """The trajectory store's gauges, and its counters as per-step increments."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def update(self, stats: dict[str, int]) -> dict[str, float]:
        out = {f"store/{k}": float(stats[k]) for k in ("held", "ready", "leased")}
        for k in ("dropped", "expired_leases"):
            before = self.last.get(k, 0)  # a store restarted in place counts from zero
            out[f"store/{k}"] = float(stats[k] - before if stats[k] >= before else stats[k])
        self.last = stats
        return out
