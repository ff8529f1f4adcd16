"""A user's agent function, named by import path, run isolated: many episodes at once in a
process of its own (``envs/agent_child.py``).

The contract (``docs/environments.md``): ``agent(base_url, prompt, **fields)`` plays one
episode against the OpenAI-compatible endpoint at ``base_url`` (an ``openai`` client made
with ``base_url=base_url`` and any api key) and returns the episode's reward, a number or a
mapping with ``reward`` and an optional ``correct`` bool and further numbers. It may be
``async``. ``AgentPool.run`` starts one run and returns a future of its ``AgentOutcome``.
A run that raises, runs past ``timeout_s``, returns something else, or whose process dies
or stops answering, fails with the reason; the pool starts a new process for later runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sluice.envs.rewards import START_TIMEOUT_S, _check_value

GRACE_S = 5.0  # past a run's own time limit, the process is taken to hang
_ERROR_CHARS = 300


@dataclass(frozen=True)
class AgentOutcome:
    reward: float
    correct: bool
    metrics: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None


def _failed(why: str) -> AgentOutcome:
    return AgentOutcome(0.0, False, {}, why[:_ERROR_CHARS])


class _Child:
    """One agent process and the runs it holds."""

    def __init__(self, setup: str, on_line: Any, on_end: Any) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.envs.agent_child", setup],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the agent's own output: the worker's log
            env=dict(os.environ),
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        first = self._first_line(START_TIMEOUT_S)
        answer = json.loads(first) if first else {"fatal": self.how_it_ended()}
        if "fatal" in answer:
            self.kill()
            raise RuntimeError(f"the agent does not load: {answer['fatal']}")
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
            raise RuntimeError(f"the agent process did not start within {timeout_s:g} s")
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
        return f"the agent process ended (exit code {code})"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class AgentPool:
    """Runs ``agent`` (an import path) with fixed ``args`` for each episode it is given."""

    def __init__(
        self,
        agent: str,
        args: Mapping[str, Any] | None = None,
        timeout_s: float = 120.0,
        memory_mib: int | None = 4096,
        correct_at: float = 1.0,
        roots: Sequence[str] = (),
        grace_s: float = GRACE_S,
    ) -> None:
        self.agent, self.timeout_s, self.correct_at = agent, timeout_s, correct_at
        self.grace_s = grace_s
        self._setup = json.dumps(
            {
                "agent": agent,
                "args": dict(args or {}),
                "roots": list(roots),
                "memory_mib": memory_mib,
                "timeout_s": timeout_s,
            }
        )
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._runs: dict[int, tuple[_Child, float, Future[AgentOutcome]]] = {}
        self._next = 0
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="agent-watch", daemon=True).start()

    def run(self, args: Mapping[str, Any]) -> Future[AgentOutcome]:
        """Start one episode's run; its outcome comes on the future."""
        future: Future[AgentOutcome] = Future()
        with self._lock:
            try:
                if self._child is None or self._child.proc.poll() is not None:
                    self._child = _Child(self._setup, self._answered, self._ended)
                child = self._child
            except RuntimeError as error:
                future.set_result(_failed(str(error)))
                return future
            run, self._next = self._next, self._next + 1
            self._runs[run] = (child, time.monotonic() + self.timeout_s + self.grace_s, future)
        try:
            child.send({"id": run, "args": dict(args)})
        except (OSError, TypeError, ValueError) as error:
            self._finish(run, _failed(f"agent {self.agent}: {error}"))
        return future

    def _finish(self, run: int, outcome: AgentOutcome) -> None:
        with self._lock:
            entry = self._runs.pop(run, None)
        if entry is not None:
            entry[2].set_result(outcome)

    def _answered(self, child: _Child, answer: dict[str, Any]) -> None:
        if "error" in answer:
            self._finish(answer["id"], _failed(f"agent {self.agent}: {answer['error']}"))
            return
        try:
            reward, metrics, correct = _check_value(answer["ok"])
        except ValueError as bad:
            self._finish(answer["id"], _failed(f"agent {self.agent}: {bad}"))
            return
        verdict = correct if correct is not None else reward >= self.correct_at
        self._finish(answer["id"], AgentOutcome(reward, verdict, metrics))

    def _ended(self, child: _Child, how: str) -> None:
        """The process is gone: every run it held fails."""
        with self._lock:
            lost = [run for run, (holder, _, _) in self._runs.items() if holder is child]
            if self._child is child:
                self._child = None
        for run in lost:
            self._finish(run, _failed(f"agent {self.agent}: {how}"))

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
