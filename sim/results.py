"""What one simulation returns, and the plain-text table that compares several.

Filled in by ``sim.engine.simulate``; printed by ``sluice simulate`` and by
``benchmarks/sim_scale.py``.
Rates are per second of simulated wall-clock time; "steady" rates leave out the first
``workload.warmup_steps`` steps, where a pipelined policy is still filling.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SimResult:
    """Counts and times of one simulated run of ``steps`` training steps."""

    label: str
    steps: int
    wall_s: float
    step_end_s: list[float]  # when each step's loop iteration ended (index 0: step 1)
    trained_samples: int
    trained_tokens: int  # response tokens of trained samples
    generated_samples: int  # samples whose generation finished (trained, dropped or left over)
    issued_samples: int  # samples handed to engines (each once, however often it was re-run)
    in_flight_samples: int  # issued samples not finished when the last step ended
    dropped_samples: int
    requeued_samples: int  # in flight on an engine that failed, generated again elsewhere
    failures: int
    repacked_requests: int
    rollout_idle: float  # share of live engine time with nothing to run
    trainer_idle: float  # share of wall time the trainer waited for data
    # versions behind -> trained samples, counted as policy.stale_by counts them
    staleness: dict[int, int] = field(default_factory=dict)
    first_token_lag: dict[int, int] = field(default_factory=dict)  # by each first token
    warmup_steps: int = 0
    events: int = 0

    @property
    def samples_per_s(self) -> float:
        return self.trained_samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steady_step_s(self) -> float:
        """Mean step time between the warm-up and the last step (which, in pipelined policies,
        has no next batch to wait for); the whole run's mean when it is too short for that."""
        first, last = self.warmup_steps, self.steps - 1
        if last - first < 1:
            return self.wall_s / self.steps
        start = self.step_end_s[first - 1] if first > 0 else 0.0
        return (self.step_end_s[last - 1] - start) / (last - first)

    @property
    def mean_staleness(self) -> float:
        total = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / total if total else 0.0

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)


def speedups(results: list[SimResult], baseline: SimResult) -> list[float]:
    """Steady-state throughput of each result over the baseline's (same batch per step)."""
    return [baseline.steady_step_s / r.steady_step_s for r in results]


def format_table(results: list[SimResult], baseline: SimResult | None = None) -> str:
    """A markdown table: one row per result, speedups against ``baseline`` (default: first)."""
    if not results:
        return "(no results)"
    base = baseline or results[0]
    lines = [
        "| policy | samples/s | tokens/s | x " + base.label + " | step s | wall s "
        "| rollout idle | trainer idle | mean staleness | dropped | requeued |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, gain in zip(results, speedups(results, base), strict=True):
        lines.append(
            f"| {r.label} | {r.samples_per_s:,.1f} | {r.tokens_per_s:,.0f} | {gain:.2f} "
            f"| {r.steady_step_s:,.3f} | {r.wall_s:,.0f} | {r.rollout_idle:.2f} "
            f"| {r.trainer_idle:.2f} | {r.mean_staleness:.2f} | {r.dropped_samples:,} "
            f"| {r.requeued_samples:,} |"
        )
    return "\n".join(lines)


def staleness_line(result: SimResult) -> str:
    """``0: 1200, 1: 800`` — trained samples per staleness."""
    return ", ".join(f"{k}: {v:,}" for k, v in sorted(result.staleness.items())) or "-"
