"""Generate, score and turn completions into training samples.

A rollout is submitted (the workers start generating at once) and collected later (wait,
verify, compute group-relative advantages), so the flow can train on one batch while the
next one generates (the ``one_step`` mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch

from engines.protocols import Completion
from envs import Environment, Problem, score
from rl.advantages import group_advantages
from rl.batching import Sample


@dataclass(frozen=True)
class RolloutResult:
    samples: list[Sample]
    mean_reward: float
    accuracy: float
    tokens: int
    mean_length: float
    truncated: float
    reward_errors: int
    behaviour_version: int
    sample_ids: list[str]
    prompt_ids: list[str]
    errors: list[str | None]  # the verifier's error per sample, None when it scored cleanly


@dataclass(frozen=True)
class PendingRollout:
    """Generation in flight: the problems, and per worker its prompt indices and result refs."""

    problems: list[Problem]
    shards: list[list[int]]
    refs: list[tuple[Any, Any]]
    behaviour_version: int
    tag: str  # makes sample ids unique when a prompt comes round again


def submit(
    workers: list[Any],
    problems: list[Problem],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    behaviour_version: int = 0,
) -> PendingRollout:
    """Spread the problems over the workers and start generating; returns at once."""
    shards = [
        s for s in (list(range(len(problems)))[i :: len(workers)] for i in range(len(workers))) if s
    ]
    refs = []
    for worker, shard in zip(workers, shards, strict=False):
        prompts = [problems[i].prompt for i in shard]
        refs.append(
            (
                worker.prompt_ids.remote(prompts),
                worker.generate.remote(prompts, n, max_new_tokens, temperature, seed),
            )
        )
    return PendingRollout(problems, shards, refs, behaviour_version, tag=f"r{seed}")


def _gather(pending: PendingRollout) -> tuple[list[list[int]], list[list[Completion]]]:
    size = len(pending.problems)
    ids: list[list[int]] = [[] for _ in range(size)]
    groups: list[list[Completion]] = [[] for _ in range(size)]
    for shard, (ids_ref, out_ref) in zip(pending.shards, pending.refs, strict=True):
        for i, prompt_ids, outs in zip(shard, ray.get(ids_ref), ray.get(out_ref), strict=True):
            ids[i], groups[i] = prompt_ids, outs
    return ids, groups


def collect(pending: PendingRollout, env: Environment, scale_by_std: bool) -> RolloutResult:
    """Wait for the generation, verify every completion, compute GRPO advantages."""
    prompt_ids, groups = _gather(pending)
    rewards, correct, errors = [], 0, []
    for problem, group in zip(pending.problems, groups, strict=True):
        row = []
        for completion in group:
            result = score(env, problem, completion.text)
            row.append(result.reward)
            correct += result.correct
            errors.append(result.error)
        rewards.append(row)
    advantages = group_advantages(torch.tensor(rewards), scale_by_std=scale_by_std)
    samples = [
        Sample(ids, c.token_ids, c.logprobs, float(advantages[g, j]))
        for g, (ids, group) in enumerate(zip(prompt_ids, groups, strict=True))
        for j, c in enumerate(group)
    ]
    completions = [c for group in groups for c in group]
    tokens = sum(len(c.token_ids) for c in completions)
    return RolloutResult(
        samples=samples,
        mean_reward=float(torch.tensor(rewards).mean()),
        accuracy=correct / len(completions),
        tokens=tokens,
        mean_length=tokens / len(completions),
        truncated=sum(not c.finished for c in completions) / len(completions),
        reward_errors=sum(e is not None for e in errors),
        behaviour_version=pending.behaviour_version,
        sample_ids=[
            f"{p.prompt_id}@{pending.tag}/{j}"
            for p, g in zip(pending.problems, groups, strict=True)
            for j in range(len(g))
        ],
        prompt_ids=[p.prompt_id for p, g in zip(pending.problems, groups, strict=True) for _ in g],
        errors=errors,
    )


def evaluate(
    workers: list[Any], env: Environment, problems: list[Problem], max_new_tokens: int
) -> float:
    """Held-out accuracy with greedy decoding."""
    _, groups = _gather(submit(workers, problems, 1, max_new_tokens, 0.0, 0))
    return sum(
        score(env, p, g[0].text).correct for p, g in zip(problems, groups, strict=True)
    ) / len(problems)
