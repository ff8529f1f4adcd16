"""FSDP2 training engine: the torch engine's step with the weights, gradients and AdamW
state sharded across ranks by torch's ``fully_shard``.

Held by the trainer actors of a pool (``engines/trainer_actor.py``; a pool of one forms a
world of one on 127.0.0.1) or run under ``torchrun`` (``scripts/train_ranks.py``). Each
decoder layer is its own FSDP unit and the model the root one, so a forward pass gathers
one layer's weights at a time. Loss, metrics and micro-batching are
``engines.trainer_core``'s, so from the same weights on the same batch it takes the torch
engine's step. Weights and AdamW moments leave the engine gathered parameter by parameter
onto the CPU, in the torch engine's layout (name-keyed weights, an index-keyed AdamW state
dict): checkpoints resume under any engine at any rank count, and nothing is pickled.
Every method that gathers is collective: all ranks call it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from sluice.engines.ranks import backend, free_port, rank_and_world
from sluice.engines.trainer_core import MODEL_FILE, PolicyTrainer
from sluice.rl.batching import TrainBatch
from sluice.storage.torch_state import (
    OPTIMIZER_JSON,
    OPTIMIZER_TENSORS,
    files_to_state,
    restore_rng,
    rng_state_files,
    state_to_files,
    tensors_to_bytes,
)

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the whole of ``tensor`` (gathered from every rank when sharded)."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().to("cpu", copy=True)


def _shard_like(live: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full``, laid out as ``live`` is."""
    full = full.to(device=live.device, dtype=live.dtype)
    if isinstance(live, DTensor):
        return distribute_tensor(full, live.device_mesh, live.placements)
    return full


class FSDPTrainer(PolicyTrainer):
    """A :class:`engines.protocols.TrainEngine` on torch FSDP2 (``fully_shard``)."""

    def _attach_optimizer(self) -> None:
        if not dist.is_initialized():  # a pool of one: a world of one rank (no env vars set,
            # so no other library in this process takes it for a launcher's group)
            dist.init_process_group(
                backend(), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
        self._rank, self._world = rank_and_world()
        mesh = init_device_mesh(self.device.type, (self._world,))
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        for layer in layers or []:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        opt = self.optimisation
        self._optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self._schedule = torch.optim.lr_scheduler.LambdaLR(self._optimizer, opt.warmup())

    @property
    def _sharded(self) -> FSDPModule:
        assert isinstance(self.model, FSDPModule)
        return self.model

    @contextmanager
    def _hold_gradients(self) -> Any:
        # Gradients stay unsharded on each rank until the step's last backward pass.
        self._sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._sharded.set_requires_gradient_sync(True)

    def _no_sync(self) -> AbstractContextManager[object]:
        return self._hold_gradients()

    def step_batch(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on this rank's share of a batch (``rl.batching.TrainBatch``)."""
        self._optimizer.zero_grad(set_to_none=True)
        sums, total_tokens = self._passes(batch, torch.Tensor.backward)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optimisation.grad_clip)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if not torch.isfinite(torch.tensor(grad_norm)):
            self._optimizer.zero_grad(set_to_none=True)
        self._check_grad_norm(grad_norm)
        if self.before_update is not None:
            self.before_update()  # e.g. a weight publish still copying these tensors
        self._optimizer.step()
        lr = float(self._schedule.get_last_lr()[0])
        self._schedule.step()
        self._version += 1
        return sums.metrics(grad_norm, lr, total_tokens)

    def state(self) -> dict[str, torch.Tensor]:
        """The full weights by name, gathered one parameter at a time onto the CPU (the
        device never holds more than one parameter's full weights). Collective."""
        return {name: _full(tensor) for name, tensor in self.model.state_dict().items()}

    def cpu_state(self) -> dict[str, torch.Tensor]:
        return self.state()

    @property
    def sharded(self) -> bool:
        return True

    def layout(self) -> dict[str, torch.Tensor]:
        """The full weights' names, shapes and dtypes (a DTensor's shape is the whole's)."""
        return {
            name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            for name, tensor in self.model.state_dict().items()
        }

    def gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights one parameter at a time, on the device, each gathered from
        every rank when asked for. Collective."""
        for name, tensor in self.model.state_dict().items():
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, whole.detach()
            del whole

    def _adamw_state(self) -> dict[str, Any]:
        """The state dict of a torch AdamW over ``model.parameters()``, gathered."""
        params = list(self.model.parameters())
        group = self._optimizer.param_groups[0]
        hyper = {k: v for k, v in group.items() if k != "params"}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for index, param in enumerate(params):
            live = self._optimizer.state.get(param)
            if live:  # AdamW creates its state at the first step
                step = live["step"]
                state[index] = {
                    "step": _full(step) if isinstance(step, DTensor) else step.detach().clone(),
                    **{k: _full(live[k]) for k in ADAM_MOMENTS},
                }
        return {"state": state, "param_groups": [{**hyper, "params": list(range(len(params)))}]}

    def checkpoint_files(self) -> tuple[dict[str, bytes], dict[str, Any]]:
        """Weights, AdamW state (gathered, in the torch engine's layout) and this rank's RNG
        as named files, plus the counters to restore. Collective; rank 0 writes them."""
        files = {
            MODEL_FILE: tensors_to_bytes(self.state()),
            **state_to_files(self._adamw_state(), OPTIMIZER_JSON, OPTIMIZER_TENSORS),
            **rng_state_files(),
        }
        return files, {"version": self._version, "scheduler": self._schedule.state_dict()}

    def load_checkpoint(self, files: dict[str, bytes], counters: dict[str, Any]) -> None:
        """Restore what ``checkpoint_files`` (of any engine) wrote; collective."""
        if self.before_update is not None:
            self.before_update()
        weights = self.checkpoint_weights(files)
        live = self.model.state_dict()
        if set(weights) != set(live):
            raise ValueError(
                f"checkpoint weights {sorted(set(weights) ^ set(live))[:5]} do not match the model"
            )
        with torch.no_grad():
            for name, tensor in live.items():
                shard = _shard_like(tensor, weights[name])
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                local.copy_(shard.to_local() if isinstance(shard, DTensor) else shard)
        saved = files_to_state(files, OPTIMIZER_JSON, OPTIMIZER_TENSORS)
        params = list(self.model.parameters())
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
                "step": entry["step"].detach().clone(),
                **{k: _shard_like(param, entry[k]) for k in ADAM_MOMENTS},
            }
        self._schedule.load_state_dict(counters["scheduler"])
        restore_rng(files)
        self._version = int(counters["version"])
