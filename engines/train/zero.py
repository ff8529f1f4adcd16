"""DeepSpeed ZeRO: the optimiser state (stage 1), the gradients too (stage 2) and the weights
too (stage 3) partitioned across ranks.

The trainer's (``engines/train/trainer.py``) strategy for ``train.engine: deepspeed``, in
the trainer actors of a pool (a world of one on 127.0.0.1) or as one process per rank under
``torchrun`` (``scripts/train_ranks.py``). On CPU it uses the
gloo backend and torch's AdamW (``torch_adam``). ``deepspeed_config`` builds DeepSpeed's
config from Sluice's (``train`` in the config): there is no JSON for a user to keep in sync.
Every rank trains on its share of the batch (``engines.train.ranks.shares``); DeepSpeed averages
the gradients across ranks at its step. Checkpoints are
gathered into the torch engine's layout (``engines.train.zero_state``), so no file is pickled and
either engine can resume them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from sluice.config.tree import TrainConfig
from sluice.engines.train.parallel import (
    Optimisation,
    cpu_copies,
    live_state,
    load_policy,
    meta_layout,
)
from sluice.engines.train.ranks import backend, free_port
from sluice.engines.train.zero_state import (
    gather_adamw_state,
    gather_weights,
    gathered_weights,
    load_weights,
    scatter_adamw_state,
    weights_layout,
)
from sluice.storage.faults import fault_point
from sluice.storage.safetensors_stream import Streamed
from sluice.storage.torch_state import (
    OPTIMIZER_JSON,
    OPTIMIZER_TENSORS,
    files_to_deferred_state,
    streamed_state_files,
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
    opt: Optimisation,
    micro_batch: int,
    zero_stage: int,
    world_size: int,
    dtype: str = "float32",
    largest_tensor: int | None = None,
) -> dict[str, Any]:
    """DeepSpeed's config dict, from Sluice's training settings. ``largest_tensor``, the
    model's largest parameter in elements, bounds what a stage-3 forward keeps gathered."""
    # bfloat16: DeepSpeed's torch_autocast, as the other engines' (float32 master weights
    # and AdamW state, the forward in bf16 autocast). Without it DeepSpeed's forward turns
    # the caller's autocast off (runtime/torch_autocast.py: autocast_if_enabled) and trains
    # in float32. No module is listed as lower-precision safe, so gradients are reduced in
    # float32 as under DDP and FSDP2 (DeepSpeed's default would reduce Linear ones in bf16).
    autocast = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    # Stage 3 lets a forward keep up to 1e9 gathered parameters live by default, the
    # whole of a model under a few billion, beside the rank's partition. Limited to the
    # largest tensor, SmolLM2's start-up peak at two ranks fell from 3.5x its float32
    # weights to 2.2x, for 2-9% longer steps (BENCHMARKS.md, "Trainer memory at
    # start-up"). The reuse distance stays DeepSpeed's: lowered too, it raised the step's
    # peak (parameters released in the forward are gathered again in the backward).
    gathered_limit = (
        {"stage3_max_live_parameters": largest_tensor}
        if largest_tensor is not None and zero_stage == 3
        else {}
    )
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
        "zero_optimization": {"stage": check_zero_stage(zero_stage), **gathered_limit},
        **({"torch_autocast": autocast} if dtype == "bfloat16" else {}),
        # DeepSpeed's own bf16 (bf16 weights, float32 master copies in the optimiser) is
        # off: weights stay float32, so checkpoints and gathers are the other engines'.
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def init_process_group() -> None:
    """Use the group the training pool joined (``engines.train.ranks.join``) or ``torchrun`` set
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


class Zero:
    """A :class:`engines.train.parallel.Parallelism` on DeepSpeed ZeRO (stage 1, 2 or 3)."""

    def __init__(self, stage: int = 2) -> None:
        self.stage = check_zero_stage(stage)

    @property
    def sharded(self) -> bool:
        return self.stage == 3

    def _config(
        self, opt: Optimisation, train: TrainConfig, model: torch.nn.Module | None = None
    ) -> dict[str, Any]:
        init_process_group()
        world = dist.get_world_size()
        largest = None
        if model is not None:  # a partitioned parameter's full size is its ds_numel
            largest = max(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        return deepspeed_config(opt, train.micro_batch, self.stage, world, train.dtype, largest)

    def load(self, folder: Path, device: torch.device, train: TrainConfig) -> Any:
        """Below stage 3 the whole model; at stage 3 built under DeepSpeed's partitioned
        init (``deepspeed.zero.Init``, which transformers enters while a
        ``HfDeepSpeedConfig`` lives), each rank keeping its partition of every tensor as
        transformers loads them."""
        if not self.sharded:
            return load_policy(folder, device)
        from transformers.integrations import HfDeepSpeedConfig

        live = HfDeepSpeedConfig(self._config(Optimisation.of(train), train))
        try:
            return load_policy(folder, None)  # zero.Init put the partitions on the device
        finally:
            del live  # later loads in this process (a saved folder) are plain ones

    def attach(self, model: torch.nn.Module, opt: Optimisation, train: TrainConfig) -> Any:
        config = self._config(opt, train, model)
        warmup = opt.warmup()
        self._model = model
        self._engine, self._zero, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=config,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, warmup),
        )
        return self._engine

    def settle(self) -> None:
        pass  # a forward leaves nothing gathered

    def no_sync(self) -> AbstractContextManager[object]:
        return nullcontext()  # ZeRO reduces at its step, not in the backward passes

    def backward(self, loss: torch.Tensor) -> None:
        self._engine.backward(loss)

    def apply(self, before_update: Callable[[], object]) -> tuple[float, float]:
        lr = float(self._engine.get_lr()[0])
        before_update()
        fault_point("trainer.optimizer_step")  # tests: the trainer dying mid step
        self._engine.step()  # DeepSpeed skips a step with a non-finite norm
        return float(self._engine.get_global_grad_norm()), lr

    def state(self) -> dict[str, torch.Tensor]:
        """The full weights by name: live ones below stage 3, gathered CPU copies at stage
        3 (collective)."""
        return gathered_weights(self._model) if self.sharded else live_state(self._model)

    def layout(self) -> dict[str, torch.Tensor]:
        return weights_layout(self._model) if self.sharded else meta_layout(self.state())

    def gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights; at stage 3 gathered module by module as they are asked for
        (collective)."""
        if self.sharded:
            yield from gather_weights(self._model)
        else:
            yield from self.state().items()

    def cpu_state(self) -> dict[str, torch.Tensor]:
        """At stage 3 gathered module by module straight to the CPU, so the device never
        holds more than one module's full weights."""
        return gathered_weights(self._model) if self.sharded else cpu_copies(self.state())

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        load_weights(self._model, weights)

    def optimizer_state(self) -> tuple[dict[str, bytes | Streamed], dict[str, Any]]:
        """AdamW's state in the torch engine's layout, each moment gathered as it is
        written. Collective: every rank reads the stream through."""
        adamw = gather_adamw_state(self._model, self._zero)
        files = streamed_state_files(adamw, OPTIMIZER_JSON, OPTIMIZER_TENSORS)
        return files, self._engine.lr_scheduler.state_dict()

    def load_optimizer_state(self, files: Mapping[str, bytes], schedule: dict[str, Any]) -> None:
        # Each moment is read when it is scattered: one full tensor at a time.
        adamw = files_to_deferred_state(files, OPTIMIZER_JSON, OPTIMIZER_TENSORS)
        scatter_adamw_state(self._model, self._zero, adamw)
        self._engine.lr_scheduler.load_state_dict(schedule)
