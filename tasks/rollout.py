"""Generate, score and turn completions into training samples (the sync rollout step)."""

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


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    return [items[i::parts] for i in range(parts)]


def generate(
    workers: list[Any],
    prompts: list[str],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> tuple[list[list[int]], list[list[Completion]]]:
    """Spread prompts over the workers; return prompt ids and completions in prompt order."""
    shards = _split(list(range(len(prompts))), len(workers))
    calls = [
        (
            w.prompt_ids.remote([prompts[i] for i in shard]),
            w.generate.remote([prompts[i] for i in shard], n, max_new_tokens, temperature, seed),
        )
        for w, shard in zip(workers, shards, strict=True)
        if shard
    ]
    ids: list[list[int]] = [[] for _ in prompts]
    completions: list[list[Completion]] = [[] for _ in prompts]
    for shard, (ids_ref, out_ref) in zip([s for s in shards if s], calls, strict=True):
        for i, prompt_ids, outs in zip(shard, ray.get(ids_ref), ray.get(out_ref), strict=True):
            ids[i], completions[i] = prompt_ids, outs
    return ids, completions


def rollout_step(
    workers: list[Any],
    env: Environment,
    problems: list[Problem],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    scale_by_std: bool,
) -> RolloutResult:
    """n completions per problem, scored, with group-relative advantages."""
    prompt_ids, groups = generate(
        workers, [p.prompt for p in problems], n, max_new_tokens, temperature, seed
    )
    rewards, correct, errors = [], 0, 0
    for problem, group in zip(problems, groups, strict=True):
        row = []
        for completion in group:
            result = score(env, problem, completion.text)
            row.append(result.reward)
            correct += result.correct
            errors += result.error is not None
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
        reward_errors=errors,
    )


def evaluate(
    workers: list[Any], env: Environment, problems: list[Problem], max_new_tokens: int
) -> float:
    """Held-out accuracy with greedy decoding."""
    _, groups = generate(workers, [p.prompt for p in problems], 1, max_new_tokens, 0.0, 0)
    return sum(
        score(env, p, g[0].text).correct for p, g in zip(problems, groups, strict=True)
    ) / len(problems)
