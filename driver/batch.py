"""``sync`` and ``one_step``: one batch a step, split over every rollout worker.

A batch is submitted (the workers start generating at once) and collected later, so a
``one_step`` run trains on one batch while the next one generates; when each happens is
``driver/modes.py: batch_step``. The workers score their samples and put them into the
trajectory store themselves (``engines/rollout/worker.py``); what comes back here is counts
for the metrics. A worker whose process dies is restarted by Ray and its part of the batch
is made again under a new tag; the batch modes wait for it (each batch is split over every
worker).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ray.exceptions import RayActorError

from sluice.config.tree import RunConfig
from sluice.driver.restarts import Restarts, Waiter
from sluice.driver.rollout_metrics import RewardFailures, RolloutResult, rollout_metrics
from sluice.driver.weight_sync import ServedWeights
from sluice.engines.rollout.messages import BatchShard, RolloutStats, Served
from sluice.engines.rollout.worker import RolloutWorkerClient
from sluice.envs import Problem
from sluice.envs.prompts import PromptSource
from sluice.rl.advantages import Credit

log = logging.getLogger("sluice")


@dataclass(frozen=True)
class ShardCall:
    """One worker's part of a batch: enough to submit it again if the worker dies."""

    worker: int
    problems: list[Problem]
    shard: BatchShard

    def submit(self, workers: list[RolloutWorkerClient], retry: int = 0) -> Any:
        shard = self.shard
        if retry:
            shard = replace(shard, tag=f"{shard.tag}x{retry}")
        return workers[self.worker].rollout(self.problems, shard)


@dataclass(frozen=True)
class PendingRollout:
    refs: list[Any]  # one RolloutStats ref per worker that got prompts
    calls: list[ShardCall]


def _shards(problems: list[Problem], workers: int) -> list[list[int]]:
    return [s for s in (list(range(len(problems)))[i::workers] for i in range(workers)) if s]


def credit_of(cfg: RunConfig) -> Credit:
    """How a run's groups turn rewards into advantages, from its ``train`` section; the
    rollout workers apply it as each group finishes (both kinds of rollout). With a critic
    the rows carry each sample's (shaped) reward, which the trainer's GAE starts from."""
    t = cfg.train
    estimator = "reinforce_pp" if t.critic is not None else t.advantage  # the reward itself
    return Credit(
        estimator, t.scale_adv_by_std, t.overlong_buffer, t.overlong_penalty,
        cfg.rollout.max_new_tokens,
    )  # fmt: skip


def submit(
    workers: list[RolloutWorkerClient],
    problems: list[Problem],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    credit: Credit,
    tag: str = "",
    version: int = 0,
    pull_timeout_s: float = 120.0,
) -> PendingRollout:
    """Spread the problems over the workers and start generating; returns at once.

    ``seed`` also tags the sample ids, so a prompt that comes round again gets new ones.
    ``version``: the policy version to generate with (a restarted worker loads it first).
    """
    shard = BatchShard(
        n,
        max_new_tokens,
        temperature,
        seed,
        f"{tag}r{seed}",
        credit,
        version,
        pull_timeout_s,
    )
    # Each worker's part is tagged apart, and its groups are numbered within it: a prompt
    # can come twice in one batch (a stream's epoch ends and the next begins in the batch).
    calls = [
        ShardCall(w, [problems[i] for i in part], replace(shard, tag=f"{shard.tag}w{w}"))
        for w, part in enumerate(_shards(problems, len(workers)))
    ]
    return PendingRollout([c.submit(workers) for c in calls], calls)


def summed(parts: list[RolloutStats]) -> RolloutResult:
    """The counts of every worker's part of a batch, added up."""
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
        reward_metrics={
            name: sum(p.reward_metrics.get(name, 0.0) for p in parts)
            for name in {name for p in parts for name in p.reward_metrics}
        },
        reward_messages=tuple(m for p in parts for m in p.reward_messages),
        episode_counts={
            name: sum(p.episode_counts.get(name, 0.0) for p in parts)
            for name in {name for p in parts for name in p.episode_counts}
        },
    )


