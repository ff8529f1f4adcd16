"""Weight sync watched over a run: the seconds each weight load took, a warning when one
takes far longer than the run's median, and the trend at the end (the run's summary).

The flow's ``rl_step`` hands each step's metrics to ``SyncWatch.observe``: in ``async`` the
rollout workers' pull seconds and loads of the step (``rollout/worker<i>/weight_pull_s``,
``.../weight_loads``, from ``driver/stream.py``), in the batch modes the step's weight sync
(``perf/weight_sync_s``: every worker loading the new version). A sync that slows down
step by step (verl-project/verl#4896: seconds growing to 25 minutes) shows as warnings and
as a last tenth slower than the first. The history starts again after a resume.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

SLOW_FACTOR = 5.0  # a load this many times the run's median so far is worth a warning
MIN_SLOW_S = 1.0  # ... and this long: the tiny policy's loads take milliseconds, or none
WARMUP = 5  # loads seen before the median is trusted
_PULL = re.compile(r"rollout/worker(\d+)/weight_pull_s")


@dataclass
class SyncWatch:
    """Each weight load's seconds, in the order they came, with the step they came in."""

    factor: float = SLOW_FACTOR
    loads: list[tuple[int, float]] = field(default_factory=list)

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """Record the step's loads; warnings for those slower than ``factor`` times the
        median of the run's loads before them (and than ``MIN_SLOW_S``). Never raises on
        what it reads: watching must not fail a run."""
        seen: list[tuple[str, float]] = []
        for key, seconds in metrics.items():
            if match := _PULL.fullmatch(key):
                loads = metrics.get(f"rollout/worker{match.group(1)}/weight_loads", 0.0)
                if loads >= 1:
                    seen.append((f"rollout worker {match.group(1)}", seconds / loads))
        if not seen and "perf/weight_sync_s" in metrics:
            seen.append(("the rollout workers", metrics["perf/weight_sync_s"]))
        warnings = []
        for who, seconds in seen:
            if len(self.loads) >= WARMUP:
                median = statistics.median(s for _, s in self.loads)
                if seconds > max(self.factor * median, MIN_SLOW_S):
                    times = f"{seconds / median:.0f}x " if median > 0 else ""
                    warnings.append(
                        f"step {step}: {who} took {seconds:.2f} s to load a weight version, "
                        f"{times}the run's median ({median:.2f} s)"
                    )
            self.loads.append((step, seconds))
        return warnings

    def median(self) -> float | None:
        """The median seconds of the run's loads so far; None before any."""
        return statistics.median(s for _, s in self.loads) if self.loads else None

    def trend(self) -> str | None:
        """One line on the run's weight loads: their median, the first and the last tenth's
        medians, and the slowest; None before any load."""
        if not self.loads:
            return None
        seconds = [s for _, s in self.loads]
        tenth = max(1, len(seconds) // 10)
        step, slowest = max(self.loads, key=lambda load: load[1])
        return (
            f"weight loads: {len(seconds)}, median {statistics.median(seconds):.2f} s; first "
            f"tenth {statistics.median(seconds[:tenth]):.2f} s, last tenth "
            f"{statistics.median(seconds[-tenth:]):.2f} s; slowest {slowest:.2f} s (step {step})"
        )
