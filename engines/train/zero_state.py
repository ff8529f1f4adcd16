"""ZeRO-partitioned weights and AdamW state, to and from the layout of a plain torch AdamW.

DeepSpeed's own ``save_checkpoint`` pickles, and its files depend on the ZeRO stage and the
number of ranks. Here the Adam moments are gathered per parameter (DeepSpeed's
``safe_get_full_*`` API, stages 1 to 3) into the very state dict a ``torch.optim.AdamW``
over ``model.parameters()`` would have, which ``storage.torch_state`` stores as safetensors
plus JSON. A checkpoint so written resumes under either engine, with any number of ranks.
Driven by ``engines.train.zero`` (the DeepSpeed strategy). Every function here is collective: all
ranks call it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
from deepspeed.runtime.zero import GatheredParameters
from deepspeed.utils import safe_get_full_optimizer_state, safe_set_full_fp32_param
from deepspeed.utils import safe_set_full_optimizer_state as set_full_state

from sluice.storage.torch_state import Gathered, read_deferred

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def gathered_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the full weights by name (``state_dict``'s keys). Under ZeRO-3 they are
    gathered one module at a time, each copied to the CPU before the next is gathered, so
    the device holds one module's full weights at most, never the whole model's."""
    out = {key: tensor.to("cpu", copy=True) for key, tensor in gather_weights(model)}
    return {key: out[key] for key in model.state_dict()}


def _by_module(
    model: torch.nn.Module,
) -> Iterator[tuple[list[torch.nn.Parameter], list[tuple[str, torch.Tensor]]]]:
    """Each module's own parameters, with its ``state_dict`` entries not met before (a tied
    weight comes once), module by module in ``named_modules`` order."""
    keys = set(model.state_dict(keep_vars=True))
    seen: set[str] = set()
    for prefix, module in model.named_modules():
        pairs = []
        for name, tensor in [
            *module.named_parameters(recurse=False, remove_duplicate=False),
            *module.named_buffers(recurse=False, remove_duplicate=False),
        ]:
            key = f"{prefix}.{name}" if prefix else name
            if key in keys and key not in seen:
                seen.add(key)
                pairs.append((key, tensor))
        yield list(module.parameters(recurse=False)), pairs


def gather_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The full weights by ``state_dict`` name, in ``weights_layout``'s order, module by
    module: each module's are gathered, yielded (on the device: copy them before asking for
    the next) and released before the next module's are gathered."""
    for own, pairs in _by_module(model):
        with GatheredParameters(own):  # no-op below stage 3, or for a module without any
            for key, tensor in pairs:
                yield key, tensor.detach()


def weights_layout(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights' names, shapes and dtypes as meta tensors, in the order
    ``gather_weights`` yields them, without gathering (ZeRO-3 keeps a partitioned
    parameter's whole shape as ``ds_shape``)."""
    return {
        key: torch.empty(
            getattr(tensor, "ds_shape", tensor.shape), dtype=tensor.dtype, device="meta"
        )
        for _, pairs in _by_module(model)
        for key, tensor in pairs
    }


def load_weights(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Set the model's weights and the optimiser's fp32 master copy of them, one parameter
    at a time: each tensor is read from ``tensors`` when its turn comes, and under ZeRO-3
    only that parameter is gathered (rank 0's copy re-partitioned on the way out), so no
    rank ever holds the whole model."""
    named = model.state_dict().keys()
    if set(named) != set(tensors):
        raise ValueError(
            f"checkpoint weights {sorted(set(named) ^ set(tensors))[:5]} do not match the model"
        )
    for name, param in model.named_parameters():  # a tied weight once, under its first name
        value = tensors[name]
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3: the whole's shape
        if value.shape != shape:
            raise ValueError(f"checkpoint weight {name} is {tuple(value.shape)}, not {shape}")
        with GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(value)
        safe_set_full_fp32_param(param, value)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in tensors:  # a persistent buffer
                buffer.copy_(tensors[name])


def _hyper_parameters(base: torch.optim.Optimizer) -> dict[str, Any]:
    group = base.param_groups[0]
    if any(g["lr"] != group["lr"] for g in base.param_groups):
        raise ValueError("ZeRO parameter groups with different learning rates cannot be stored")
    return {k: v for k, v in group.items() if k != "params"}


def gather_adamw_state(model: torch.nn.Module, zero_optimizer: Any) -> dict[str, Any]:
    """The state dict of an AdamW over ``model.parameters()`` (index-keyed, as torch's),
    each moment a ``Gathered`` made when it is written (``storage.torch_state``): every rank
    must then read the written stream through."""
    base = zero_optimizer.optimizer  # the torch AdamW over ZeRO's flat fp32 partitions
    params = list(model.parameters())
    group = {**_hyper_parameters(base), "params": list(range(len(params)))}
    steps = [s["step"] for s in base.state.values() if "step" in s]
    state: dict[int, dict[str, Any]] = {}
    if steps:  # AdamW creates its state at the first step
        for index, param in enumerate(params):
            shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3: the whole's shape
            like = torch.empty(shape, dtype=torch.float32, device="meta")  # fp32 moments
            moments = {
                k: Gathered(like, partial(safe_get_full_optimizer_state, param, k))
                for k in ADAM_MOMENTS
            }
            state[index] = {"step": steps[0].detach().clone(), **moments}
    return {"state": state, "param_groups": [group]}


def _flat_partitions(zero_optimizer: Any) -> list[torch.Tensor]:
    """The flat fp32 tensors this rank's AdamW steps: one per group at ZeRO-1/2, one per
    sub-group at ZeRO-3 (whose AdamW holds them in its groups only while it steps)."""
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        if hasattr(zero_optimizer, name):
            return list(getattr(zero_optimizer, name))
    raise TypeError(f"{type(zero_optimizer).__name__} is not a ZeRO stage 1-3 optimiser")


def _ensure_adam_state(zero_optimizer: Any) -> None:
    """Create AdamW's state before its first step, as ``torch.optim.AdamW`` would, so a
    restored state has tensors to land in."""
    base = zero_optimizer.optimizer
    for flat in _flat_partitions(zero_optimizer):
        if not base.state[flat]:
            base.state[flat] = {
                "step": torch.tensor(0.0),
                **{k: torch.zeros_like(flat) for k in ADAM_MOMENTS},
            }
    # Stages 1 and 2 map each parameter into that state after the first step; a fresh
    # optimiser has not mapped it yet (stage 3 looks the state up on every access).
    link = getattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def scatter_adamw_state(model: torch.nn.Module, zero_optimizer: Any, saved: dict[str, Any]) -> None:
    """Load the output of ``gather_adamw_state`` (or a torch AdamW's state dict), its
    tensors in hand or deferred: each moment is then read as it is scattered, one full
    tensor at a time."""
    params = list(model.parameters())
    (group,) = saved["param_groups"]
    if len(group["params"]) != len(params):
        raise ValueError(
            f"optimizer state holds {len(group['params'])} parameters, the model has {len(params)}"
        )
    base = zero_optimizer.optimizer
    for live in base.param_groups:
        live.update({k: v for k, v in group.items() if k != "params" and k in live})
    _ensure_adam_state(zero_optimizer)
    state = saved["state"]
    step = read_deferred(state[0]["step"]) if state else torch.tensor(0.0)
    for flat in _flat_partitions(zero_optimizer):
        base.state[flat]["step"].copy_(step)
    for index, param in enumerate(params):
        for key in ADAM_MOMENTS:
            value = read_deferred(state[index][key]) if state else torch.zeros_like(param)
            set_full_state(param, value, key)
            del value
