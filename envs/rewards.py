"""Reward functions a user names by import path, run isolated in a pool of processes.

The contract (``docs/environments.md``): a reward function is ``module:function``, called as
``fn(prompt=..., completion=..., **fields)`` with the problem's fields (``answer`` and any
columns the data mapping passes on); it may declare only the names it uses. It returns a
number, or a mapping with ``reward`` and any further numbers (logged as metrics) and an
optional ``correct`` bool. ``async def`` functions work the same. A function decorated with
``batched`` is called once per group with lists instead: ``fn(prompts=[...],
completions=[...], **{field: [...]})``, and returns a list.

User code is untrusted: ``RewardPool`` runs it in worker processes
(``envs/reward_child.py``) with an address-space limit, a per-call timeout, and JSON on
the wire both ways. A function that raises, hangs, kills its process, runs out of memory or
returns NaN, an infinity or a non-number fails that sample (``RewardOutcome.error``); the
pool replaces a process it lost and goes on. Nothing here imports Ray or torch.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_BATCHED = "__sluice_batched__"
# A pool process imports the user's module before it answers; a slow import (a large
# library) is not a hang, so it gets longer than one call.
START_TIMEOUT_S = 120.0
# How much of an error message reaches the ledger and the console.
_ERROR_CHARS = 300


def batched(fn: F) -> F:
    """Mark ``fn`` as taking a whole group at once: lists in, a list of results out."""
    setattr(fn, _BATCHED, True)
    return fn


def is_batched(fn: Callable[..., Any]) -> bool:
    return bool(getattr(getattr(fn, "func", fn), _BATCHED, False))  # through a partial


def import_function(path: str) -> Callable[..., Any]:
    """The callable at ``path`` (``package.module:name``); ``ValueError`` naming what is wrong."""
    module_name, sep, name = path.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{path!r} is not an import path of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ValueError(
            f"{path!r}: module {module_name!r} does not import ({type(error).__name__}: {error}); "
            "is its folder on PYTHONPATH or the package installed?"
        ) from error
    target: Any = module
    for part in name.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{path!r}: module {module_name!r} has no attribute {name!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{path!r} is a {type(target).__name__}, not a function")
    return target


def module_root(path: str) -> str | None:
    """The folder on ``sys.path`` that ``path``'s top-level package was imported from, so
    that processes started elsewhere (Ray actors, pool processes) can import it too."""
    top = path.partition(":")[0].split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is not None and spec.origin is None and spec.submodule_search_locations:
        # a namespace package (a folder without __init__.py): its parent
        return os.path.abspath(os.path.dirname(next(iter(spec.submodule_search_locations))))
    origin = spec.origin if spec is not None else None
    if origin is None or origin in ("built-in", "frozen"):
        return None
    folder = os.path.dirname(origin)
    if spec is not None and spec.submodule_search_locations:  # a package: its parent
        folder = os.path.dirname(folder)
    return os.path.abspath(folder)


def check_signature(path: str, fn: Callable[..., Any], names: Sequence[str]) -> None:
    """Raise ``ValueError`` unless ``fn`` can be called with the keyword arguments ``names``
    (singular for a plain function, ``prompts``/``completions`` for a batched one)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # builtins without a signature: the first call says
    given = set(_call_names(names, is_batched(fn)))
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    missing = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        and p.name not in given
    ]
    if missing:
        raise ValueError(
            f"reward {path!r} requires {', '.join(map(repr, missing))}, which the run does not "
            f"pass; it is called with {', '.join(sorted(given))}"
        )
    if not takes_any and not {"prompt", "completion", "prompts", "completions"} & {
        p.name for p in params
    }:
        raise ValueError(
            f"reward {path!r} takes neither the completion nor **fields: its parameters are "
            f"{', '.join(p.name for p in params) or 'none'}"
        )


def _call_names(fields: Sequence[str], batch: bool) -> list[str]:
    base = ["prompts", "completions"] if batch else ["prompt", "completion"]
    return base + [f for f in fields if f not in base]


