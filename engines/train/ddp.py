"""Plain torch training: AdamW over the trainable parameters, DDP across ranks.

The trainer's (``engines/train/trainer.py``) strategy for ``train.engine: torch``. In a pool
of several ranks (``engines/train/ranks.py``) the model is wrapped in torch's
``DistributedDataParallel``: each rank trains on its share of the batch and DDP averages
the gradients on a step's last backward pass, so every rank applies the same update and
holds the same weights. Under ``train.lora`` only the adapters are trainable, so AdamW
steps them alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sluice.config.tree import TrainConfig
from sluice.engines.train.parallel import (
    Optimisation,
    clip_and_step,
    cpu_copies,
    live_state,
    load_policy,
    materialise,
    meta_layout,
    meta_policy,
    storage_dtype,
)
from sluice.engines.train.ranks import rank_and_world
from sluice.storage.safetensors_stream import Streamed
from sluice.storage.torch_state import load_optimizer, optimizer_to_files


class DataParallel:
    """A :class:`engines.train.parallel.Parallelism`: every rank holds the whole model."""

    sharded = False

    def load(self, folder: Path, device: torch.device, train: TrainConfig) -> Any:
        """Rank 0 reads the folder; the other ranks only make room, and ``attach`` broadcasts
        rank 0's weights into it: one read of the folder per pool."""
        dtype = storage_dtype(train)
        if rank_and_world()[0] == 0:
            return load_policy(folder, device, dtype)
        model = meta_policy(folder, dtype)
        materialise(model, device)
        # to_empty gave each module a tensor of its own: tie them again, as rank 0's loading
        # does, or the ranks would hold different parameters (DDP refuses to start).
        model.tie_weights()
        return model

    def attach(self, model: torch.nn.Module, opt: Optimisation, train: TrainConfig) -> Any:
        self._model, self._clip = model, opt.grad_clip
        self._ddp: DistributedDataParallel | None = None
        if rank_and_world()[1] > 1:
            # Rank 0's weights reach the others a tensor at a time: DDP's own start-up sync
            # packs them into 250 MB buckets, a copy a rank held beside its model (0.49x of
            # SmolLM2-135M's float32 bytes, `make bench-startup-memory`).
            with torch.no_grad():
                for param in model.parameters():
                    dist.broadcast(param, src=0)
            # A causal LM's buffers (rotary frequencies) never change; DDP's default would
            # broadcast them from rank 0 before every forward pass, a collective per pass.
            self._ddp = DistributedDataParallel(model, broadcast_buffers=False, init_sync=False)
        self._optimizer = opt.adamw([p for p in model.parameters() if p.requires_grad])
        self._schedule = opt.schedule(self._optimizer)
        return self._ddp or model

    def settle(self) -> None:
        pass  # a forward leaves nothing gathered

    def no_sync(self) -> AbstractContextManager[object]:
        return self._ddp.no_sync() if self._ddp is not None else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def apply(self, before_update: Callable[[], object]) -> tuple[float, float]:
        return clip_and_step(
            self._model.parameters(), self._clip, self._optimizer, self._schedule, before_update
        )

    def state(self) -> dict[str, torch.Tensor]:
        return live_state(self._model)

    def layout(self) -> dict[str, torch.Tensor]:
        return meta_layout(self.state())

    def gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.state().items()

    def cpu_state(self) -> dict[str, torch.Tensor]:
        return cpu_copies(self.state())

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._model.load_state_dict(dict(weights), strict=True)  # a rank holds it whole

    def optimizer_state(self) -> tuple[dict[str, bytes | Streamed], dict[str, Any]]:
        """AdamW's state (rank 0's: every rank holds the same, and rank 0 writes it)."""
        if rank_and_world()[0] != 0:
            return {}, {}
        return optimizer_to_files(self._optimizer), self._schedule.state_dict()

    def load_optimizer_state(self, files: Mapping[str, bytes], schedule: dict[str, Any]) -> None:
        load_optimizer(self._optimizer, files)
        self._schedule.load_state_dict(schedule)
