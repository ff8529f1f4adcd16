"""Held-out evaluation on the rollout workers: ``eval/accuracy`` with greedy decoding and,
with ``eval.k > 1``, mean@k and pass@k. Driven by ``Session.evaluate`` between steps and by
the eval flow's task (``tasks/evaluation.py``).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import cast

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from sluice.driver.restarts import RolloutFailure
from sluice.engines.protocols import Completion
from sluice.engines.rollout.worker import RolloutWorkerClient
from sluice.envs import Problem, RewardResult
from sluice.envs.scoring import Scorer

log = logging.getLogger("sluice")


def evaluate(
    workers: list[RolloutWorkerClient],
    scorer: Scorer,
    problems: list[Problem],
    max_new_tokens: int,
    k: int = 1,
    temperature: float = 1.0,
    episodes: bool = False,
) -> dict[str, float]:
    """Held-out metrics (completions come back here, not to the store): ``eval/accuracy``
    with greedy decoding, and with ``k > 1`` also ``eval/mean_at_<k>`` (the share of right
    samples) and ``eval/pass_at_<k>`` (the share of prompts with a right one) over ``k``
    samples per prompt at ``temperature``.

    A worker that dies meanwhile is left out (Ray restarts it; the next call the rollouts
    make to it waits for the new process): its prompts run again on the workers still
    there. Fails only when none is left. ``episodes``: the environment is multi-turn; the
    workers play each episode to its end and its environment's verdict counts.
    """
    live = list(workers)
    correct = partial(_correct, live, None if episodes else scorer, problems)
    greedy = correct(1, max_new_tokens, 0.0)
    metrics = {"eval/accuracy": sum(c[0] for c in greedy) / len(problems)}
    if k > 1:
        sampled = correct(k, max_new_tokens, temperature)
        metrics[f"eval/mean_at_{k}"] = sum(sum(c) for c in sampled) / (k * len(problems))
        metrics[f"eval/pass_at_{k}"] = sum(any(c) for c in sampled) / len(problems)
    return metrics


def _correct(
    live: list[RolloutWorkerClient],
    scorer: Scorer | None,
    problems: list[Problem],
    n: int,
    max_new_tokens: int,
    temperature: float,
) -> list[list[bool]]:
    """Whether each of ``n`` completions of each problem is correct (without a ``scorer``:
    each of ``n`` episodes); ``live`` loses the workers that die meanwhile."""
    out: list[list[bool]] = [[] for _ in problems]
    left = list(range(len(problems)))
    while left:
        if not live:
            raise RolloutFailure("every rollout worker died during the held-out evaluation")
        asked = [
            (
                w,
                shard,
                w.generate([problems[i].prompt for i in shard], n, max_new_tokens, temperature, 0)
                if scorer is not None
                else w.verdicts([problems[i] for i in shard], n, max_new_tokens, temperature, 0),
            )
            for w, shard in zip(live, (left[j :: len(live)] for j in range(len(live))), strict=True)
            if shard
        ]
        left = []
        for w, shard, ref in asked:
            try:
                got = ray.get(ref)
            except (RayActorError, ActorUnavailableError) as error:
                log.warning(
                    "a rollout worker died during the held-out evaluation (%s); its %d "
                    "prompts run on the others",
                    type(error).__name__,
                    len(shard),
                )
                live.remove(w)
                left += shard
                continue
            results = cast(list[list[RewardResult]], got)  # episodes: their verdicts
            if scorer is not None:  # completions, scored here
                groups = cast(list[list[Completion]], got)
                results = scorer.score(
                    [problems[i] for i in shard],
                    [[c.text for c in g] for g in groups],
                    [[len(c.token_ids) for c in g] for g in groups],
                )
            for i, row in zip(shard, results, strict=True):
                out[i] = [r.correct for r in row]
    return out
