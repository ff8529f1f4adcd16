"""DeepSpeed training engine: the torch engine's step, with ZeRO partitioning the optimiser
state (stage 1), the gradients too (stage 2) and the weights too (stage 3) across ranks.

Held by the trainer actor (``engines/trainer_actor.py``: a world of one on 127.0.0.1) or as
one process per rank under ``torchrun`` (``scripts/train_ranks.py``). On CPU it uses the
gloo backend and torch's AdamW (``torch_adam``). ``deepspeed_config`` builds DeepSpeed's
config from Sluice's (``train`` in the config): there is no JSON for a user to keep in sync.
Loss, metrics and micro-batching are ``engines.trainer_core``'s, so from the same weights on
the same batch it takes the torch engine's step.

Data parallelism: every rank calls ``step_batch`` with its share of the batch
(``engines.ranks.shares``); DeepSpeed averages the gradients across ranks. Checkpoints are
gathered into the torch engine's layout (``engines.zero_state``), so no file is pickled and
either engine can resume them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from sluice.engines.ranks import backend, free_port
from sluice.engines.trainer_core import MODEL_FILE, Optimisation, PolicyTrainer
from sluice.engines.zero_state import (
    gather_adamw_state,
    gather_weights,
    gathered_weights,
    load_weights,
    scatter_adamw_state,
    weights_layout,
)
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

ZERO_STAGES = (1, 2, 3)
# DeepSpeed 0.19.8 calls two collectives torch 2.13 deprecates on every ZeRO-3 step; a
# warning per step would bury the run's own log.
warnings.filterwarnings(
    "ignore",
    message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
    category=FutureWarning,
)


def check_zero_stage(stage: int) -> int:
    if stage not in ZERO_STAGES:
        allowed = ", ".join(map(str, ZERO_STAGES))
        raise ValueError(f"zero_stage {stage!r} is not supported; allowed: {allowed}")
    return stage


def deepspeed_config(
    opt: Optimisation, micro_batch: int, zero_stage: int, world_size: int
) -> dict[str, Any]:
    """DeepSpeed's config dict, from Sluice's training settings."""
    return {
        # DeepSpeed checks these three against each other and uses them only for its own
        # data loader and throughput counters; Sluice cuts batches itself (by rows and tokens).
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world_size,
        # A batch takes as many micro-batches as its tokens need, so Sluice, not a fixed
        # count, says where a step ends: backward() accumulates, step() reduces and applies.
        "managed_gradient_accumulation": False,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": opt.lr,
                "betas": list(opt.betas),
                "eps": opt.eps,
                "weight_decay": opt.weight_decay,
                "torch_adam": True,  # DeepSpeed's fused Adam needs a GPU; on CPU, torch's
                "adam_w_mode": True,
            },
        },
        "gradient_clipping": opt.grad_clip,
        "zero_optimization": {"stage": check_zero_stage(zero_stage)},
        # float32 throughout, as the torch engine: CPUs here have no fast bf16 training path.
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def init_process_group() -> None:
    """Use the group the training pool joined (``engines.ranks.join``) or ``torchrun`` set
    up, or, in a lone process, form a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
        )
    deepspeed.init_distributed(dist_backend=backend())


class DeepSpeedTrainer(PolicyTrainer):
    """A :class:`engines.protocols.TrainEngine` on DeepSpeed ZeRO (stage 1, 2 or 3)."""

    def __init__(self, model_dir: str, zero_stage: int = 2, **settings: Any) -> None:
        self._zero_stage = check_zero_stage(zero_stage)  # before the model loads
        super().__init__(model_dir, **settings)

    def _attach_optimizer(self) -> None:
        init_process_group()
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        config = deepspeed_config(
            self.optimisation, self._micro_batch, self._zero_stage, self._world
        )
        warmup = self.optimisation.warmup()
        self._engine, self._zero, _, _ = deepspeed.initialize(
            model=self.model,
            model_parameters=self.model.parameters(),
            config=config,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, warmup),
        )
        self._network = self._engine

    @property
    def zero_stage(self) -> int:
        return self._zero_stage

    def step_batch(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on this rank's share of a batch (``rl.batching.TrainBatch``)."""
        sums, total_tokens = self._passes(batch, self._engine.backward)
        lr = float(self._engine.get_lr()[0])
        if self.before_update is not None:
            self.before_update()  # e.g. a weight publish still copying these tensors
        self._engine.step()
        grad_norm = float(self._engine.get_global_grad_norm())
        self._check_grad_norm(grad_norm)  # DeepSpeed skips a step with a non-finite norm
        self._version += 1
        return sums.metrics(grad_norm, lr, total_tokens)

    def state(self) -> dict[str, torch.Tensor]:
        """The full weights by name: live ones below stage 3, gathered copies at stage 3.
        Collective at stage 3: every rank calls it."""
        if self._zero_stage == 3:
            return gathered_weights(self.model)
        return super().state()

    @property
    def sharded(self) -> bool:
        return self._zero_stage == 3

    def layout(self) -> dict[str, torch.Tensor]:
        if self._zero_stage == 3:
            return weights_layout(self.model)
        return super().layout()

    def gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights; at stage 3 gathered module by module as they are asked for
        (collective)."""
        if self._zero_stage == 3:
            yield from gather_weights(self.model)
        else:
            yield from super().gathered()

    def cpu_state(self) -> dict[str, torch.Tensor]:
        """The full weights as CPU tensors; at stage 3 gathered module by module straight to
        the CPU, so the device never holds more than one module's full weights."""
        if self._zero_stage == 3:
            return gathered_weights(self.model)
        return super().cpu_state()

    def checkpoint_files(self) -> tuple[dict[str, bytes], dict[str, Any]]:
        """Weights, AdamW state (gathered, in the torch engine's layout) and this rank's RNG
        as named files, plus the counters to restore. Collective; rank 0 writes them."""
        optimizer = gather_adamw_state(self.model, self._zero)
        files = {
            MODEL_FILE: tensors_to_bytes(self.cpu_state()),
            **state_to_files(optimizer, OPTIMIZER_JSON, OPTIMIZER_TENSORS),
            **rng_state_files(),
        }
        scheduler = self._engine.lr_scheduler.state_dict()
        return files, {"version": self._version, "scheduler": scheduler}

    def load_checkpoint(self, files: dict[str, bytes], counters: dict[str, Any]) -> None:
        """Restore what ``checkpoint_files`` (of either engine) wrote; collective."""
        if self.before_update is not None:
            self.before_update()
        load_weights(self.model, self.checkpoint_weights(files))
        optimizer = files_to_state(files, OPTIMIZER_JSON, OPTIMIZER_TENSORS)
        scatter_adamw_state(self.model, self._zero, optimizer)
        self._engine.lr_scheduler.load_state_dict(counters["scheduler"])
        restore_rng(files)
        self._version = int(counters["version"])
