"""Weights a trainer publishes, pulled by a live rollout worker (vLLM), make the worker's
log-probs match the trainer's model: the parameter service path a run takes."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sluice.engines.rollout_worker import launch_rollout_workers
from sluice.engines.torch_trainer import TorchTrainer
from sluice.envs import make_env
from sluice.rl.batching import Sample
from sluice.rl.config import RolloutConfig
from sluice.storage.params import ParameterService

pytestmark = pytest.mark.integration

PROMPTS = ["12+34=", "7+85=", "3 5 7>22:", "99+1="]


def _samples(prompt_ids, groups, advantages):
    return [
        Sample(ids, c.token_ids, c.logprobs, adv)
        for ids, group, adv in zip(prompt_ids, groups, advantages, strict=True)
        for c in group
    ]


def _max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(
        abs(x - y)
        for row_a, row_b in zip(a, b, strict=True)
        for x, y in zip(row_a, row_b, strict=True)
    )


def test_weight_push_matches_trainer_logprobs(ray_local, tiny_policy):
    ray = ray_local
    params = ParameterService.create(relays=1, bucket_bytes=256 << 10)
    (worker,) = launch_rollout_workers(
        RolloutConfig(kv_cache_gib=0.25),
        str(tiny_policy),
        max_model_len=128,
        seed=0,
        env=make_env("addition"),
        store=None,
        params=params,
        env_vars={},
        count=1,
    )
    trainer = TorchTrainer(
        str(tiny_policy), lr=5e-2, clip_eps=0.2, grad_clip=10.0, micro_batch=64, threads=1, seed=0
    )
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy))  # what vLLM's prompts encode to
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    groups = ray.get(worker.generate(PROMPTS, 2, 8, 1.0, 0))
    before = _samples(prompt_ids, groups, [1.0, -1.0, 1.0, -1.0])
    # The same weights on both sides: vLLM's behaviour log-probs equal the trainer's.
    assert _max_gap([s.behaviour_logprobs for s in before], trainer.logprobs(before)) < 1e-4

    trainer.step(before)
    assert trainer.version() == 1
    # The step moved the trainer's log-probs away from what vLLM still serves.
    assert _max_gap([s.behaviour_logprobs for s in before], trainer.logprobs(before)) > 1e-3

    params.publish(trainer.version(), trainer.state())
    assert ray.get(worker.sync_weights(1, 60.0)) == 1
    groups = ray.get(worker.generate(PROMPTS, 2, 8, 1.0, 1))
    after = _samples(prompt_ids, groups, [0.0] * 4)
    gap = _max_gap([s.behaviour_logprobs for s in after], trainer.logprobs(after))
    assert gap < 1e-4, f"vLLM and trainer log-probs differ by {gap:.2e} after the push"
    ray.kill(worker.handle)
    params.shutdown()