class BatchRollouts:
    """``sync`` and ``one_step``: one batch per step, spread over every worker, each batch
    generated by one policy version. ``driver/modes.py: batch_step`` says when a batch is
    generated; this holds the batch in flight and the calls that wait for it."""

    def __init__(
        self,
        cfg: RunConfig,
        workers: list[RolloutWorkerClient],
        prompts: PromptSource,
        wait: Waiter,
        served: ServedWeights,
        tag: str = "",
        lag: int = 0,
    ) -> None:
        self.cfg, self.r = cfg, cfg.rollout
        self.served = served  # what each worker serves, against what was published
        self.workers, self.prompts, self.wait, self.tag = workers, prompts, wait, tag
        self.lag = lag  # versions a batch's weights trail the step before it (one_step: 1)
        self.pending: PendingRollout | None = None
        self.result: RolloutResult | None = None
        self.restarts = Restarts(workers, cfg.rollout.max_restarts)
        self.failures = RewardFailures()
        self.step = 0  # the trainer's version when ``start`` is called

    def generate(self, step: int) -> None:
        """Start the batch step ``step`` trains on: the workers generate it at once, with
        the version ``lag`` behind the step before (a restarted worker loads it first)."""
        self.pending = submit(
            self.workers,
            self.prompts.take(self.r.prompts_per_step),
            self.r.samples_per_prompt,
            self.r.max_new_tokens,
            self.r.temperature,
            seed=self.cfg.seed * 1_000_003 + step,
            credit=credit_of(self.cfg),
            tag=self.tag,
            version=max(0, step - 1 - self.lag),
            pull_timeout_s=self.cfg.weights.pull_timeout_s,
        )

    def start(self) -> None:
        self.generate(self.step + 1)

    def _each(self, refs: list[Any], again: Callable[[int, int], Any], what: str) -> list[Any]:
        """Wait for one call per worker; a worker that died gets ``again(worker, retry)``."""
        out = []
        for w, ref in enumerate(refs):
            retry = 0
            while True:
                try:
                    out.append(self.wait(ref, what))
                    break
                except RayActorError as error:
                    retry += 1
                    self.restarts.died(w, error, f"its {what} call is made again")
                    self.restarts.wait_back(w)
                    ref = again(w, retry)
        return out

    def collect(self) -> None:
        """Wait for the batch in flight: its groups are scored and in the store once every
        worker's part came back (a dead worker's part is made again)."""
        pending = self.pending
        assert pending is not None, "no batch is being generated"
        self.result = summed(
            self._each(
                pending.refs,
                lambda w, retry: pending.calls[w].submit(self.workers, retry),
                "rollouts",
            )
        )
        self.pending = None

    def load(self, step: int) -> None:
        """Every worker loads version ``step``; the call queues behind a worker's generation,
        so a batch already generating (``one_step``) keeps its weights."""
        timeout = self.cfg.weights.pull_timeout_s

        def pull(w: int, retry: int = 0) -> Any:
            return self.workers[w].sync_weights(step, timeout)

        loaded: list[Served] = self._each(
            [pull(w) for w in range(len(self.workers))], pull, "weights"
        )
        for w, served in enumerate(loaded):
            for warning in self.served.loaded(w, served, step):
                log.warning(warning)

    def drain(self, step: int, dropped_groups: int = 0) -> dict[str, float]:
        if self.result is None:
            return {}
        self.failures.show(self.result.reward_messages)
        return rollout_metrics(self.result)

    def live(self) -> list[RolloutWorkerClient]:
        """The workers that evaluate: all of them (a dead one was waited for)."""
        return self.workers

    def died_loading(self, worker: RolloutWorkerClient, step: int, error: RayActorError) -> None:
        """Counted when its next batch call fails and waits for Ray to bring it back."""
        log.warning(
            "rollout worker %d died loading version %d (%s); its next batch waits for it",
            self.workers.index(worker),
            step,
            type(error).__name__,
        )

    def cursor(self) -> dict[str, Any]:
        return {"prompts": self.prompts.cursor()}

    def restore(self, cursor: dict[str, Any], step: int, held_groups: int) -> None:
        self.prompts.restore(cursor["prompts"])
        self.step = step
