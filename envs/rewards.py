"""Reward functions a user names by import path, run isolated in a pool of processes.

The contract (``docs/environments.md``): a reward function is ``module:function``, called as
``fn(prompt=..., completion=..., **fields)`` with the problem's fields (``answer`` and any
columns the data mapping passes on); it may declare only the names it uses. It returns a
number, or a mapping with ``reward`` and any further numbers (logged as metrics) and an
optional ``correct`` bool. ``async def`` functions work the same. A function decorated with
``batched`` is called once per group with lists instead: ``fn(prompts=[...],
completions=[...], **{field: [...]})``, and returns a list.

User code is untrusted: ``RewardPool`` runs it in an ``IsolatedPool`` (``envs/isolated.py``)
of processes with an address-space limit, a per-call timeout, and JSON on the wire both
ways; every call of a group runs at once. A function that raises, hangs, kills its process,
runs out of memory or returns NaN, an infinity or a non-number fails that sample
(``RewardOutcome.error``); the pool replaces a process it lost and goes on. Nothing here
imports Ray or torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sluice.envs.isolated import Answer, IsolatedPool

F = TypeVar("F", bound=Callable[..., Any])
_BATCHED = "__sluice_batched__"
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


class RewardPool:
    """The reward ``functions`` in up to ``workers`` processes (``envs/isolated.py``);
    ``score`` sends every call at once and returns when each has an outcome."""

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
        self.correct_at = correct_at
        self.pool = IsolatedPool(
            [(f.path, f.args) for f in self.functions],
            workers,
            timeout_s,
            memory_mib,
            roots,
            timeout_setting="reward.timeout_s",
        )

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(self, calls: Sequence[RewardCall]) -> list[RewardOutcome]:
        """Every function on every call; one outcome per call."""
        try:
            batched = self.pool.batched()
        except RuntimeError as error:  # the functions do not load: every call fails
            failed = f"reward functions: {error}"[:_ERROR_CHARS]
            return [RewardOutcome(0.0, False, {}, failed) for _ in calls]
        # (function, the calls an answer is for, its future)
        sent: list[tuple[int, list[int], Future[Answer]]] = []
        for f, batch in enumerate(batched):
            if batch and calls:
                args: dict[str, Any] = {
                    "prompts": [c.prompt for c in calls],
                    "completions": [c.completion for c in calls],
                }
                for name in calls[0].fields:
                    args.setdefault(name, [c.fields.get(name) for c in calls])
                sent.append((f, list(range(len(calls))), self.pool.run(f, args)))
            elif not batch:
                each = [
                    {**dict(c.fields), "prompt": c.prompt, "completion": c.completion}
                    for c in calls
                ]
                # in up to ``workers`` parts, one a process
                size = -(-len(each) // self.pool.workers)
                for start in range(0, len(each), size):
                    futures = self.pool.run_group(f, each[start : start + size])
                    sent += [(f, [start + i], future) for i, future in enumerate(futures)]
        answers: list[list[Any]] = [[None] * len(calls) for _ in self.functions]
        errors: list[str | None] = [None] * len(calls)
        wait([future for _, _, future in sent])
        for f, targets, future in sent:
            answer = future.result()
            value = answer.value if batched[f] else [answer.value]
            why = answer.error
            if why is None and (not isinstance(value, list) or len(value) != len(targets)):
                n = len(value) if isinstance(value, list) else type(value).__name__
                why = f"a batched reward returned {n} results for {len(targets)} calls"
            for k, i in enumerate(targets):
                if why is not None:
                    errors[i] = (
                        errors[i] or f"reward {self.functions[f].path}: {why}"[:_ERROR_CHARS]
                    )
                else:
                    answers[f][i] = value[k]
        return [self._outcome(c, answers, errors[c]) for c in range(len(calls))]

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
