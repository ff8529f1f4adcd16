"""A user's function, named by import path, called many times at once in a process of its
own (``envs/call_child.py``), with limits: the agents of ``env.agent`` (``envs/agents.py``)
and the steps of a multi-turn environment (``engines/rollout/episodes.py``) run this way.

``IsolatedCalls.run`` sends one call's keyword arguments and returns a future of its
outcome; a subclass says what an answer means (``outcome``) and what a failure is
(``failed``). A call that raises, runs past ``timeout_s``, or whose process dies or stops
answering (``grace_s`` past its time limit) fails with the reason; the pool starts a new
process for later calls. The process has ``memory_mib`` of address space.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from sluice.envs.rewards import START_TIMEOUT_S

GRACE_S = 5.0  # past a call's own time limit, the process is taken to hang
T = TypeVar("T")


class _Child:
    """One process and the calls it holds."""

    def __init__(self, setup: str, on_line: Any, on_end: Any) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.envs.call_child", setup],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the function's own output: the worker's log
            env=dict(os.environ),
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        first = self._first_line(START_TIMEOUT_S)
        answer = json.loads(first) if first else {"fatal": self.how_it_ended()}
        if "fatal" in answer:
            self.kill()
            raise RuntimeError(f"it does not load: {answer['fatal']}")
        self.lock = threading.Lock()
        threading.Thread(target=self._read, args=(on_line, on_end), daemon=True).start()

    def _first_line(self, timeout_s: float) -> bytes:
        assert self.proc.stdout is not None
        out: list[bytes] = []
        reader = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive():
            self.kill()
            raise RuntimeError(f"its process did not start within {timeout_s:g} s")
        return out[0]

    def _read(self, on_line: Any, on_end: Any) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            on_line(self, json.loads(line))
        on_end(self, self.how_it_ended())

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with self.lock:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()

    def how_it_ended(self) -> str:
        code = self.proc.wait()
        return f"its process ended (exit code {code})"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class IsolatedCalls(ABC, Generic[T]):
    """Calls ``function`` (an import path) with fixed ``args`` and each call's own."""

    answers = "reward"  # what the function returns: a reward's shape, or "json" data

    def __init__(
        self,
        function: str,
        args: Mapping[str, Any] | None = None,
        timeout_s: float = 120.0,
        memory_mib: int | None = 4096,
        roots: Sequence[str] = (),
        grace_s: float = GRACE_S,
    ) -> None:
        self.function, self.timeout_s, self.grace_s = function, timeout_s, grace_s
        self._setup = json.dumps(
            {
                "function": function,
                "args": dict(args or {}),
                "roots": list(roots),
                "memory_mib": memory_mib,
                "timeout_s": timeout_s,
                "answers": self.answers,
            }
        )
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._runs: dict[int, tuple[_Child, float, Future[T]]] = {}
        self._next = 0
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="isolated-watch", daemon=True).start()

    @abstractmethod
    def outcome(self, value: Any) -> T:
        """What the function's answer means; ``ValueError`` when it is not a valid one."""

    @abstractmethod
    def failed(self, why: str) -> T:
        """A call that failed, with the reason ("raised KeyError: ...", "timed out after
        2 s", "its process ended (exit code 9)")."""

    def run(self, args: Mapping[str, Any]) -> Future[T]:
        """Start one call; its outcome comes on the future."""
        future: Future[T] = Future()
        with self._lock:
            try:
                if self._child is None or self._child.proc.poll() is not None:
                    self._child = _Child(self._setup, self._answered, self._ended)
                child = self._child
            except RuntimeError as error:
                future.set_result(self.failed(str(error)))
                return future
            run, self._next = self._next, self._next + 1
            self._runs[run] = (child, time.monotonic() + self.timeout_s + self.grace_s, future)
        try:
            child.send({"id": run, "args": dict(args)})
        except (OSError, TypeError, ValueError) as error:
            self._finish(run, self.failed(str(error)))
        return future

    def _finish(self, run: int, outcome: T) -> None:
        with self._lock:
            entry = self._runs.pop(run, None)
        if entry is not None:
            entry[2].set_result(outcome)

    def _answered(self, child: _Child, answer: dict[str, Any]) -> None:
        if "error" in answer:
            self._finish(answer["id"], self.failed(answer["error"]))
            return
        try:
            outcome = self.outcome(answer["ok"])
        except ValueError as bad:
            outcome = self.failed(str(bad))
        self._finish(answer["id"], outcome)

    def _ended(self, child: _Child, how: str) -> None:
        """The process is gone: every run it held fails."""
        with self._lock:
            lost = [run for run, (holder, _, _) in self._runs.items() if holder is child]
            if self._child is child:
                self._child = None
        for run in lost:
            self._finish(run, self.failed(how))

    def _watch(self) -> None:
        """A process whose runs are long past their time limit hangs: it is killed (its
        runs fail when its output ends)."""
        while not self._closed.wait(0.5):
            now = time.monotonic()
            with self._lock:
                stuck = {child for child, deadline, _ in self._runs.values() if now > deadline}
            for child in stuck:
                child.kill()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            child.kill()
