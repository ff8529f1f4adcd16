"""The trainer's device and precision: float32 master weights, bf16 autocast forward passes,
batches on the model's device, published and saved weights on the CPU, DeepSpeed's backend.

On these CPU machines the device is the CPU; bf16 autocast runs on it (AVX-512 BF16), so the
bf16 path is exercised here. bf16 log-probs differ from float32 ones by up to ~0.015 on the
tiny policy (ENVIRONMENT.md); the tolerance below is of that order.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from sluice.engines.train.trainer import model_inputs
from sluice.engines.train.zero import backend
from sluice.rl.batching import Sample, collate, pack
from sluice.storage.torch_state import restore_rng, rng_state_files
from tests.support.trainers import make_trainer, step

BF16_ATOL = 0.05
# adam_eps: AdamW's first update is lr * g / (|g| + eps), about lr * sign(g) at torch's
# 1e-8, so a gradient within rounding of zero flips its weight's update between two engines
# that agree to rounding (seen on AVX-512: 4e-3 of the update's norm). At 1e-5 an update is
# continuous in the gradients, and the comparisons measure the engines, not that sign.
SETTINGS = {
    "lr": 1e-2,
    "clip_eps": 0.2,
    "grad_clip": 1.0,
    "micro_batch": 2,
    "adam_eps": 1e-5,
    "threads": 1,
}


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
    full = make_trainer(str(tiny_policy), seed=0, **SETTINGS)
    half = make_trainer(str(tiny_policy), seed=0, dtype="bfloat16", **SETTINGS)
    assert half.device == torch.device("cpu")  # no GPU here: the trainer stays on the CPU
    samples = _samples()
    gap = _gap(full.logprobs(samples), half.logprobs(samples))
    assert 0 < gap < BF16_ATOL, gap  # bf16 rounds, but not by much
    metrics = step(half, samples)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    state = half.state()
    assert {t.dtype for t in state.values()} == {torch.float32}  # master weights stay fp32
    assert {t.device.type for t in half.cpu_state().values()} == {"cpu"}
    step(full, samples)
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
    with pytest.raises(ValueError, match=r"dtype\n  Input should be 'auto', 'float32' or"):
        make_trainer(str(tiny_policy), seed=0, dtype="float8", **SETTINGS)


def test_rng_states_round_trip_without_a_gpu():
    files = rng_state_files()
    first = torch.rand(3)
    restore_rng(files)
    assert torch.equal(torch.rand(3), first)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_runs_bf16_on_gloo_here_and_saves_cpu_weights(tiny_policy, stage):
    assert backend() == "gloo"  # nccl only where CUDA is
    trainer = make_trainer(
        tiny_policy, engine="deepspeed", zero_stage=stage, seed=0, dtype="bfloat16", **SETTINGS
    )
    reference = make_trainer(str(tiny_policy), seed=0, **SETTINGS)
    metrics = step(trainer, _samples())
    assert math.isfinite(metrics["loss"])
    weights = trainer.cpu_state()
    assert list(weights) == list(reference.state())  # every key, in state_dict's order
    assert all(t.device.type == "cpu" and t.numel() > 0 for t in weights.values())


# Every engine's bf16 step against the torch engine's, from the same weights on one batch:
# ZeRO runs torch's autocast (measured on the tiny policy at lr 1e-3: the same loss, update
# within 5e-8 on AVX2; ZeRO-3, which gathers each layer's weights into buffers of its own,
# within 4e-5 on AVX-512 with AMX, whose bf16 matmuls round by the operands' layout); FSDP2
# gathers bf16 weights (RMSNorm scales included), so it differs by bf16 rounding: loss by
# 4e-5, the update by 9.5% of its norm, as much as torch's own bf16 update differs from its
# float32 one (8.8%).
BF16_ENGINES = {
    "fsdp2": ({"engine": "fsdp"}, 1e-4, 0.15),
    "zero2": ({"engine": "deepspeed", "zero_stage": 2}, 1e-6, 1e-6),
    "zero3": ({"engine": "deepspeed", "zero_stage": 3}, 1e-6, 1e-3),
}


def _linear_dtypes(model: torch.nn.Module, run: Callable[[], object]) -> set[torch.dtype]:
    """The dtypes ``model``'s linear layers return while ``run`` runs."""
    seen: set[torch.dtype] = set()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype)) for m in linears]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _bf16_step(trainer) -> tuple[dict[str, float], torch.Tensor, set[torch.dtype]]:
    """One step's metrics, its update (all weights, flat) and the dtypes the model's
    linear layers returned in it."""
    before = trainer.cpu_state()
    metrics: dict[str, float] = {}
    seen = _linear_dtypes(trainer.model, lambda: metrics.update(step(trainer, _samples())))
    after = trainer.cpu_state()
    update = torch.cat([(after[k] - before[k]).flatten() for k in sorted(before)])
    return metrics, update, seen


@pytest.mark.parametrize("engine", list(BF16_ENGINES))
def test_every_engine_computes_a_bf16_step_in_bf16_and_takes_the_torch_engines_step(
    tiny_policy, engine
):
    settings, loss_tol, update_tol = BF16_ENGINES[engine]
    bf16 = {**SETTINGS, "lr": 1e-3, "dtype": "bfloat16"}
    want, want_update, want_seen = _bf16_step(make_trainer(tiny_policy, **bf16))
    got, update, seen = _bf16_step(make_trainer(tiny_policy, **bf16, **settings))
    assert want_seen == seen == {torch.bfloat16}
    assert got["loss"] == pytest.approx(want["loss"], abs=loss_tol)
    assert float((update - want_update).norm() / want_update.norm()) < update_tol


@pytest.mark.gpu
def test_the_trainer_lives_on_its_gpu(tiny_policy):
    trainer = make_trainer(str(tiny_policy), seed=0, dtype="bfloat16", **SETTINGS)
    assert trainer.device.type == "cuda"
    assert next(trainer.model.parameters()).device.type == "cuda"
    step(trainer, _samples())
    assert {t.device.type for t in trainer.cpu_state().values()} == {"cpu"}
    assert backend() == "nccl"


@pytest.mark.parametrize("engine", list(BF16_ENGINES))
def test_a_sharded_engines_forward_computes_in_bf16_by_itself(tiny_policy, engine):
    """On a GPU DeepSpeed's forward turns the caller's autocast off and computes as its own
    config says (runtime/torch_autocast.py: autocast_if_enabled; on a CPU it does not see
    the caller's autocast, so the step above cannot tell): called with no autocast around
    it, each sharded engine's forward still computes in bf16 (FSDP2 by its mixed-precision
    policy, ZeRO by its torch_autocast section). Without them: float32."""
    settings = BF16_ENGINES[engine][0]
    trainer = make_trainer(tiny_policy, **SETTINGS, **settings, dtype="bfloat16")
    batch = collate(_samples(), trainer.pad_id)
    seen = _linear_dtypes(trainer.model, lambda: trainer._network(**model_inputs(batch)))
    assert seen == {torch.bfloat16}
