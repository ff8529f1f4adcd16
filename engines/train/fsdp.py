"""torch FSDP2: the weights, gradients and AdamW state sharded across ranks by
``fully_shard``.

The trainer's (``engines/train/trainer.py``) strategy for ``train.engine: fsdp``, in the
trainer actors of a pool (a pool of one forms a world of one on 127.0.0.1) or under
``torchrun`` (``scripts/train_ranks.py``). Each decoder layer is its own FSDP unit and the
model the root one, so a forward pass gathers one layer's weights at a time. Weights and
AdamW moments leave the engine gathered parameter by parameter onto the CPU, in the torch
engine's layout (name-keyed weights, an index-keyed AdamW state dict): checkpoints resume
under any engine at any rank count, and nothing is pickled. Every method that gathers is
collective: all ranks call it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from sluice.config.tree import TrainConfig
from sluice.engines.train.parallel import (
    FolderWeights,
    Optimisation,
    clip_and_step,
    materialise,
    meta_policy,
)
from sluice.engines.train.ranks import backend, free_port, rank_and_world
from sluice.storage.safetensors_stream import Streamed
from sluice.storage.torch_state import (
    OPTIMIZER_JSON,
    OPTIMIZER_TENSORS,
    Gathered,
    files_to_deferred_state,
    streamed_state_files,
)

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the whole of ``tensor`` (gathered from every rank when sharded)."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().to("cpu", copy=True)


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``tensor``'s whole shape (a DTensor's is the full one) and dtype."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _shard_like(live: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full``, laid out as ``live`` is."""
    full = full.to(device=live.device, dtype=live.dtype)
    if isinstance(live, DTensor):
        return distribute_tensor(full, live.device_mesh, live.placements)
    return full


