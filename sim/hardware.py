"""Simulator costs of a model on a GPU cluster, from public specifications and stated guesses.

Used by ``benchmarks/sim_scale.py`` for the published-scale predictions. Every number is either a
vendor or model-card figure (cited where it is defined) or an efficiency assumption, named
in ``ASSUMPTIONS`` so the report can print it. The model is first-order on purpose:

- a decode step reads the engine's weights once (``a``) and, per running request, its KV
  cache at the mean context and its share of the matmul FLOPs (``b``): memory-bound
  decoding, the regime vLLM runs RL rollouts in;
- prefill and training are compute-bound at a fixed model-FLOPs utilisation: training
  costs 8 N FLOPs per token (6 N forward and backward, 2 N to recompute the old policy's
  log-probs) for N parameters;
- a weight pull moves the engine's shard over the network; a colocated switch is a fixed
  cost (engine sleep/wake, cache rebuild).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice.sim.scenario import CostSpec


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    memory_bytes: float
    network_bytes_per_s: float  # per accelerator, to other nodes


# NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 989 TFLOPS dense BF16, 80 GB; DGX H100: one
# 400 Gb/s ConnectX-7 port per GPU.
H100 = Accelerator("H100 SXM", 3.35e12, 989e12, 80e9, 400e9 / 8)


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    tp: int  # accelerators per rollout engine

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2  # K and V, bf16


# Qwen2.5-7B and Qwen2.5-32B model cards (config.json): parameters, layers, KV heads, head dim.
QWEN_7B = Model("7B (Qwen2.5-7B shape)", 7.6e9, 28, 4, 128, tp=1)
QWEN_32B = Model("32B (Qwen2.5-32B shape)", 32.8e9, 64, 8, 128, tp=2)

# Efficiency assumptions (guesses in the range public reports give, not measurements).
HBM_EFFICIENCY = 0.7  # share of peak HBM bandwidth a decode step reaches
DECODE_MFU = 0.5  # matmul efficiency of the batched decode FLOPs
PREFILL_MFU = 0.5
TRAIN_MFU = 0.4  # Megatron/FSDP RL trainers report 30-50% on long sequences
NETWORK_EFFICIENCY = 0.5  # NCCL broadcast / all-gather over InfiniBand
TP_OVERHEAD = 0.15  # all-reduces of a tensor-parallel decode step
ENGINE_RELOAD_S = 0.5  # vLLM: load a new state dict and reset its prefix cache
OPTIMIZER_FIXED_S = 1.0  # optimiser step, scheduling, logging per training step
COLOCATED_SWITCH_S = 5.0  # colocated: engine sleep/wake and cache rebuild per step
KV_MEMORY_SHARE = 0.9  # of the memory left after weights, what the KV cache gets
MAX_NUM_SEQS = 256  # vLLM's default cap on running requests

ASSUMPTIONS = {
    "HBM efficiency of decode": HBM_EFFICIENCY,
    "decode/prefill matmul MFU": DECODE_MFU,
    "training MFU (8N FLOPs per token)": TRAIN_MFU,
    "network efficiency": NETWORK_EFFICIENCY,
    "tensor-parallel decode overhead": TP_OVERHEAD,
    "engine weight reload (s)": ENGINE_RELOAD_S,
    "optimiser step fixed cost (s)": OPTIMIZER_FIXED_S,
    "colocated switch per step (s)": COLOCATED_SWITCH_S,
}


def engine_concurrency(model: Model, gpu: Accelerator, mean_context: float) -> int:
    """Requests one engine can hold: its KV memory over the mean context, capped like vLLM."""
    free = (model.tp * gpu.memory_bytes - model.weight_bytes) * KV_MEMORY_SHARE
    fits = int(free // (model.kv_bytes_per_token * mean_context))
    return max(1, min(fits, MAX_NUM_SEQS))


def costs_for(
    model: Model,
    gpu: Accelerator,
    mean_context: float,
    train_accelerators: int,
    colocated: bool = False,
) -> CostSpec:
    """The simulator's costs for ``model`` served and trained on ``gpu``s.

    ``mean_context``: prompt plus the mean tokens a running request already holds, which
    sets its KV reads per decode step.
    """
    hbm = gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    shard = model.weight_bytes / model.tp
    a = shard / hbm * (1.0 + (TP_OVERHEAD if model.tp > 1 else 0.0))
    kv_read = model.kv_bytes_per_token * mean_context / model.tp / hbm
    matmul = 2.0 * model.params / model.tp / (gpu.bf16_flops * DECODE_MFU)
    network = gpu.network_bytes_per_s * NETWORK_EFFICIENCY
    # Gradients: a reduce-scatter and an all-gather of bf16 values per step.
    grad_sync = 2 * model.weight_bytes / network if train_accelerators > 1 else 0.0
    return CostSpec(
        decode_step_s=a,
        decode_per_request_s=kv_read + matmul,
        prefill_per_token_s=2.0 * model.params / model.tp / (gpu.bf16_flops * PREFILL_MFU),
        train_step_s=OPTIMIZER_FIXED_S + grad_sync,
        train_per_token_s=8.0 * model.params / (gpu.bf16_flops * TRAIN_MFU),
        model_bytes=shard,
        # Colocated: the weights move inside the node (NVLink), not over the network.
        sync_bandwidth_bytes_per_s=(450e9 if colocated else network),
        sync_latency_s=ENGINE_RELOAD_S,
        colocated_switch_s=COLOCATED_SWITCH_S if colocated else 0.0,
    )


def rollout_share(
    model: Model, gpu: Accelerator, prompt: float, mean_response: float, mean_context: float
) -> float:
    """Share of a disaggregated cluster that generates, so that generating a batch and
    training on it take equal time at full load (the tail is ignored)."""
    cost = costs_for(model, gpu, mean_context, train_accelerators=1)
    cap = engine_concurrency(model, gpu, mean_context)
    decode_per_token = (cost.decode_step_s + cost.decode_per_request_s * cap) / cap
    gen_gpu_s = decode_per_token * model.tp  # accelerator-seconds per generated token
    train_gpu_s = cost.train_per_token_s * (prompt + mean_response) / mean_response
    return gen_gpu_s / (gen_gpu_s + train_gpu_s)


def split(accelerators: int, share: float, tp: int) -> tuple[int, int]:
    """Rollout and training accelerators: rollout a multiple of ``tp``, training >= 8."""
    rollout = max(tp, math.floor(accelerators * share / tp) * tp)
    rollout = min(rollout, accelerators - 8)
    rollout -= rollout % tp
    return rollout, accelerators - rollout
