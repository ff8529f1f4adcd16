"""CPU seconds used by a process and all its descendants, sampled from /proc while it runs.

The peer comparison runs on a shared machine: when other work holds the cores, a system
of several processes (Sluice's rollout worker, trainer and actors) gets a larger share of
them than a single process (TRL's trainer) at the same nice level. ``CpuMeter`` records
how many cores each run really got, so the table can show it beside the throughput.

A background thread reads ``/proc/<pid>/stat`` (user + system time) of the root process
and every process below it every ``SAMPLE_EVERY_S`` seconds and keeps the last value seen
per process, so a process that exits still counts up to its last sample. Linux only.
``resident_bytes`` reads this process's resident memory from the same place, and
``ResidentKinds`` samples its anonymous and file-backed parts while a phase runs.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Often enough that a short-lived process is seen, rarely enough to cost nothing measurable
# (one pass over /proc takes a few milliseconds).
SAMPLE_EVERY_S = 0.5


def _stat(pid: int) -> tuple[int, int, float] | None:
    """(parent pid, start time in ticks, CPU seconds) of ``pid``; None if it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    ppid, utime, stime, start = int(fields[1]), int(fields[11]), int(fields[12]), int(fields[19])
    return ppid, start, (utime + stime) / TICKS


class CpuMeter:
    """Samples the CPU time of ``root`` and its descendants until ``stop``."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.samples: list[tuple[float, float]] = []  # (time.time(), total CPU seconds)
        self._seen: dict[tuple[int, int], float] = {}  # (pid, start ticks) -> CPU seconds
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def start(self) -> CpuMeter:
        self.sample()  # the baseline: a process started just now has used next to nothing
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._done.wait(SAMPLE_EVERY_S):
            self.sample()

    def sample(self) -> None:
        stats = {}
        for entry in PROC.iterdir():
            if entry.name.isdigit():
                found = _stat(int(entry.name))
                if found is not None:
                    stats[int(entry.name)] = found
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        todo = [self.root] if self.root in stats else []
        while todo:
            pid = todo.pop()
            _, start, cpu = stats[pid]
            self._seen[pid, start] = cpu
            todo += children.get(pid, [])
        self.samples.append((time.time(), sum(self._seen.values())))

    def cpu_between(self, start: float, end: float) -> float:
        """CPU seconds used between two ``time.time()`` instants, interpolated linearly
        between the samples around each (clamped to the first and last sample)."""
        if not self.samples:
            raise ValueError("the meter has no samples: was it started?")
        return self._at(end) - self._at(start)

    def _at(self, when: float) -> float:
        times = [t for t, _ in self.samples]
        i = bisect.bisect_left(times, when)
        if i == 0:
            return self.samples[0][1]
        if i == len(times):
            return self.samples[-1][1]
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1


def resident_bytes(field: str) -> int:
    """This process's ``VmRSS`` (resident now) or ``VmHWM`` (its peak, which writing 5 to
    ``/proc/self/clear_refs`` starts again) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def resident_kinds() -> dict[str, int]:
    """This process's resident bytes now by kind: ``anon`` (its heap: tensors, buffers),
    ``file`` (mapped files' pages: libraries, safetensors read by mmap) and ``shmem``."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        for kind in ("Anon", "File", "Shmem"):
            if line.startswith(f"Rss{kind}:"):
                found[kind.lower()] = int(line.split()[1]) * 1024
    return found


class ResidentKinds:
    """The peak of each kind of this process's resident memory (``resident_kinds``) while a
    phase runs, sampled by a thread every ``every_s``: what a ``VmHWM`` peak was made of.
    A peak shorter than the interval can be missed; the kernel's ``VmHWM`` cannot."""

    def __init__(self, on: bool = True, every_s: float = 0.002) -> None:
        self.on, self.every_s = on, every_s  # off: no thread, no peaks
        self.peaks: dict[str, int] = {}
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ResidentKinds:
        if self.on:
            self.peaks = resident_kinds()
            self._done.clear()
            self._thread = threading.Thread(target=self._run, name="resident-kinds", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            self._thread = None
            self._sample()

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            self._sample()

    def _sample(self) -> None:
        for kind, now in resident_kinds().items():
            self.peaks[kind] = max(self.peaks.get(kind, 0), now)
