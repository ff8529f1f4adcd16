"""The trainer's device and precision: float32 master weights, bf16 autocast forward passes,
batches on the model's device, published and saved weights on the CPU, DeepSpeed's backend.

On these CPU machines the device is the CPU; bf16 autocast runs on it (AVX-512 BF16), so the
bf16 path is exercised here. bf16 log-probs differ from float32 ones by up to ~0.015 on the
tiny policy (ENVIRONMENT.md); the tolerance below is of that order.
"""

from __future__ import annotations

import math

import pytest
import torch

from sluice.engines.deepspeed_trainer import DeepSpeedTrainer, backend
from sluice.engines.torch_trainer import TorchTrainer
from sluice.rl.batching import Sample, collate, pack
from sluice.storage.torch_state import restore_rng, rng_state_files

BF16_ATOL = 0.05
SETTINGS = {"lr": 1e-2, "clip_eps": 0.2, "grad_clip": 1.0, "micro_batch": 2, "threads": 1}


def _samples() -> list[Sample]:
    rows = []
    for i, advantage in enumerate([1.0, -0.5, 0.25, 2.0]):
        response = [22 + j % 7 for j in range(3 + 2 * i)] + [2]
        rows.append(Sample([1, 20 + i, 21], response, [-3.0] * len(response), advantage))
    return rows


def _gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_a_bf16_trainer_matches_float32_within_bf16_rounding_and_keeps_fp32_weights(
    tiny_policy,
):
    full = TorchTrainer(str(tiny_policy), seed=0, **SETTINGS)
    half = TorchTrainer(str(tiny_policy), seed=0, dtype="bfloat16", **SETTINGS)
    assert half.device == torch.device("cpu")  # no GPU here: the trainer stays on the CPU
    samples = _samples()
    gap = _gap(full.logprobs(samples), half.logprobs(samples))
    assert 0 < gap < BF16_ATOL, gap  # bf16 rounds, but not by much
    metrics = half.step(samples)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    state = half.state()
    assert {t.dtype for t in state.values()} == {torch.float32}  # master weights stay fp32
    assert {t.device.type for t in half.cpu_state().values()} == {"cpu"}
    full.step(samples)
    assert _gap(full.logprobs(samples), half.logprobs(samples)) < BF16_ATOL


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_batch_moves_to_the_trainers_device(packed):
    batch = collate(_samples(), 0)
    if packed:
        batch = pack(batch, max_rows=64, max_tokens=1024)[0]
    moved = batch.to(torch.device("meta"))  # a device that is not the CPU, without a GPU
    tensors = {k: v for k, v in vars(moved).items() if v is not None}
    assert {t.device.type for t in tensors.values()} == {"meta"}
    assert ("position_ids" in tensors) == packed
    assert moved.input_ids.shape == batch.input_ids.shape


def test_an_unknown_dtype_is_refused(tiny_policy):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        TorchTrainer(str(tiny_policy), seed=0, dtype="float8", **SETTINGS)


def test_rng_states_round_trip_without_a_gpu():
    files = rng_state_files()
    first = torch.rand(3)
    restore_rng(files)
    assert torch.equal(torch.rand(3), first)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_runs_bf16_on_gloo_here_and_saves_cpu_weights(tiny_policy, stage):
    assert backend() == "gloo"  # nccl only where CUDA is
    trainer = DeepSpeedTrainer(
        str(tiny_policy), zero_stage=stage, seed=0, dtype="bfloat16", **SETTINGS
    )
    reference = TorchTrainer(str(tiny_policy), seed=0, **SETTINGS)
    metrics = trainer.step(_samples())
    assert math.isfinite(metrics["loss"])
    weights = trainer.cpu_state()
    assert list(weights) == list(reference.state())  # every key, in state_dict's order
    assert all(t.device.type == "cpu" and t.numel() > 0 for t in weights.values())


@pytest.mark.gpu
def test_the_trainer_lives_on_its_gpu(tiny_policy):
    trainer = TorchTrainer(str(tiny_policy), seed=0, dtype="bfloat16", **SETTINGS)
    assert trainer.device.type == "cuda"
    assert next(trainer.model.parameters()).device.type == "cuda"
    trainer.step(_samples())
    assert {t.device.type for t in trainer.cpu_state().values()} == {"cpu"}
    assert backend() == "nccl"
