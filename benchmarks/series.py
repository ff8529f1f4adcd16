"""One training run as the peer comparison reads it, and the statistics taken from it.

``Series`` holds, per optimiser step, how long the step took and what it trained, the
phases a timeline draws, the rollout reward, and the held-out accuracy at the evaluated
steps. ``sluice_series`` reads a Sluice run from the MLflow database its root shares (by
the run id in its ``summary.json``); ``trl_series`` reads ``benchmarks/trl_grpo.py``'s
result. ``benchmarks/peer_trl.py`` builds the table from these, ``benchmarks/figures.py``
the plots.

The clock everything is plotted and timed against is one wall clock for both systems: the
seconds from the end of one step to the end of the next, everything the run does between
them included (for Sluice the driver's work after the trainer's step: acknowledging,
draining metrics, logging, checkpoints), held-out evaluations excluded (Sluice's and TRL's
evaluations take different paths and times; neither is training). Sluice's step ends are
the wall times it logged each step's metrics at, less the evaluations before them
(``eval/seconds``); TRL's are timed by ``benchmarks/trl_grpo.py``'s callback. Throughput
counts every step on that clock; ``rate(..., after_eval=False)`` leaves out the step right
after each evaluation, for both systems alike.
"""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

from benchmarks.trl_grpo import read_result

STALENESS_PREFIX = "train/staleness_count/"
# Steps left out of the per-window medians: the first steps hold one-time costs (vLLM's
# first batches, allocator warm-up) that a long run amortises.
WARMUP_STEPS = 5
# Steps per window for the median throughput: long enough to span a few async batches,
# short enough to give several windows in a quick run.
WINDOW_STEPS = 10


@dataclass
class Phase:
    """One coloured span kind of the timeline, per step: (offset from the step's start, length)."""

    row: str
    label: str
    spans: list[tuple[float, float]]


@dataclass
class Series:
    """One system's run; lists indexed by step - 1 unless named otherwise."""

    label: str
    step_s: list[float]
    samples: list[float]
    tokens: list[float]
    reward: dict[int, float]
    evals: dict[int, float]
    """Held-out accuracy by step (0: the starting policy), on the run's own eval path."""
    phases: list[Phase] = field(default_factory=list)
    staleness: dict[int, int] = field(default_factory=dict)
    loop: tuple[float, float] = (0.0, 0.0)
    """Epoch seconds when training began (after the step-0 evaluation) and ended; the
    window ``benchmarks.cpu_meter`` measures the cores used over (evaluations included)."""

    @property
    def clock(self) -> list[float]:
        """Training seconds at the end of each step (index 0: step 1)."""
        return list(accumulate(self.step_s))

    def clock_at(self, step: int) -> float:
        return 0.0 if step == 0 else self.clock[step - 1]

    def timed_steps(self, after_eval: bool = True) -> list[int]:
        """Indexes of the steps a rate counts: every one, or (``after_eval`` False) all but
        those right after a held-out evaluation, whatever the system (``sync`` generates
        that step's batch during the evaluation, ``async`` restarts its stream after one)."""
        return [i for i in range(len(self.step_s)) if after_eval or i == 0 or i not in self.evals]

    def _rate(self, values: list[float], steps: list[int]) -> float:
        return sum(values[i] for i in steps) / sum(self.step_s[i] for i in steps)

    def rate(self, what: str, after_eval: bool = True) -> float:
        """``samples`` or ``tokens`` per second over the steps ``timed_steps`` names."""
        values = self.samples if what == "samples" else self.tokens
        return self._rate(values, self.timed_steps(after_eval))

    @property
    def samples_per_s(self) -> float:
        return self.rate("samples")

    @property
    def tokens_per_s(self) -> float:
        return self.rate("tokens")

    def window_rates(self, what: str) -> list[float]:
        """``samples`` or ``tokens`` per second in consecutive windows of WINDOW_STEPS steps
        after the warm-up; one short trailing window is dropped."""
        values = self.samples if what == "samples" else self.tokens
        return [
            self._rate(values, list(range(start, start + WINDOW_STEPS)))
            for start in range(WARMUP_STEPS, len(self.step_s) - WINDOW_STEPS + 1, WINDOW_STEPS)
        ]

    def median_rate(self, what: str) -> float:
        rates = self.window_rates(what)
        return statistics.median(rates) if rates else math.nan

    def time_to(self, accuracy: float) -> float | None:
        """Training seconds until the first evaluation at or above ``accuracy`` (None: never)."""
        for step in sorted(self.evals):
            if self.evals[step] >= accuracy:
                return self.clock_at(step)
        return None

    def staleness_mean(self) -> float:
        total = sum(self.staleness.values())
        return sum(k * n for k, n in self.staleness.items()) / total if total else 0.0


def _metrics(db: Path, run_id: str) -> dict[str, dict[int, float]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT key, step, value FROM metrics WHERE run_uuid = ? ORDER BY step, timestamp",
            (run_id,),
        ).fetchall()
    out: dict[str, dict[int, float]] = {}
    for key, step, value in rows:
        out.setdefault(key, {})[int(step)] = float(value)
    return out


