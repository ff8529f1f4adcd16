"""The rollout worker: a Ray actor with a vLLM engine, the verifier, and a store producer.

Driven by ``tasks/rollout.py``. ``rollout`` generates n completions per prompt with the
weights it holds, scores them with the environment's verifier, computes group-relative
advantages and puts the groups into the trajectory store as one Arrow block, tagged with
the policy version of every token; only counts come back to the caller. ``sync_weights``
pulls the newest version from the parameter service when the worker chooses to, never
waiting on the trainer. Scoring here, next to the tokens, keeps trajectories off the driver.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import torch

from engines.protocols import Completion
from engines.vllm_rollout import VLLMRolloutEngine
from envs import Environment, Problem, score
from rl.advantages import group_advantages
from storage.params import ParameterError, ParameterService
from storage.schema import batch_from_rows
from storage.trajectory_store import StoreClient

# How often a worker that needs a version asks the relay again.
RELAY_POLL_S = 0.005


@dataclass(frozen=True)
class RolloutStats:
    """What one ``rollout`` call produced, in counts (the samples went to the store)."""

    samples: int
    groups: int
    tokens: int
    reward_sum: float
    correct: int
    truncated: int
    reward_errors: int
    behaviour_version: int


def scored_block(
    env: Environment,
    problems: list[Problem],
    prompt_ids: list[list[int]],
    groups: list[list[Completion]],
    version: int,
    tag: str,
    scale_by_std: bool,
) -> tuple[pa.RecordBatch, RolloutStats]:
    """Score every completion, compute GRPO advantages, and lay the groups out as rows.

    Rows of one group are contiguous; sample ids are ``<prompt id>@<tag>/<j>`` so a
    prompt that comes round again gets new ids.
    """
    results = [
        [score(env, p, c.text) for c in group] for p, group in zip(problems, groups, strict=True)
    ]
    rewards = torch.tensor([[r.reward for r in row] for row in results])
    advantages = group_advantages(rewards, scale_by_std=scale_by_std)
    now = datetime.now(UTC)
    rows = []
    for g, (problem, ids, group) in enumerate(zip(problems, prompt_ids, groups, strict=True)):
        group_id = f"{problem.prompt_id}@{tag}"
        for j, completion in enumerate(group):
            tokens = len(completion.token_ids)
            rows.append(
                {
                    "sample_id": f"{group_id}/{j}",
                    "prompt_id": problem.prompt_id,
                    "group_id": group_id,
                    "env": env.name,
                    "prompt_ids": ids,
                    "response_ids": completion.token_ids,
                    "behaviour_logprobs": completion.logprobs,
                    "token_versions": [version] * tokens,
                    "reward": results[g][j].reward,
                    "advantage": float(advantages[g, j]),
                    "prompt_len": len(ids),
                    "response_len": tokens,
                    "status": "scored",
                    "reason": results[g][j].error,
                    "generated_at": now,
                    "scored_at": now,
                }
            )
    completions = [c for group in groups for c in group]
    stats = RolloutStats(
        samples=len(completions),
        groups=len(groups),
        tokens=sum(len(c.token_ids) for c in completions),
        reward_sum=float(rewards.sum()),
        correct=sum(r.correct for row in results for r in row),
        truncated=sum(not c.finished for c in completions),
        reward_errors=sum(r.error is not None for row in results for r in row),
        behaviour_version=version,
    )
    return batch_from_rows(rows), stats


class RolloutWorkerBase(VLLMRolloutEngine):
    """The engine plus the environment, a store producer and a parameter-service puller."""

    def __init__(
        self,
        threads: int,
        env: Environment | None = None,
        store: StoreClient | None = None,
        params: ParameterService | None = None,
        **engine_args: Any,
    ) -> None:
        torch.set_num_threads(threads)
        super().__init__(**engine_args)
        self._env, self._store, self._params = env, store, params

    def rollout(
        self,
        problems: list[Problem],
        n: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        tag: str,
        scale_by_std: bool,
    ) -> RolloutStats:
        if self._env is None or self._store is None:
            raise RuntimeError("this rollout worker was started without an environment and store")
        prompts = [p.prompt for p in problems]
        groups = self.generate(prompts, n, max_new_tokens, temperature, seed)
        block, stats = scored_block(
            self._env,
            problems,
            self.prompt_ids(prompts),
            groups,
            self.version(),
            tag,
            scale_by_std,
        )
        self._store.put(block)
        return stats

    def sync_weights(self, at_least: int = 0, timeout_s: float = 60.0) -> int:
        """Load the newest published version; returns the version now loaded.

        With ``at_least``, wait (up to ``timeout_s``) until the relay holds that version: a
        publish returns before the relay has taken the version, so a pull right behind it
        can still find the previous one.
        """
        if self._params is None:
            raise RuntimeError("this rollout worker was started without a parameter service")
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            found = self._params.pull_blobs(after=self.version(), timeout=max(left, 0.001))
            if found is not None:
                version, blobs = found
                self.load_weights(blobs, version)
            if self.version() >= at_least:
                return self.version()
            if left <= 0:
                raise ParameterError(
                    f"weight version {at_least} did not reach the parameter relay within "
                    f"{timeout_s:g} s (this worker holds version {self.version()}); is the "
                    "trainer alive?"
                )
            time.sleep(RELAY_POLL_S)
