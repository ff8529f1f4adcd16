"""On GPUs: a LoRA adapter pushed into vLLM running in bfloat16 on CUDA (vLLM's Punica
kernels, not the CPU path's torch operations) gives the trainer's log-probs within bf16
rounding; and two ranks on NCCL take one process's step (FSDP2, and LoRA under DDP).

The two-rank test needs two CUDA devices; ``scripts/train_ranks.py`` runs each rank on its
own device (``LOCAL_RANK`` from torchrun sets it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from sluice.config.tree import LoraConfig, RolloutConfig
from sluice.engines.rollout.worker import launch_rollout_workers
from sluice.engines.train.trainer import PolicyTrainer
from sluice.envs import make_env
from sluice.rl.batching import Sample
from sluice.storage.params import ParameterService
from tests.support.trainers import NO_TOKEN_LIMIT, make_trainer, step

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).parents[2]
PROMPTS = ["12+34=", "7+85=", "3 5 7>22:", "99+1="]
# As for full weights in test_cuda_weight_push.py: vLLM and the trainer in bf16.
BF16_MEAN_GAP, BF16_MAX_GAP = 0.02, 0.1
LORA = LoraConfig(
    rank=16,
    alpha=32,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)


def _samples(prompt_ids, groups, advantages):
    return [
        Sample(ids, c.token_ids, c.logprobs, adv)
        for ids, group, adv in zip(prompt_ids, groups, advantages, strict=True)
        for c in group
    ]


def _gaps(samples: list[Sample], trainer: PolicyTrainer) -> tuple[float, float]:
    """Mean and largest gap between the samples' log-probs and the trainer's."""
    diffs = [
        abs(x - y)
        for s, row in zip(samples, trainer.logprobs(samples), strict=True)
        for x, y in zip(s.behaviour_logprobs, row, strict=True)
    ]
    return sum(diffs) / len(diffs), max(diffs)


def test_a_lora_adapter_pushed_to_vllm_on_cuda_matches_the_trainer(ray_local, tiny_policy):
    ray = ray_local
    params = ParameterService.create(relays=1, bucket_bytes=256 << 10)
    rollout = RolloutConfig(kv_cache_gib=0.25, gpu_memory_utilization=0.5)
    (worker,) = launch_rollout_workers(
        rollout, str(tiny_policy), max_model_len=128, seed=0, env=make_env("addition"),
        store=None, params=params, env_vars={}, count=1, lora=LORA,
    )  # fmt: skip
    try:
        assert ray.get(worker.devices()) != "cpu"
        trainer = make_trainer(
            str(tiny_policy), lr=5e-2, clip_eps=0.2, grad_clip=10.0, micro_batch=64,
            threads=1, seed=0, lora=LORA,
        )  # fmt: skip
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy))
        prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
        before = _samples(prompt_ids, ray.get(worker.generate(PROMPTS, 2, 8, 1.0, 0)), [1, -1] * 2)
        for _ in range(3):
            step(trainer, before)
        moved, _ = _gaps(before, trainer)
        assert moved > 3 * BF16_MEAN_GAP, f"three steps moved the log-probs by only {moved:.3f}"
        params.publish(trainer.version(), trainer.state())
        assert ray.get(worker.sync_weights(trainer.version(), 60.0)).version == trainer.version()
        after = _samples(prompt_ids, ray.get(worker.generate(PROMPTS, 2, 8, 1.0, 1)), [0.0] * 4)
        mean, top = _gaps(after, trainer)
        assert mean < BF16_MEAN_GAP and top < BF16_MAX_GAP, (mean, top)
    finally:
        ray.kill(worker.handle)
        params.shutdown()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
@pytest.mark.parametrize(
    ("engine", "lora"), [("fsdp", None), ("torch", LORA)], ids=["fsdp2", "ddp-lora"]
)
def test_two_ranks_on_nccl_take_one_processs_step(tiny_policy, tmp_path, engine, lora):
    samples = [
        Sample(
            [1, 30 + i],
            [20 + (i + j) % 9 for j in range(3 + i)] + [2],
            [-3.0] * (4 + i),
            (-1.0) ** i,
        )
        for i in range(6)
    ]
    settings = {"lr": 1e-3, "clip_eps": 0.2, "grad_clip": 1.0, "micro_batch": 2, "threads": 1,
                "dtype": "float32", "micro_batch_tokens": NO_TOKEN_LIMIT}  # fmt: skip
    (tmp_path / "samples.json").write_text(json.dumps([asdict(s) for s in samples]))
    (tmp_path / "train.json").write_text(
        json.dumps({**settings, "engine": engine, "lora": lora and lora.model_dump()})
    )
    out = tmp_path / "out"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"),
        *("--master_addr", "127.0.0.1", "--master_port", "29533"),
        str(ROOT / "scripts" / "train_ranks.py"), "--policy", str(tiny_policy),
        "--samples", str(tmp_path / "samples.json"), "--train", str(tmp_path / "train.json"),
        "--out", str(out), "--steps", "1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (got,) = json.loads((out / "metrics.json").read_text())["steps"]
    want = step(make_trainer(tiny_policy, **settings, lora=lora), samples)
    for key in ("loss", "grad_norm", "tokens"):
        assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-4), key