def _logged_at(db: Path, run_id: str) -> tuple[float, dict[int, float]]:
    """When the step-0 held-out accuracy was logged, and each step's metrics (epoch s)."""
    with sqlite3.connect(db) as conn:
        (begin,) = conn.execute(
            "SELECT MIN(timestamp) FROM metrics WHERE run_uuid = ? AND key = 'eval/accuracy' "
            "AND step = 0",
            (run_id,),
        ).fetchone()
        ends = conn.execute(
            "SELECT step, MAX(timestamp) FROM metrics WHERE run_uuid = ? AND key = "
            "'perf/step_s' GROUP BY step",
            (run_id,),
        ).fetchall()
    if begin is None or not ends:
        raise ValueError(f"run {run_id} logged no step-0 accuracy or no step")
    return begin / 1000, {int(step): ms / 1000 for step, ms in ends}


def wall_steps(
    begin: float, logged: dict[int, float], eval_s: dict[int, float], steps: list[int]
) -> list[float]:
    """Each step's seconds on the wall clock: from the previous step's logging (the first:
    from ``begin``) to its own, less the evaluation it ran before logging."""
    out, previous = [], begin
    for step in steps:
        out.append(logged[step] - previous - eval_s.get(step, 0.0))
        previous = logged[step]
    return out


def sluice_series(label: str, run_dir: Path, root: Path) -> Series:
    """A finished Sluice run under ``root`` (whose runs share ``root/mlflow.db``)."""
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        raise FileNotFoundError(f"{summary_file} is missing: did the run {run_dir.name} finish?")
    summary = json.loads(summary_file.read_text())
    m = _metrics(root / "mlflow.db", summary["mlflow_run_id"])
    if "perf/step_s" not in m:
        raise ValueError(f"run {run_dir.name} logged no perf/step_s metrics")
    steps = sorted(m["perf/step_s"])
    if steps != list(range(1, len(steps) + 1)):
        raise ValueError(f"run {run_dir.name}: steps {steps[:3]}... are not 1..N")

    def col(key: str, default: float = 0.0) -> list[float]:
        values = m.get(key, {})
        return [values.get(s, default) for s in steps]

    evals = m.get("eval/accuracy", {})
    eval_s = m.get("eval/seconds", {})
    if any(step and step not in eval_s for step in evals):
        raise ValueError(
            f"run {run_dir.name} logged no eval/seconds: its evaluations cannot be taken off "
            "its wall clock (a run from before eval/seconds; run it again)"
        )
    begin, logged = _logged_at(root / "mlflow.db", summary["mlflow_run_id"])
    step_s, rollout_s = wall_steps(begin, logged, eval_s, steps), col("perf/rollout_s")
    train_s, lease_s, compute_s = col("perf/train_s"), col("train/lease_s"), col("train/step_s")
    idle = col("rollout/worker0/idle_fraction", math.nan)
    streaming = summary["mode"] == "async"
    # Laid out from the step's start: batch modes wait for rollouts (t0..t1), train
    # (t1..t2: lease wait, forward/backward/update, publish), then load weights (t2..t3).
    trainer_wait = [r + lease for r, lease in zip(rollout_s, lease_s, strict=True)]
    phases = [
        Phase("trainer", "waiting for data", [(0.0, w) for w in trainer_wait]),
        Phase(
            "trainer",
            "training",
            [(w, c) for w, c in zip(trainer_wait, compute_s, strict=True)],
        ),
    ]
    if streaming:
        # The worker streams the whole step except its idle share (admission control held
        # it back); where in the step that idle time fell is not recorded: drawn at the end.
        idle = [0.0 if math.isnan(i) else i for i in idle]
        generating = [s * (1.0 - i) for s, i in zip(step_s, idle, strict=True)]
        rest = "idle (share of the step)"
        rest_from = generating
    else:
        generating = rollout_s
        rest = "loading weights"
        rest_from = [r + t for r, t in zip(rollout_s, train_s, strict=True)]
    # The rollout row: generating from the step's start, then `rest` until the step's end.
    phases += [
        Phase("rollout", "generating", [(0.0, g) for g in generating]),
        Phase("rollout", rest, [(a, s - a) for a, s in zip(rest_from, step_s, strict=True)]),
    ]
    staleness: dict[int, int] = {}
    for key, values in m.items():
        if key.startswith(STALENESS_PREFIX):
            staleness[int(key.removeprefix(STALENESS_PREFIX))] = int(sum(values.values()))
    return Series(
        label=label,
        step_s=step_s,
        samples=col("train/samples"),
        tokens=col("train/tokens"),
        reward=m.get("rollout/reward", {}),
        evals=evals,
        phases=phases,
        staleness=staleness,
        loop=(begin, logged[steps[-1]]),
    )


def trl_series(label: str, out: Path) -> Series:
    """A finished ``benchmarks/trl_grpo.py`` run whose result lies under ``out``."""
    r = read_result(out)
    if len(r.step_s) != r.steps:
        raise ValueError(f"TRL run under {out} recorded {len(r.step_s)} of {r.steps} steps")
    return Series(
        label=label,
        step_s=r.step_s,
        samples=[float(n) for n in r.samples],
        tokens=[float(n) for n in r.tokens],
        reward={i + 1: v for i, v in enumerate(r.reward)},
        evals=dict(zip(r.eval_steps, r.eval_accuracy, strict=True)),
        phases=[
            Phase("GRPOTrainer", "generating", [(0.0, g) for g in r.generate_s]),
            Phase(
                "GRPOTrainer",
                "training",
                [(g, s - g) for g, s in zip(r.generate_s, r.step_s, strict=True)],
            ),
        ],
        # Generated with the weights it trains: every sample is on-policy.
        staleness={0: int(sum(r.samples))},
        loop=(r.started_at, r.ended_at),
    )
