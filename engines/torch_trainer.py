"""torch training engine: one policy-gradient step per batch of scored samples.

Held by the trainer actor (``engines/trainer_actor.py``) or run in-process in tests. Holds
the policy, a plain torch AdamW and the version counter; hands out its weights as one
safetensors blob. In a pool of several ranks (``engines/ranks.py``) the model is wrapped in
torch's ``DistributedDataParallel``: each rank trains on its share of the batch and DDP
averages the gradients on a step's last backward pass, so every rank applies the same
update and holds the same weights. The loss, metrics and micro-batching are
``engines.trainer_core``'s, shared with the other engines. Under ``train.lora`` the
optimiser steps the adapters alone, and the checkpoint holds the adapter, not the base.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from sluice.engines.lora import load_adapter_state
from sluice.engines.trainer_core import PolicyTrainer
from sluice.rl.batching import TrainBatch
from sluice.storage.torch_state import (
    load_optimizer,
    optimizer_to_files,
    restore_rng,
    rng_state_files,
)


class TorchTrainer(PolicyTrainer):
    """A :class:`engines.protocols.TrainEngine` on one process with plain torch."""

    def _attach_optimizer(self) -> None:
        if self._world > 1:
            # A causal LM's buffers (rotary frequencies) never change; DDP's default would
            # broadcast them from rank 0 before every forward pass, a collective per pass.
            self._ddp = DistributedDataParallel(self.model, broadcast_buffers=False)
            self._network = self._ddp
        opt = self.optimisation
        self._optimizer = torch.optim.AdamW(
            self.trainable(),
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self._schedule = torch.optim.lr_scheduler.LambdaLR(self._optimizer, opt.warmup())

    def step_batch(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on this rank's share of a batch (``rl.batching.TrainBatch``)."""
        self._optimizer.zero_grad(set_to_none=True)
        sums, total_tokens = self._passes(batch, torch.Tensor.backward)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.optimisation.grad_clip
        )
        if not torch.isfinite(grad_norm):
            self._optimizer.zero_grad(set_to_none=True)
        self._check_grad_norm(float(grad_norm))
        if self.before_update is not None:
            self.before_update()  # e.g. a weight publish still copying these tensors
        self._optimizer.step()
        lr = float(self._schedule.get_last_lr()[0])
        self._schedule.step()
        self._version += 1
        return sums.metrics(float(grad_norm), lr, total_tokens)

    def _no_sync(self) -> AbstractContextManager[object]:
        return self._ddp.no_sync() if self._world > 1 else nullcontext()

    def checkpoint_files(self) -> tuple[dict[str, bytes], dict[str, Any]]:
        """Model, optimiser and RNG state as named files, plus the counters to restore."""
        files = {
            **self.weight_files(),
            **optimizer_to_files(self._optimizer),
            **rng_state_files(),
        }
        return files, {"version": self._version, "scheduler": self._schedule.state_dict()}

    def load_checkpoint(self, files: dict[str, bytes], counters: dict[str, Any]) -> None:
        """Restore what ``checkpoint_files`` wrote; continues at the saved version."""
        if self.before_update is not None:
            self.before_update()
        weights = self.checkpoint_weights(files)
        if self.lora is not None:
            load_adapter_state(self.model, weights)
        else:
            self.model.load_state_dict(weights, strict=True)
        load_optimizer(self._optimizer, files)
        self._schedule.load_state_dict(counters["scheduler"])
        restore_rng(files)
        self._version = int(counters["version"])
