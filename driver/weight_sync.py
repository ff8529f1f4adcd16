"""Weight sync watched over a run: the seconds each weight load took, a warning when one
takes far longer than the run's median, and the trend at the end (the run's summary); and
what each rollout worker serves, checked against what the trainer published
(``ServedWeights``).

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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sluice.engines.rollout.messages import Served
from sluice.storage.params import digest_number

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


class WeightsMismatch(RuntimeError):
    """A rollout worker serves weights that are not its version as the trainer published it:
    the segment fails (and is retried from its checkpoint)."""


@dataclass
class ServedWeights:
    """What each rollout worker serves, checked against what the trainer published.

    Each worker reports the version its engine holds and the digest of what the engine read
    of it (``RolloutWorker.load``: every bucket checked against the trainer's digest on
    arrival, and the version's digest only once the engine read all of it). ``check``
    compares that with relay 0's record of the published digest, so a worker that skipped a
    load or loaded part of one, or serves other bytes under the version's number, fails the
    segment naming the worker; and it warns once when a worker has served a version older
    than the trainer's for longer than ``stale_after_s`` (``weights.pull_timeout_s``), the
    way an adapter that never reached the engine looks like staleness
    (verl-project/verl#7495).
    """

    published: Callable[[int], str | None]  # ParameterService.published_digest
    stale_after_s: float
    known: dict[int, str] = field(default_factory=dict)  # version: its published digest
    serving: dict[int, tuple[int, float]] = field(default_factory=dict)  # worker: version, since
    warned: set[tuple[int, int]] = field(default_factory=set)

    def loaded(self, worker: int, served: Served, newest: int) -> list[str]:
        """``check`` of what a worker's ``sync_weights`` answered (the batch modes)."""
        return self.check(worker, served.version, digest_number(served.digest), newest)

    def check(
        self, worker: int, version: int, digest: float, newest: int, now: float | None = None
    ) -> list[str]:
        """Raise ``WeightsMismatch`` if ``digest`` (``digest_number`` of what the worker
        loaded) is not ``version``'s as published; warnings for a worker that has served an
        old version too long. Version 0 (the starting policy, read from the model folder)
        and versions relay 0 has no record of are not compared."""
        now = time.monotonic() if now is None else now
        want = self.known.get(version) if version > 0 else None
        if want is None and version > 0 and (want := self.published(version)) is not None:
            self.known[version] = want
        if want is not None and digest != digest_number(want):
            loaded = (
                f"{int(digest):013x}..." if digest else "none: it did not read the whole version"
            )
            raise WeightsMismatch(
                f"rollout worker {worker} reports version {version}, but what its engine "
                f"loaded is not version {version} as the trainer published it (digest "
                f"{loaded}, published {want[:13]}...): it skipped or cut short a load, or "
                "loaded other bytes. The segment is retried from its checkpoint"
            )
        held = self.serving.get(worker)
        if held is None or held[0] != version:
            self.serving[worker] = (version, now)
            return []
        served_s = now - held[1]
        if version >= newest or served_s <= self.stale_after_s or (worker, version) in self.warned:
            return []
        self.warned.add((worker, version))
        return [
            f"rollout worker {worker} has served version {version} for {served_s:.0f} s while "
            f"the trainer is at version {newest}: longer than weights.pull_timeout_s "
            f"({self.stale_after_s:g} s); is its weight pull stuck?"
        ]
