"""Start rollouts on the workers and gather their counts; held-out evaluation.

A rollout is submitted (the workers start generating at once) and collected later, so the
flow can train on one batch while the next one generates (the ``one_step`` mode). The
workers score their samples and put them into the trajectory store themselves
(``engines/rollout_worker.py``); what comes back here is counts for the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from engines.rollout_worker import RolloutStats
from envs import Environment, Problem, score


@dataclass(frozen=True)
class RolloutResult:
    samples: int
    mean_reward: float
    accuracy: float
    tokens: int
    mean_length: float
    truncated: float
    reward_errors: int
    behaviour_version: int


@dataclass(frozen=True)
class PendingRollout:
    refs: list[Any]  # one RolloutStats ref per worker that got prompts


def _shards(problems: list[Problem], workers: int) -> list[list[int]]:
    return [s for s in (list(range(len(problems)))[i::workers] for i in range(workers)) if s]


def submit(
    workers: list[Any],
    problems: list[Problem],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    scale_by_std: bool,
) -> PendingRollout:
    """Spread the problems over the workers and start generating; returns at once.

    ``seed`` also tags the sample ids, so a prompt that comes round again gets new ones.
    """
    refs = [
        worker.rollout.remote(
            [problems[i] for i in shard],
            n,
            max_new_tokens,
            temperature,
            seed,
            f"r{seed}",
            scale_by_std,
        )
        for worker, shard in zip(workers, _shards(problems, len(workers)), strict=False)
    ]
    return PendingRollout(refs)


def collect(pending: PendingRollout) -> RolloutResult:
    """Wait until every worker has put its groups into the store; sum their counts."""
    parts: list[RolloutStats] = ray.get(pending.refs)
    samples = sum(p.samples for p in parts)
    tokens = sum(p.tokens for p in parts)
    return RolloutResult(
        samples=samples,
        mean_reward=sum(p.reward_sum for p in parts) / samples,
        accuracy=sum(p.correct for p in parts) / samples,
        tokens=tokens,
        mean_length=tokens / samples,
        truncated=sum(p.truncated for p in parts) / samples,
        reward_errors=sum(p.reward_errors for p in parts),
        behaviour_version=min(p.behaviour_version for p in parts),
    )


def evaluate(
    workers: list[Any], env: Environment, problems: list[Problem], max_new_tokens: int
) -> float:
    """Held-out accuracy with greedy decoding (completions come back here, not to the store)."""
    shards = _shards(problems, len(workers))
    outputs = ray.get(
        [
            w.generate.remote([problems[i].prompt for i in shard], 1, max_new_tokens, 0.0, 0)
            for w, shard in zip(workers, shards, strict=False)
        ]
    )
    correct = 0
    for shard, groups in zip(shards, outputs, strict=True):
        correct += sum(
            score(env, problems[i], g[0].text).correct for i, g in zip(shard, groups, strict=True)
        )
    return correct / len(problems)
