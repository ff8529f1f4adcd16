"""What a parallelism strategy does for the trainer, and the parts the strategies share.

The trainer (``engines/train/trainer.py``) owns the loss, the micro-batching, the metrics and
the step. What differs between training engines sits behind ``Parallelism``: how the model
is wrapped, how a backward pass keeps or reduces its gradients, how the update is clipped
and applied, where the full weights live (for publishing and checkpoints) and how the
optimiser's state goes out and back in. One strategy per engine: ``engines/train/ddp.py`` (plain
torch, DDP across ranks), ``engines/train/fsdp.py`` (torch FSDP2) and ``engines/train/zero.py``
(DeepSpeed ZeRO). ``engines.train.trainer.strategy_for`` picks one from ``train.engine``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from sluice.config.tree import TrainConfig
from sluice.storage.faults import fault_point
from sluice.storage.safetensors_stream import Streamed


@dataclass(frozen=True)
class Optimisation:
    """AdamW and its schedule, the same for every engine (``train`` in the config)."""

    lr: float
    grad_clip: float
    warmup_steps: int = 0
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8  # torch's AdamW default

    @classmethod
    def of(cls, train: TrainConfig) -> Optimisation:
        return cls(
            train.lr,
            train.grad_clip,
            train.warmup_steps,
            (train.betas[0], train.betas[1]),
            train.weight_decay,
            train.adam_eps,
        )

    def warmup(self) -> Callable[[int], float]:
        """The LambdaLR factor: linear from 1/(warmup+1) of the rate to all of it."""
        steps = self.warmup_steps
        return lambda step: min(1.0, (step + 1) / (steps + 1))

    def adamw(self, params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
        )

    def schedule(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.warmup())


class Parallelism(Protocol):
    """What one training engine does differently from the others. ``attach`` comes first;
    every method that gathers sharded tensors is collective (all ranks call it)."""

    @property
    def sharded(self) -> bool:
        """Whether the weights are sharded across ranks: the trainer then publishes them
        through ``layout`` and ``gathered``, one full tensor at a time."""
        ...

    def load(self, folder: Path, device: torch.device, train: TrainConfig) -> Any:
        """The model folder's causal LM for this rank, in ``storage_dtype``, built so that
        the rank never holds more of it than it will own: whole (one rank, or DDP's rank 0),
        or built on the meta device and filled in ``attach``."""
        ...

    def attach(self, model: torch.nn.Module, opt: Optimisation, train: TrainConfig) -> Any:
        """Wrap ``model``, fill in what ``load`` left empty, and build the optimiser and its
        schedule over its trainable parameters; returns what the forward pass calls (the
        model or its wrapper)."""
        ...

    def settle(self) -> None:
        """Put the weights back as a step expects to find them after forward passes outside
        one (the trainer's start-up checks)."""
        ...

    def no_sync(self) -> AbstractContextManager[object]:
        """A context in which a backward pass keeps its gradients on this rank (every pass
        of a step but the last)."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def apply(self, before_update: Callable[[], object]) -> tuple[float, float]:
        """Clip and apply the accumulated gradients, calling ``before_update`` right before
        the weights change, then step the schedule and clear the gradients; returns the
        gradient norm (before clipping) and the learning rate the update used. With a
        non-finite norm the weights are left as they were."""
        ...

    def state(self) -> dict[str, torch.Tensor]:
        """The full weights by name: the live tensors, or gathered copies when sharded."""
        ...

    def layout(self) -> dict[str, torch.Tensor]:
        """``state``'s names, shapes and dtypes as meta tensors (nothing gathered)."""
        ...

    def gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``state``'s tensors one at a time, each gathered as it is asked for."""
        ...

    def cpu_state(self) -> dict[str, torch.Tensor]:
        """The full weights as CPU copies, never a whole-model copy on the device."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Set the weights from full tensors by name (each rank keeps its own part; a
        tensor is read from ``weights`` when it is looked up)."""
        ...

    def optimizer_state(self) -> tuple[dict[str, bytes | Streamed], dict[str, Any]]:
        """AdamW's state as files in the torch engine's layout (so any engine at any rank
        count can load it), and the schedule's state; its tensors file is streamed (for a
        partitioned state, gathered moment by moment as it is written: collective)."""
        ...

    def load_optimizer_state(self, files: Mapping[str, bytes], schedule: dict[str, Any]) -> None:
        """Restore what ``optimizer_state`` wrote (by this engine or another)."""
        ...


def clip_and_step(
    params: Iterator[torch.nn.Parameter],
    clip: float,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LambdaLR,
    before_update: Callable[[], object],
) -> tuple[float, float]:
    """torch's step, as DDP and FSDP2 take it: clip the gradients' global norm, and unless
    it is non-finite call ``before_update`` and step AdamW and the schedule; the gradients
    are cleared either way. Returns the norm (a sharded norm gathered) and the rate used."""
    lr = float(schedule.get_last_lr()[0])
    try:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if math.isfinite(grad_norm):
            before_update()
            fault_point("trainer.optimizer_step")  # tests: the trainer dying mid step
            optimizer.step()
            schedule.step()
    finally:
        optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def load_policy(
    folder: Path, device: torch.device | None, dtype: torch.dtype = torch.float32
) -> Any:
    """The model folder's causal LM in ``dtype``, moved to ``device`` unless None
    (safetensors only: a ``pytorch_model.bin`` would be unpickled)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True)
    return model if device is None else model.to(device)  # type: ignore[arg-type]


def meta_policy(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The model folder's architecture in ``dtype`` with every tensor on the meta device:
    no storage, nothing read. ``materialise`` gives it storage and its buffers."""
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def storage_dtype(train: TrainConfig) -> torch.dtype:
    """The dtype the model's weights are held in: float32 master weights for whatever the
    optimiser steps; a LoRA run's frozen base in the run's compute dtype, since it is only
    ever read (its float32 adapters are peft's upcast of them: ``autocast_adapter_dtype``)."""
    if train.lora is not None and train.dtype == "bfloat16":
        return torch.bfloat16
    return torch.float32


def materialise(model: Any, device: torch.device) -> None:
    """Storage on ``device`` for a meta-built model's tensors (each rank's shards once
    sharded), uninitialised; then the buffers no checkpoint holds (a rotary embedding's
    frequencies) computed as transformers computes them when it loads a model
    (``PreTrainedModel._init_weights`` on their modules)."""
    model.to_empty(device=device)
    owners = {name.rpartition(".")[0] for name, _ in model.named_non_persistent_buffers()}
    with torch.no_grad():
        for owner in owners:
            model._init_weights(model.get_submodule(owner))


class FolderWeights:
    """A model folder's safetensors weights, read one tensor at a time when asked for (the
    files are memory-mapped: no copy of the whole model is made), under the names of the
    model's parameters (a tied output embedding is read from the input embedding's)."""

    def __init__(self, folder: Path, model: torch.nn.Module) -> None:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            where = json.loads(index.read_text())["weight_map"]
        else:
            single = folder / "model.safetensors"
            with safe_open(str(single), "pt") as f:
                where = dict.fromkeys(f.keys(), single.name)
        self._files = {name: safe_open(str(folder / name), "pt") for name in set(where.values())}
        aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        self._stored: dict[str, tuple[str, str]] = {}  # parameter -> (file, stored name)
        for names in aliases.values():
            stored = next((n for n in names if n in where), None)
            if stored is not None:
                self._stored.update(dict.fromkeys(names, (where[stored], stored)))
        missing = sorted(n for names in aliases.values() for n in names if n not in self._stored)
        if missing:
            raise ValueError(
                f"{folder}: the safetensors files hold no tensor for {missing[:5]} (of "
                f"{len(missing)}); a folder whose names differ from the model's parameters "
                "(a checkpoint transformers converts on load) cannot be loaded shard by shard"
            )

    def get(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s full tensor, read now, in float32 on the CPU."""
        file, stored = self._stored[name]
        return self._files[file].get_tensor(stored).to(torch.float32)


def live_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An unsharded model's weights by name: the live tensors, not copies."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def meta_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in tensors.items()}


def cpu_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies made one tensor at a time (copies even on a CPU trainer)."""
    return {k: v.to("cpu", copy=True) for k, v in tensors.items()}