class FullyShard:
    """A :class:`engines.train.parallel.Parallelism` on torch FSDP2 (``fully_shard``)."""

    sharded = True

    def load(self, folder: Path, device: torch.device, train: TrainConfig) -> Any:
        """The model on the meta device; ``attach`` shards it, then each rank reads its
        shards of the folder's tensors one tensor at a time."""
        model = meta_policy(folder)
        self._weights, self._device = FolderWeights(folder, model), device
        return model

    def attach(self, model: torch.nn.Module, opt: Optimisation, train: TrainConfig) -> Any:
        if not dist.is_initialized():  # a pool of one: a world of one rank (no env vars set,
            # so no other library in this process takes it for a launcher's group)
            dist.init_process_group(
                backend(), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
        mesh = init_device_mesh(self._device.type, (rank_and_world()[1],))
        # bfloat16: each unit's weights are gathered and computed in bf16, gradients reduced
        # in float32 into the float32 shards AdamW steps.
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if train.dtype == "bfloat16" else None,
            reduce_dtype=torch.float32,
        )
        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer in layers or []:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        assert isinstance(model, FSDPModule)
        materialise(model, self._device)  # this rank's shards, still empty
        with torch.no_grad():
            for name, param in model.named_parameters():
                full = self._weights.get(name).to(self._device)
                if isinstance(param, DTensor):  # each rank cuts its own shard: no traffic
                    mine = distribute_tensor(full, mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(mine.to_local())
                else:
                    param.copy_(full)
                del full
        del self._weights
        self._model, self._clip = model, opt.grad_clip
        self._optimizer = opt.adamw(list(model.parameters()))
        self._schedule = opt.schedule(self._optimizer)
        return model

    def settle(self) -> None:
        # A forward with no backward leaves the root unit's weights gathered (FSDP2 does
        # not reshard the root after its forward: its backward would gather them again).
        # Unsharded, the root's parameters are not the tensors AdamW steps, and a later
        # state_dict() swaps the sharded ones back without a reshard: the root would train
        # no more (its gradients reach no optimiser state).
        for module in self._model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def no_sync(self) -> AbstractContextManager[object]:
        # Every backward pass reduce-scatters its gradients into the float32 shards, which
        # accumulate there: a rank holds 1/world of the gradients all step long. Holding
        # them unsharded until the last pass (set_requires_gradient_sync(False)) saves a
        # reduce-scatter per micro-batch but costs every rank the whole model's float32
        # gradients: 131 GB at 32B parameters, more than a GPU has.
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def apply(self, before_update: Callable[[], object]) -> tuple[float, float]:
        return clip_and_step(
            self._model.parameters(), self._clip, self._optimizer, self._schedule, before_update
        )

    def state(self) -> dict[str, torch.Tensor]:
        """The full weights by name, gathered one parameter at a time onto the CPU (the
        device never holds more than one parameter's full weights). Collective."""
        return {name: _full(tensor) for name, tensor in self._model.state_dict().items()}

    def cpu_state(self) -> dict[str, torch.Tensor]:
        return self.state()

    def layout(self) -> dict[str, torch.Tensor]:
        """The full weights' names, shapes and dtypes (a DTensor's shape is the whole's)."""
        return {name: _meta(tensor) for name, tensor in self._model.state_dict().items()}

    def gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights one parameter at a time, on the device, each gathered from
        every rank when asked for. Collective."""
        for name, tensor in self._model.state_dict().items():
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, whole.detach()
            del whole

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Each rank keeps its shard of each full tensor, read one at a time."""
        live = self._model.state_dict()
        if set(weights) != set(live):
            raise ValueError(
                f"checkpoint weights {sorted(set(weights) ^ set(live))[:5]} do not match the model"
            )
        with torch.no_grad():
            for name, tensor in live.items():
                shard = _shard_like(tensor, weights[name])
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                local.copy_(shard.to_local() if isinstance(shard, DTensor) else shard)

    def optimizer_state(self) -> tuple[dict[str, bytes | Streamed], dict[str, Any]]:
        """AdamW's state in the torch engine's layout, each moment gathered as it is
        written. Collective: every rank reads the stream through."""
        params = list(self._model.parameters())
        group = self._optimizer.param_groups[0]
        hyper = {k: v for k, v in group.items() if k != "params"}
        state: dict[int, dict[str, Any]] = {}
        for index, param in enumerate(params):
            live = self._optimizer.state.get(param)
            if live:  # AdamW creates its state at the first step
                step = live["step"]
                state[index] = {
                    "step": _full(step) if isinstance(step, DTensor) else step.detach().clone(),
                    **{k: Gathered(_meta(live[k]), partial(_full, live[k])) for k in ADAM_MOMENTS},
                }
        adamw = {"state": state, "param_groups": [{**hyper, "params": list(range(len(params)))}]}
        files = streamed_state_files(adamw, OPTIMIZER_JSON, OPTIMIZER_TENSORS)
        return files, self._schedule.state_dict()

    def load_optimizer_state(self, files: Mapping[str, bytes], schedule: dict[str, Any]) -> None:
        # Each moment is read when its shard is cut: one full tensor at a time.
        saved = files_to_deferred_state(files, OPTIMIZER_JSON, OPTIMIZER_TENSORS)
        params = list(self._model.parameters())
        (group,) = saved["param_groups"]
        if len(group["params"]) != len(params):
            raise ValueError(
                f"optimizer state holds {len(group['params'])} parameters, "
                f"the model has {len(params)}"
            )
        for live_group in self._optimizer.param_groups:
            live_group.update({k: v for k, v in group.items() if k != "params"})
        for index, param in enumerate(params):
            entry = saved["state"].get(index) if saved["state"] else None
            if entry is None:
                self._optimizer.state.pop(param, None)
                continue
            self._optimizer.state[param] = {
                "step": entry["step"]().detach().clone(),
                **{k: _shard_like(param, entry[k]()) for k in ADAM_MOMENTS},
            }
        self._schedule.load_state_dict(schedule)
