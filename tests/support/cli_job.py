"""A ``sluice`` command run by a test, its output read line by line as it comes.

Used by the end-to-end fault tests (tests/integration/test_faults.py, test_multinode.py):
they wait for a line (a pid, a step), then act on the job (kill a worker, a node).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).parents[2]


class Job:
    """`sluice run`/`resume` in its own process group, its output read line by line."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.log = log.open("a")  # the whole output, for a look after a failure
        self._new: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.flows.cli", *args],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self.log.write(line)
            self.log.flush()
            self._new.put(line)

    def expect(self, pattern: str, timeout: float = 300) -> re.Match[str]:
        """Wait for a line matching ``pattern``; fails with the output so far."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._new.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None and self._new.empty():
                    break
                continue
            found = re.search(pattern, line)
            if found:
                return found
        pytest.fail(f"no line matching {pattern!r}; output:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout: float = 600) -> int:
        return self.proc.wait(timeout=timeout)

    def kill_everything(self) -> None:
        """SIGKILL the job and every process it started (Ray's included): a lost machine."""
        family = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(family, timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill_everything()