def accepted_names(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword names ``fn`` declares; None if it takes any (``**kwargs``, or no
    signature to read). A call passes only these, so a function declares what it uses."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


@dataclass(frozen=True)
class RewardFunction:
    """One configured reward function and its weight in the sum."""

    path: str
    weight: float = 1.0
    args: Mapping[str, Any] = field(default_factory=dict)  # fixed keyword arguments

    @property
    def name(self) -> str:
        return self.path.rpartition(":")[2]


@dataclass(frozen=True)
class RewardCall:
    """One completion to score, with the problem's prompt and fields."""

    prompt: str
    completion: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardOutcome:
    """The weighted sum of every function's reward for one call, or why it failed."""

    reward: float
    correct: bool
    metrics: dict[str, float]
    error: str | None = None


def _check_value(value: Any) -> tuple[float, dict[str, float], bool | None]:
    """(reward, metrics, correct or None) from one function's answer; ``ValueError`` if bad."""
    if isinstance(value, float):
        reward, extra = value, {}
    elif isinstance(value, dict):
        if "reward" not in value or not isinstance(value["reward"], float):
            raise ValueError(f"returned a mapping without a numeric 'reward': {sorted(value)}")
        reward, extra = value["reward"], value
    else:
        raise ValueError(f"returned {type(value).__name__}, not a number")
    if not math.isfinite(reward):
        raise ValueError(f"returned {reward!r}, not a finite number")
    metrics: dict[str, float] = {}
    correct = None
    for key, item in extra.items():
        if key == "reward":
            continue
        if key == "correct":
            if not isinstance(item, bool):
                raise ValueError(f"'correct' is {item!r}, not a bool")
            correct = item
        elif isinstance(item, bool):
            metrics[key] = float(item)
        elif isinstance(item, float) and math.isfinite(item):
            metrics[key] = item
        else:
            raise ValueError(f"metric {key!r} is {item!r}, not a finite number")
    return reward, metrics, correct


@dataclass
class _Job:
    """One request to a pool process: function ``fn`` on ``calls``. ``args`` is one call's
    keyword arguments (``batch``: lists of the group's); ``each``: one mapping per call, the
    function called on each in turn, each answered as it returns (one request a group
    instead of one round trip a sample)."""

    fn: int
    calls: list[int]  # the calls this job answers for
    args: dict[str, Any] | list[dict[str, Any]]
    batch: bool = False

    @property
    def each(self) -> bool:
        return isinstance(self.args, list)

    @property
    def lines(self) -> int:
        """How many answer lines the job gets: one a call for ``each``, else one."""
        return len(self.calls) if self.each else 1

    def rest(self, start: int) -> _Job | None:
        """The calls of an ``each`` job from ``start`` on, as a job of their own (None if
        there are none): what is left when the call before them hung or killed its process."""
        assert isinstance(self.args, list)
        if start >= len(self.calls):
            return None
        return _Job(self.fn, self.calls[start:], self.args[start:])


@dataclass
class _Running:
    """A job sent to a pool process: its answers so far and when the next one is due."""

    job: _Job
    deadline: float
    answered: int = 0


class _Process:
    """One pool process: a child that imports the functions and answers JSON lines."""

    def __init__(self, setup: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.envs.reward_child", setup],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own group: a kill takes whatever it forked
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.fd = self.proc.stdin, self.proc.stdout.fileno()
        self._buffer = b""

    def read_line(self, timeout_s: float) -> bytes | None:
        """One answer line; None at end of file. ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise TimeoutError
            if not self.feed():
                return None
        return self.take_line()

    def feed(self) -> bool:
        """Read what is there; False at end of file."""
        chunk = os.read(self.fd, 1 << 16)
        self._buffer += chunk
        return bool(chunk)

    def take_line(self) -> bytes | None:
        if b"\n" not in self._buffer:
            return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def send(self, job: _Job) -> None:
        request = {"fn": job.fn, "each" if job.each else "args": job.args}
        self.stdin.write((json.dumps(request) + "\n").encode())
        self.stdin.flush()

    def how_it_ended(self) -> str:
        code = self.proc.wait()
        if code < 0:
            return f"the reward process was killed by {signal.Signals(-code).name}"
        return f"the reward process exited with code {code}"

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.stdin.close()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


class RewardPool:
    """``workers`` processes that run the reward ``functions``; ``score`` blocks until every
    call has an outcome. Not thread-safe: one caller (a rollout worker) at a time."""

    def __init__(
        self,
        functions: Sequence[RewardFunction],
        workers: int = 1,
        timeout_s: float = 10.0,
        memory_mib: int | None = 4096,
        correct_at: float = 1.0,
        roots: Sequence[str] = (),
    ) -> None:
        if not functions:
            raise ValueError("a reward pool needs at least one function")
        self.functions = list(functions)
        self.timeout_s, self.correct_at = timeout_s, correct_at
        # Which functions take a whole group: the first pool process says (user code is
        # imported there, not in the caller's process).
        self._batched: list[bool] | None = None
        self._setup = json.dumps(
            {
                "functions": [f.path for f in self.functions],
                "args": [dict(f.args) for f in self.functions],
                "roots": list(roots),
                "memory_mib": memory_mib,
            }
        )
        self._env = dict(os.environ)
        self._slots: list[_Process | None] = [None] * workers

    def close(self) -> None:
        for i, slot in enumerate(self._slots):
            if slot is not None:
                slot.kill()
                self._slots[i] = None

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, i: int) -> _Process:
        slot = _Process(self._setup, self._env)
        try:
            line = slot.read_line(START_TIMEOUT_S)
        except TimeoutError:
            slot.kill()
            raise RuntimeError(
                f"a reward process did not start within {START_TIMEOUT_S:g} s"
            ) from None
        answer = json.loads(line) if line else {"fatal": slot.how_it_ended()}
        if "fatal" in answer:
            slot.kill()
            raise RuntimeError(f"the reward functions do not load: {answer['fatal']}")
        self._batched = [bool(b) for b in answer["batched"]]
        self._slots[i] = slot
        return slot

    def _live(self, i: int) -> _Process:
        """Slot ``i``'s process, started (again) if it has none or it ended."""
        slot = self._slots[i]
        if slot is not None and slot.proc.poll() is None:
            return slot
        if slot is not None:
            slot.kill()
            self._slots[i] = None
        return self._start(i)

    def _jobs(self, calls: Sequence[RewardCall]) -> list[_Job]:
        if self._batched is None:
            self._live(0)
        assert self._batched is not None
        jobs = []
        for f, batch in enumerate(self._batched):
            if batch:
                args: dict[str, Any] = {
                    "prompts": [c.prompt for c in calls],
                    "completions": [c.completion for c in calls],
                }
                for name in calls[0].fields if calls else ():
                    args.setdefault(name, [c.fields.get(name) for c in calls])
                jobs.append(_Job(f, list(range(len(calls))), args, batch=True))
            else:
                each = [
                    {**dict(c.fields), "prompt": c.prompt, "completion": c.completion}
                    for c in calls
                ]
                if len(each) == 1:
                    jobs.append(_Job(f, [0], each[0]))
                elif each:
                    jobs.append(_Job(f, list(range(len(calls))), each))
        return jobs

    def score(self, calls: Sequence[RewardCall]) -> list[RewardOutcome]:
        """Every function on every call, spread over the pool; one outcome per call."""
        answers: list[list[Any]] = [[None] * len(calls) for _ in self.functions]
        errors: list[str | None] = [None] * len(calls)

        def fail(job: _Job, why: str, calls: Sequence[int] | None = None) -> None:
            path = self.functions[job.fn].path
            for i in job.calls if calls is None else calls:
                errors[i] = errors[i] or f"reward {path}: {why}"[:_ERROR_CHARS]

        def lost(i: int, why: str) -> None:
            """Slot ``i``'s process hung or ended: the call it was on fails; the calls of
            its group after that one go back to the queue."""
            r = running.pop(i)
            if r.job.each:
                fail(r.job, why, [r.job.calls[r.answered]])
                if (rest := r.job.rest(r.answered + 1)) is not None:
                    queue.appendleft(rest)
            else:
                fail(r.job, why)
            slot = self._slots[i]
            assert slot is not None
            slot.kill()
            self._slots[i] = None

        try:
            queue = deque(self._jobs(calls))
        except RuntimeError as error:  # the functions do not load: every call fails
            return [RewardOutcome(0.0, False, {}, str(error)[:_ERROR_CHARS]) for _ in calls]
        running: dict[int, _Running] = {}
        while queue or running:
            for i in range(len(self._slots)):
                if not queue:
                    break
                if i in running:
                    continue
                job = queue.popleft()
                try:
                    self._live(i).send(job)
                except (RuntimeError, OSError, TypeError, ValueError) as error:
                    # could not start, it just died, or the call is not JSON data
                    fail(job, str(error))
                    continue
                running[i] = _Running(job, time.monotonic() + self.timeout_s)
            if not running:
                continue
            now = time.monotonic()
            wait = max(0.0, min(r.deadline for r in running.values()) - now)
            fds = {self._slots[i].fd: i for i in running}  # type: ignore[union-attr]
            for fd in select.select(list(fds), [], [], wait)[0]:
                i = fds[fd]
                slot = self._slots[i]
                assert slot is not None
                ended = not slot.feed()
                while i in running and (line := slot.take_line()) is not None:
                    r = running[i]
                    self._record(r, json.loads(line), answers, fail)
                    r.answered += 1
                    r.deadline = time.monotonic() + self.timeout_s  # per call
                    if r.answered == r.job.lines:
                        del running[i]
                if ended and i in running:
                    lost(i, slot.how_it_ended())
            now = time.monotonic()
            for i in [i for i, r in running.items() if now >= r.deadline]:
                lost(i, f"timed out after {self.timeout_s:g} s (reward.timeout_s)")
        return [self._outcome(c, answers, errors[c]) for c in range(len(calls))]

    def _record(
        self,
        running: _Running,
        answer: dict[str, Any],
        answers: list[list[Any]],
        fail: Callable[[_Job, str, Sequence[int] | None], None],
    ) -> None:
        """One answer line of ``running``'s job: for an ``each`` job, its next call's."""
        job = running.job
        targets = [job.calls[running.answered]] if job.each else job.calls
        if "error" in answer:
            fail(job, str(answer["error"]), targets)
            return
        value = answer["ok"]
        if job.batch:
            if not isinstance(value, list) or len(value) != len(targets):
                n = len(value) if isinstance(value, list) else type(value).__name__
                fail(job, f"a batched reward returned {n} results for {len(targets)} calls", None)
                return
        else:
            value = [value]
        for i, item in zip(targets, value, strict=True):
            answers[job.fn][i] = item

    def _outcome(self, c: int, answers: list[list[Any]], error: str | None) -> RewardOutcome:
        if error is not None:
            return RewardOutcome(0.0, False, {}, error)
        total, metrics, verdicts = 0.0, {}, []
        for f, function in enumerate(self.functions):
            try:
                reward, extra, correct = _check_value(answers[f][c])
            except ValueError as bad:
                return RewardOutcome(0.0, False, {}, f"reward {function.path}: {bad}")
            total += function.weight * reward
            metrics[function.name] = reward
            metrics.update({f"{function.name}/{k}": v for k, v in extra.items()})
            if correct is not None:
                verdicts.append(correct)
        correct = all(verdicts) if verdicts else total >= self.correct_at
        return RewardOutcome(total, correct, metrics)
