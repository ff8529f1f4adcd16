"""Scoring completions: a built-in environment's verifier in-process, or user code (the
user's reward functions, or a plugin environment's ``reward``) in an isolated pool
(``envs/rewards.py``), behind one ``Scorer`` Protocol.

A rollout worker builds its scorer once it runs (``make_scorer``, handed over as a
picklable factory) and scores each finished group with it; the driver does the same for
held-out evaluation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sluice.envs import environment_reward
from sluice.envs.base import Environment, Problem, RewardResult, score
from sluice.envs.rewards import RewardCall, RewardFunction, RewardPool


class Scorer(Protocol):
    """Scores completions of problems; a failure is a ``RewardResult`` with ``error`` set.

    ``isolated``: the scoring runs in other processes and this one only waits (up to the
    pool's timeout), so a streaming worker scores from threads of its own, several groups at
    once, while it goes on decoding; ``score`` is then safe to call from several threads.
    An in-process verifier is not: its time budget is a signal, which only the main thread
    receives, and it takes microseconds anyway.
    """

    isolated: bool

    def score(
        self,
        problems: Sequence[Problem],
        completions: Sequence[Sequence[str]],
        lengths: Sequence[Sequence[int]],
    ) -> list[list[RewardResult]]:
        """``completions[g]`` are the completions of ``problems[g]``, ``lengths[g]`` their
        lengths in tokens; results alike."""
        ...

    def close(self) -> None: ...


class VerifierScorer:
    """The environment's own verifier, in this process, with its time budget."""

    isolated = False

    def __init__(self, env: Environment) -> None:
        self.env = env

    def score(
        self,
        problems: Sequence[Problem],
        completions: Sequence[Sequence[str]],
        lengths: Sequence[Sequence[int]],
    ) -> list[list[RewardResult]]:
        return [
            [score(self.env, p, c) for c in group]
            for p, group in zip(problems, completions, strict=True)
        ]

    def close(self) -> None:
        """Nothing to release: the verifier holds no process or file."""


class RecordedScorer:
    """Verdicts already known (a multi-turn episode's environment gave them as it ended),
    handed out in the scorer's shape."""

    isolated = False

    def __init__(self, results: Sequence[Sequence[RewardResult]]) -> None:
        self.results = [list(group) for group in results]

    def score(
        self,
        problems: Sequence[Problem],
        completions: Sequence[Sequence[str]],
        lengths: Sequence[Sequence[int]],
    ) -> list[list[RewardResult]]:
        return self.results

    def close(self) -> None:
        """Nothing to release."""


class PoolScorer:
    """Reward functions in a ``RewardPool``; a group is scored in one call. ``whole_problem``:
    the functions take the problem itself (a plugin environment's ``reward``), not its
    prompt and fields."""

    isolated = True

    def __init__(self, pool: RewardPool, whole_problem: bool = False) -> None:
        self.pool, self.whole_problem = pool, whole_problem

    def _fields(self, problem: Problem, tokens: int) -> dict[str, Any]:
        if self.whole_problem:
            return {"problem": {**dataclasses.asdict(problem), "fields": dict(problem.fields)}}
        return {"answer": problem.answer, "completion_tokens": tokens, **problem.fields}

    def score(
        self,
        problems: Sequence[Problem],
        completions: Sequence[Sequence[str]],
        lengths: Sequence[Sequence[int]],
    ) -> list[list[RewardResult]]:
        calls = [
            RewardCall(p.prompt, c, self._fields(p, n))
            for p, group, sizes in zip(problems, completions, lengths, strict=True)
            for c, n in zip(group, sizes, strict=True)
        ]
        outcomes = iter(self.pool.score(calls))
        return [
            [
                RewardResult(o.reward, o.correct, o.error, o.metrics)
                for o in (next(outcomes) for _ in group)
            ]
            for group in completions
        ]

    def close(self) -> None:
        self.pool.close()


def make_scorer(
    env: Environment,
    functions: Sequence[RewardFunction] = (),
    workers: int = 1,
    timeout_s: float = 10.0,
    memory_mib: int | None = 4096,
    correct_at: float = 1.0,
    roots: Sequence[str] = (),
    plugin: tuple[str, Mapping[str, Any]] | None = None,
) -> Scorer:
    """The user's functions in a pool if there are any; else, for a ``plugin`` environment
    (its name and constructor arguments), its ``reward`` in a pool; else ``env``'s verifier
    in this process."""
    if functions:
        pool = RewardPool(functions, workers, timeout_s, memory_mib, correct_at, roots)
        return PoolScorer(pool)
    if plugin is not None:
        name, args = plugin
        own = RewardFunction(environment_reward.PATH, 1.0, {"env_name": name, "env_args": args})
        pool = RewardPool([own], workers, timeout_s, memory_mib, correct_at, roots)
        return PoolScorer(pool, whole_problem=True)
    return VerifierScorer(env)
