"""Scoring completions: the environment's built-in verifier in-process, or the user's reward
functions in an isolated pool (``envs/rewards.py``), behind one ``Scorer`` Protocol.

A rollout worker builds its scorer once it runs (``make_scorer``, handed over as a
picklable factory) and scores each finished group with it; the driver does the same for
held-out evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sluice.envs.base import Environment, Problem, RewardResult, score
from sluice.envs.rewards import RewardCall, RewardFunction, RewardPool


class Scorer(Protocol):
    """Scores completions of problems; a failure is a ``RewardResult`` with ``error`` set."""

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
        pass


class PoolScorer:
    """The user's reward functions in a ``RewardPool``; a group is scored in one call."""

    def __init__(self, pool: RewardPool) -> None:
        self.pool = pool

    def score(
        self,
        problems: Sequence[Problem],
        completions: Sequence[Sequence[str]],
        lengths: Sequence[Sequence[int]],
    ) -> list[list[RewardResult]]:
        calls = [
            RewardCall(p.prompt, c, {"answer": p.answer, "completion_tokens": n, **p.fields})
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
) -> Scorer:
    """The user's functions in a pool if there are any, else ``env``'s verifier."""
    if not functions:
        return VerifierScorer(env)
    return PoolScorer(RewardPool(functions, workers, timeout_s, memory_mib, correct_at, roots))
