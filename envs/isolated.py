"""User code, named by import path, called many times at once in processes of its own
(``envs/child.py``), with limits: reward functions (``envs/rewards.py``), the steps of a
multi-turn environment (``engines/rollout/episodes.py``) and agents (``envs/agents.py``)
all run in an ``IsolatedPool``.

``IsolatedPool.run`` sends one call (function ``i`` with its keyword arguments), and
``run_group`` a group's calls in one message, to the least-loaded of up to ``workers``
processes and returns futures of their ``Answer``: the value, or why it failed. No call
waits behind a slow one: a process runs a group's quick calls in turn on one thread and
gives any call left behind one that has run for 50 ms a thread of its own
(``envs/child.py``), so a call that hangs costs its own time limit and nothing else. What
can go wrong, and what the pool does:

- a call raises, runs past ``timeout_s`` or returns something that is not JSON data: it
  fails with the reason, answered by its process, which goes on;
- a process dies (the user's code exited or was killed, or ran out of its ``memory_mib``):
  with one call in it, that call fails with how the process ended; with several, nobody
  knows which one did it, so they are split in two and each half is run again in a fresh
  process of its own, and so on, until the call that ends its process is alone in it:
  only that one fails, after about log2(calls) rounds;
- a process stops answering (an async call that blocks the event loop, C code that holds
  the interpreter's lock): ``grace_s`` past a call's time limit it is killed, and its calls
  are split as above; one that makes its process stop answering alone fails as timed out;
- a plain function's call that times out leaves its thread running (threads cannot be
  stopped): after ``RETIRE_AFTER`` of those a process takes no new calls and is stopped
  once its calls are answered.

New processes start on the caller's thread when there is no room in the ones there are;
one that does not start fails the call that needed it with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

GRACE_S = 5.0  # past a call's own time limit, its process is taken to hang
# A process imports the user's module before it answers; a slow import (a large library)
# is not a hang, so it gets longer than one call.
START_TIMEOUT_S = 120.0
RETIRE_AFTER = 8  # timed-out calls whose threads may still run in one process
T = TypeVar("T")


@dataclass(frozen=True)
class Answer:
    """What a call returned (JSON data), or why it failed."""

    value: Any = None
    error: str | None = None


@dataclass
class _Call:
    fn: int
    args: Mapping[str, Any]
    future: Future[Answer]
    deadline: float = 0.0


def _fail(calls: Iterable[_Call], why: str) -> None:
    for call in calls:
        call.future.set_result(Answer(error=why))


@dataclass(eq=False)  # one process is one process: held in sets by identity
class _Child:
    """One process and the calls it holds (by id)."""

    proc: subprocess.Popen[bytes]
    calls: dict[int, _Call] = field(default_factory=dict)
    timeouts: int = 0  # calls it answered as timed out
    retired: bool = False
    overdue: set[int] = field(default_factory=set)  # calls it was killed for
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        line = (json.dumps(message) + "\n").encode()
        with self.lock:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()

    def how_it_ended(self) -> str:
        code = self.proc.wait()
        if code < 0:
            return f"its process ended (killed by {signal.Signals(-code).name})"
        return f"its process ended (exit code {code})"

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # and whatever it forked
        self.proc.wait()


class IsolatedPool:
    """``functions`` (import path, fixed keyword arguments) called in up to ``workers``
    processes, each call within ``timeout_s`` (named ``timeout_setting`` in a timeout's
    reason, where the run configures it)."""

    def __init__(
        self,
        functions: Sequence[tuple[str, Mapping[str, Any]]],
        workers: int = 1,
        timeout_s: float = 120.0,
        memory_mib: int | None = 4096,
        roots: Sequence[str] = (),
        answers: str = "reward",
        timeout_setting: str | None = None,
        grace_s: float = GRACE_S,
    ) -> None:
        self.workers, self.timeout_s, self.grace_s = workers, timeout_s, grace_s
        self._suffix = f" ({timeout_setting})" if timeout_setting else ""
        self._setup = json.dumps(
            {
                "functions": [path for path, _ in functions],
                "args": [dict(args) for _, args in functions],
                "roots": list(roots),
                "memory_mib": memory_mib,
                "timeout_s": timeout_s,
                "answers": answers,
            }
        )
        self._env = {**os.environ, "MALLOC_ARENA_MAX": "2"}  # threads' arenas: address space
        self._lock = threading.Lock()
        self._starting = threading.Lock()
        self._children: list[_Child] = []  # taking calls
        self._all: set[_Child] = set()  # every live process, retired ones too
        self._batched: list[bool] | None = None
        self._ids = 0
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="isolated-watch", daemon=True).start()

    def batched(self) -> list[bool]:
        """Which functions take a whole group (their module, imported in a process, says);
        ``RuntimeError`` when they do not load."""
        with self._starting:
            if self._batched is None:
                child = self._start()
                with self._lock:
                    self._children.append(child)
        assert self._batched is not None
        return self._batched

    def run(self, fn: int, args: Mapping[str, Any]) -> Future[Answer]:
        """Start a call of function ``fn``; its answer comes on the future."""
        return self.run_group(fn, [args])[0]

    def run_group(self, fn: int, each: Sequence[Mapping[str, Any]]) -> list[Future[Answer]]:
        """Start a call of function ``fn`` for each of ``each`` (one process gets them all,
        in one message, and runs them at once); their answers come on the futures."""
        calls = [_Call(fn, args, Future()) for args in each]
        while True:
            try:
                child = self._place()
            except RuntimeError as error:
                _fail(calls, str(error))
                break
            if self._send(child, calls):
                break
        return [call.future for call in calls]

    def _place(self) -> _Child:
        """The least-loaded process, or a new one while all are busy and there is room;
        ``RuntimeError`` when none is there and none starts."""
        with self._starting:  # one start at a time, so that there are never too many
            with self._lock:
                child = min(self._children, key=lambda c: len(c.calls), default=None)
                if child is not None and (not child.calls or len(self._children) >= self.workers):
                    return child
            try:
                started = self._start()
            except RuntimeError:
                if child is None:
                    raise
                return child
            with self._lock:
                self._children.append(started)
            return started

    def _send(self, child: _Child, calls: list[_Call]) -> bool:
        """Give ``calls`` to ``child``; False when its process ended before it could."""
        with self._lock:
            if child not in self._all:
                return False
            ids = range(self._ids, self._ids + len(calls))
            self._ids += len(calls)
            deadline = time.monotonic() + self.timeout_s
            for call_id, call in zip(ids, calls, strict=True):
                call.deadline = deadline
                child.calls[call_id] = call
        message = [
            {"id": call_id, "fn": call.fn, "args": dict(call.args)}
            for call_id, call in zip(ids, calls, strict=True)
        ]
        try:
            child.send({"calls": message})
        except OSError:
            pass  # it just died: its reader fails the calls or runs them again
        except (TypeError, ValueError) as error:  # a call is not JSON data
            for call_id in ids:
                self._finish(child, call_id, Answer(error=str(error)))
        return True

    def _start(self) -> _Child:
        """A new process, ready; ``RuntimeError`` when it does not start or load."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.envs.child", self._setup],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the user's own output: the worker's log
            env=self._env,
            start_new_session=True,  # its own group: a kill takes whatever it forked
        )
        child = _Child(proc)
        first = self._first_line(child)
        ready = json.loads(first) if first else {"fatal": child.how_it_ended()}
        if "fatal" in ready:
            child.kill()
            raise RuntimeError(f"the code does not load: {ready['fatal']}")
        self._batched = [bool(b) for b in ready["batched"]]
        with self._lock:
            self._all.add(child)
        threading.Thread(target=self._read, args=(child,), daemon=True).start()
        return child

    def _first_line(self, child: _Child) -> bytes:
        assert child.proc.stdout is not None
        stdout = child.proc.stdout
        out: list[bytes] = []
        reader = threading.Thread(target=lambda: out.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        if reader.is_alive():
            child.kill()
            raise RuntimeError(f"its process did not start within {START_TIMEOUT_S:g} s")
        return out[0]

    def _read(self, child: _Child) -> None:
        assert child.proc.stdout is not None
        for line in child.proc.stdout:
            try:
                answer = json.loads(line)
            except ValueError:  # not the child's own line: it cannot be trusted further
                child.kill()
                break
            error = answer.get("error")
            if error is not None and error.startswith("timed out"):
                error += self._suffix
                child.timeouts += 1
                if child.timeouts >= RETIRE_AFTER:
                    self._retire(child)
            self._finish(child, answer["id"], Answer(answer.get("ok"), error))
        child.proc.stdout.close()
        if child.proc.stdin is not None:
            with contextlib.suppress(OSError):
                child.proc.stdin.close()
        self._ended(child)

    def _finish(self, child: _Child, call_id: int, answer: Answer) -> None:
        with self._lock:
            call = child.calls.pop(call_id, None)
            done = child.retired and not child.calls
        if done:
            child.kill()
        if call is not None:
            call.future.set_result(answer)

    def _retire(self, child: _Child) -> None:
        with self._lock:
            child.retired = True
            if child in self._children:
                self._children.remove(child)

    def _ended(self, child: _Child) -> None:
        """The process is gone: the call it held fails; calls it held together are split
        in two, each half run again in a process of its own, until the one that ends its
        process is alone in it."""
        how = child.how_it_ended()
        self._retire(child)
        with self._lock:
            self._all.discard(child)
            calls, child.calls = child.calls, {}
        if len(calls) == 1:
            [(call_id, call)] = calls.items()
            if call_id in child.overdue:
                how = f"timed out after {self.timeout_s:g} s{self._suffix}, and its process "
                how += "stopped answering: killed"
            call.future.set_result(Answer(error=how))
        elif self._closed.is_set():
            _fail(calls.values(), "the pool was closed")
        elif calls:
            held = list(calls.values())
            for half in (held[: len(held) // 2], held[len(held) // 2 :]):
                threading.Thread(target=self._run_apart, args=(half,), daemon=True).start()

    def _run_apart(self, calls: list[_Call]) -> None:
        """``calls`` in a fresh process that takes no others and stops once they are answered."""
        while True:
            try:
                child = self._start()
            except RuntimeError as error:
                _fail(calls, str(error))
                return
            child.retired = True
            if self._send(child, calls):
                return

    def _watch(self) -> None:
        """A process whose calls are long past their time limit hangs: it is killed (its
        calls fail or are run again when its output ends)."""
        while not self._closed.wait(0.5):
            now = time.monotonic()
            with self._lock:
                for child in self._all:
                    late = {i for i, c in child.calls.items() if now > c.deadline + self.grace_s}
                    if late:
                        child.overdue |= late
            for child in [c for c in list(self._all) if c.overdue]:
                child.kill()

    def processes(self) -> list[subprocess.Popen[bytes]]:
        """The processes running now (tests watch them)."""
        with self._lock:
            return [child.proc for child in self._all if child.proc.poll() is None]

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            children, self._children = list(self._all), []
        for child in children:
            child.kill()


def outcomes(future: Future[Answer], outcome: Callable[[Answer], T]) -> Future[T]:
    """A future of ``outcome(answer)`` once ``future`` has its answer."""
    mapped: Future[T] = Future()
    future.add_done_callback(lambda done: mapped.set_result(outcome(done.result())))
    return mapped
