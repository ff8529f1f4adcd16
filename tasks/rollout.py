"""How rollouts are driven in each mode, and held-out evaluation.

``BatchRollouts`` (``sync``, ``one_step``): a batch is submitted (the workers start
generating at once) and collected later, so the flow can train on one batch while the
next one generates. ``StreamRollouts`` (``async``): every worker streams from the
dispatcher (``tasks/dispatcher.py``) until told to stop. Either way the workers score
their samples and put them into the trajectory store themselves
(``engines/rollout_worker.py``); what comes back here is counts for the metrics. The flow
drives both through the same five calls: start, before_train, after_train, drain, stop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from engines.rollout_worker import RolloutStats, StreamSettings
from envs import Environment, Problem, score
from tasks.environment import PromptStream

# Waits for Ray refs with progress lines (the flow's ``_wait``, bound to its store).
Waiter = Callable[[Any, str], Any]


@dataclass(frozen=True)
class BatchSettings:
    steps: int
    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    seed: int
    scale_by_std: bool
    weight_pull_timeout_s: float


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


def rollout_metrics(result: RolloutResult) -> dict[str, float]:
    return {
        "rollout/reward": result.mean_reward,
        "rollout/accuracy": result.accuracy,
        "rollout/response_length": result.mean_length,
        "rollout/truncated": result.truncated,
        "rollout/reward_errors": float(result.reward_errors),
    }


class BatchRollouts:
    """``sync`` and ``one_step``: one batch per step, generated with one policy version.

    ``sync`` submits batch i+1 after the workers loaded the weights of step i; ``one_step``
    submits it before training on batch i, so it is generated one version behind.
    """

    def __init__(
        self,
        workers: list[Any],
        prompts: PromptStream,
        settings: BatchSettings,
        overlap: bool,
    ) -> None:
        self.workers, self.prompts, self.s, self.overlap = workers, prompts, settings, overlap
        self.pending: PendingRollout | None = None
        self.result: RolloutResult | None = None

    def _submit(self, step: int) -> None:
        self.pending = submit(
            self.workers,
            self.prompts.take(self.s.prompts_per_step),
            self.s.samples_per_prompt,
            self.s.max_new_tokens,
            self.s.temperature,
            seed=self.s.seed * 1_000_003 + step,
            scale_by_std=self.s.scale_by_std,
        )

    def start(self) -> None:
        self._submit(1)

    def before_train(self, step: int, wait: Waiter) -> None:
        assert self.pending is not None
        wait(self.pending.refs, "rollouts")
        self.result = collect(self.pending)  # this step's groups are scored and in the store
        if self.overlap and step < self.s.steps:
            self._submit(step + 1)  # generates with the previous weights while we train

    def after_train(self, step: int, wait: Waiter) -> None:
        timeout = self.s.weight_pull_timeout_s
        # Queued behind each worker's generation: `one_step` keeps its overlap.
        wait([w.sync_weights.remote(step, timeout) for w in self.workers], "weights")
        if not self.overlap and step < self.s.steps:
            self._submit(step + 1)

    def drain(self, step: int) -> dict[str, float]:
        return rollout_metrics(self.result) if self.result else {}

    def pause(self, wait: Waiter) -> None:
        """Nothing runs between steps except what ``one_step`` submitted: let it be."""

    def resume(self) -> None:
        """Nothing was paused."""

    def stop(self, wait: Waiter) -> None:
        """Every submitted batch was collected by the last step."""

    def cursor(self) -> dict[str, Any]:
        return {"prompts": self.prompts.cursor()}


class StreamRollouts:
    """``async``: workers stream continuously from a dispatcher, bounded by max_staleness."""

    def __init__(self, workers: list[Any], dispatcher: Any, settings: list[StreamSettings]) -> None:
        self.workers, self.dispatcher, self.settings = workers, dispatcher, settings
        self.refs: list[Any] = []
        self.last: dict[int, dict[str, float]] = {}  # each worker's counters at the last drain

    def start(self) -> None:
        ray.get(self.dispatcher.resume.remote())
        self.refs = [
            w.stream.remote(self.dispatcher, s)
            for w, s in zip(self.workers, self.settings, strict=True)
        ]

    def before_train(self, step: int, wait: Waiter) -> None:
        done, _ = ray.wait(self.refs, timeout=0)
        if done:
            ray.get(done)  # a worker that stopped early raised: surface its error

    def after_train(self, step: int, wait: Waiter) -> None:
        """Workers pull new weights on their own schedule: nothing to do."""

    def drain(self, step: int) -> dict[str, float]:
        """Rollout metrics since the last step; ``step`` is the trainer's version now."""
        state = ray.get(self.dispatcher.drain.remote())
        t = state["totals"]
        metrics: dict[str, float] = {}
        if t.samples:
            metrics.update(
                {
                    "rollout/reward": t.reward_sum / t.samples,
                    "rollout/accuracy": t.correct / t.samples,
                    "rollout/response_length": t.tokens / t.samples,
                    "rollout/truncated": t.truncated / t.samples,
                    "rollout/reward_errors": float(t.reward_errors),
                    "rollout/groups": float(t.groups),
                }
            )
        for w, c in state["workers"].items():
            before = self.last.get(w, {})
            delta = {k: v - before.get(k, 0.0) for k, v in c.items()}
            busy, idle = delta["busy_s"], delta["idle_s"]
            if busy + idle > 0:
                metrics[f"rollout/worker{w}/idle_fraction"] = idle / (busy + idle)
            metrics[f"rollout/worker{w}/version_lag"] = step - c["version"]
            metrics[f"rollout/worker{w}/weight_pull_s"] = delta["pull_s"]
            metrics[f"rollout/worker{w}/weight_loads"] = delta["weight_loads"]
            self.last[w] = c
        return metrics

    def pause(self, wait: Waiter) -> None:
        """Let every worker finish what it holds and return (held-out eval needs vLLM)."""
        self.stop(wait)

    def resume(self) -> None:
        self.start()

    def stop(self, wait: Waiter) -> None:
        ray.get(self.dispatcher.stop.remote())
        wait(self.refs, "rollout workers to finish their running samples")
        self.refs = []

    def cursor(self) -> dict[str, Any]:
        return dict(ray.get(self.dispatcher.cursor.remote()))
