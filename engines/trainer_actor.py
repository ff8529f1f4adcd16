"""The trainer actor: a Ray actor holding a training engine and the weight publisher.

Driven by the flow's step (``flows/rl_job.py``) through ``TrainerClient``: ``train`` takes a
lease the flow got from the trajectory store, reads its rows zero-copy out of Ray's object
store, takes one optimiser step and publishes the new version to the parameter service
before it returns, so a sample the flow then acknowledges always has a published version
behind it. It also restores and writes checkpoints and saves the trained policy.

The engine is torch (``engines/torch_trainer.py``) or DeepSpeed ZeRO
(``engines/deepspeed_trainer.py``), chosen once by ``train.engine`` in ``build_engine``;
only a DeepSpeed run imports DeepSpeed. The trainer is not restarted in place: a trainer
failure fails its segment, and the flow rebuilds every pool from the last checkpoint.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import ray
from ray import ObjectRef

from sluice.engines.cluster import gpus_each, pool_dtype, thread_env, visible_gpus
from sluice.engines.trainer_core import PolicyTrainer
from sluice.rl.config import TrainConfig
from sluice.storage.batches import TRAIN_FIELDS, to_train_batch
from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.params import ParameterService
from sluice.storage.trajectory_index import LeaseGrant
from sluice.storage.trajectory_store import materialize
from sluice.storage.urls import Credentials


def build_engine(
    train: TrainConfig, model_dir: str, seed: int, before_update: Callable[[], object] | None
) -> PolicyTrainer:
    """The training engine ``train.engine`` names, set up from the ``train`` section."""
    settings: dict[str, Any] = {
        "lr": train.lr,
        "clip_eps": train.clip_eps,
        "warmup_steps": train.warmup_steps,
        "entropy_coef": train.entropy_coef,
        "grad_clip": train.grad_clip,
        "betas": train.betas,
        "weight_decay": train.weight_decay,
        "micro_batch": train.micro_batch,
        "micro_batch_tokens": train.micro_batch_tokens,
        "packing": train.packing,
        "loss": train.loss,
        "is_cap": train.is_cap,
        "threads": train.threads,
        "seed": seed,
        "before_update": before_update,
        "dtype": train.dtype,  # resolved from "auto" by launch_trainer
    }
    if train.engine == "deepspeed":
        from sluice.engines.deepspeed_trainer import DeepSpeedTrainer  # only runs that use it

        return DeepSpeedTrainer(model_dir, zero_stage=train.zero_stage, **settings)
    from sluice.engines.torch_trainer import TorchTrainer

    return TorchTrainer(model_dir, **settings)


class Trainer:
    """A training engine and the parameter service it publishes to; ``TrainerActor`` is
    the same class as a Ray actor."""

    def __init__(
        self,
        train: TrainConfig,
        model_dir: str,
        seed: int,
        params: ParameterService,
        credentials: Credentials | None = None,
    ) -> None:
        if credentials:
            credentials.apply()  # checkpoints under an s3:// url
        # One publisher for the actor's life: it holds the staging buffers and the snapshot
        # in flight, which the next optimiser step must wait for (before_update).
        self.params = params
        self.engine = build_engine(train, model_dir, seed, before_update=params.wait_snapshot)

    def train(self, lease: LeaseGrant) -> dict[str, float]:
        """One optimiser step on the leased rows, then publish the new version."""
        t0 = time.monotonic()
        table = materialize(lease, list(TRAIN_FIELDS))  # zero-copy out of the object store
        metrics = self.engine.step_batch(to_train_batch(table, self.engine.pad_id))
        t1 = time.monotonic()
        publish_s = self.params.publish(self.engine.version(), self.engine.state())
        staleness = lease.staleness
        return {
            **metrics,
            "samples": float(len(lease.sample_ids)),
            "staleness": sum(staleness) / len(staleness),
            "staleness_max": float(max(staleness)),
            **{f"staleness_count/{k}": float(n) for k, n in Counter(staleness).items()},
            "step_s": t1 - t0,
            "publish_s": publish_s,
        }

    def restore(self, files: dict[str, bytes], meta: dict[str, Any]) -> int:
        """Load a checkpoint and publish its weights, so rollout workers can pull them."""
        self.engine.load_checkpoint(files, meta)
        self.params.publish(self.engine.version(), self.engine.state())
        self.params.wait_snapshot()
        return self.engine.version()

    def save_checkpoint(self, url: str, keep_last: int, step: int, meta: dict[str, Any]) -> str:
        """Write an atomic checkpoint of the trainer's state; returns its URL."""
        files, counters = self.engine.checkpoint_files()
        return CheckpointStore(url, keep_last).save(step, files, {**meta, **counters})

    def save(self, folder: str) -> None:
        """Write the current policy as a model folder."""
        self.engine.save(folder)

    def pid(self) -> int:
        return os.getpid()

    def devices(self) -> str:
        return visible_gpus()


TrainerActor = ray.remote(Trainer)


class TrainerClient:
    """The trainer actor's handle, typed; each call returns its Ray ref at once."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def train(self, lease: LeaseGrant) -> ObjectRef[dict[str, float]]:
        return self.handle.train.remote(lease)

    def restore(self, files: dict[str, bytes], meta: dict[str, Any]) -> ObjectRef[int]:
        return self.handle.restore.remote(files, meta)

    def save_checkpoint(
        self, url: str, keep_last: int, step: int, meta: dict[str, Any]
    ) -> ObjectRef[str]:
        return self.handle.save_checkpoint.remote(url, keep_last, step, meta)

    def save(self, folder: str) -> ObjectRef[None]:
        return self.handle.save.remote(folder)

    def pid(self) -> ObjectRef[int]:
        return self.handle.pid.remote()

    def devices(self) -> ObjectRef[str]:
        return self.handle.devices.remote()


def launch_trainer(
    train: TrainConfig,
    model_dir: str,
    seed: int,
    params: ParameterService,
    env_vars: dict[str, str],
    gpus: float | None = None,
) -> TrainerClient:
    """The trainer actor, on a node that offers ``train.cpus``, ``train.gpus_per_rank``
    and ``train.resources``. ``gpus``: the GPUs it asks for, if the caller resolved them
    (``gpus_each``) already."""
    gpus = gpus_each(train.gpus_per_rank) if gpus is None else gpus
    train = train.model_copy(update={"dtype": pool_dtype(train.dtype, gpus)})
    handle = TrainerActor.options(
        num_cpus=train.cpus,
        num_gpus=gpus,
        resources=train.resources or None,
        runtime_env=thread_env(train.threads, env_vars, gpus),
    ).remote(train, model_dir, seed, params, Credentials.here())
    return TrainerClient(handle)
