"""The training pool: ``train.ranks`` Ray actors, each holding a training engine; rank 0
also holds the weight publisher.

Driven by the flow's step (``flows/rl_job.py``) through ``TrainerPool``: ``train`` hands
every rank the lease the flow got from the trajectory store; each reads its token-balanced
share of the rows zero-copy out of Ray's object store (never through rank 0 or the
driver), the ranks take one optimiser step together (``engines/train/ranks.py``), and rank 0
publishes the new version to the parameter service before it returns, so a sample the flow
then acknowledges always has a published version behind it. One lease, one
acknowledgement, one version per step, at any rank count. The pool also restores and
writes checkpoints (gathered, written by rank 0) and saves the trained policy.

The engine is the trainer of ``engines/train/trainer.py`` on the strategy ``train.engine``
names (torch/DDP, FSDP2 or DeepSpeed ZeRO; ``engines/train/parallel.py``), held through the
``TrainEngine`` Protocol; only a DeepSpeed run imports DeepSpeed. The trainer is not restarted in
place: a trainer failure (any rank's: the others' collectives fail with it, or time out
after ``train.collective_timeout_s``) fails its segment, and the flow rebuilds every pool
from the last checkpoint.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import ray
import torch
from ray import ObjectRef
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sluice.config.tree import TrainConfig
from sluice.engines.cluster.ray_cluster import gpus_each, pool_dtype, thread_env, visible_gpus
from sluice.engines.protocols import TrainEngine
from sluice.engines.train.ranks import Rendezvous, free_port, join, shares
from sluice.engines.train.trainer import build_engine
from sluice.rl.advantages import BATCH_NORMALISED
from sluice.rl.batching import Sample, TrainBatch
from sluice.storage.batches import TRAIN_FIELDS, batch_normalised, to_train_batch
from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.params import ParameterService
from sluice.storage.safetensors_stream import drain
from sluice.storage.trajectory_index import LeaseGrant
from sluice.storage.trajectory_store import materialize
from sluice.storage.urls import Credentials

T = TypeVar("T")


class Trainer:
    """One rank of the training pool: a training engine and, on rank 0, the parameter
    service it publishes to; ``TrainerActor`` is the same class as a Ray actor.

    Built in two calls: the constructor only records its settings (so Ray can place every
    rank before any loads a model), ``start`` joins the group and builds the engine.
    """

    def __init__(
        self,
        train: TrainConfig,
        model_dir: str,
        seed: int,
        params: ParameterService | None,
        credentials: Credentials | None = None,
        rank: int = 0,
        temperature: float = 1.0,
    ) -> None:
        if credentials:
            credentials.apply()  # checkpoints under an s3:// url
        self.train_cfg, self.model_dir, self.seed = train, model_dir, seed
        # Rank 0 publishes; one publisher for the actor's life: it holds the staging buffers
        # and the snapshot in flight, which the next optimiser step must wait for.
        self.params = params if rank == 0 else None
        self.rank, self.temperature = rank, temperature
        self._engine: TrainEngine | None = None

    def address(self) -> tuple[str, str]:
        """This node's id and IP address (rank 0's become the group's rendezvous)."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def start(self, place: Rendezvous) -> None:
        """Join the pool's group (none for a pool of one) and build the engine."""
        if place.world > 1:
            join(place, self.train_cfg.collective_timeout_s)
        before = self.params.wait_snapshot if self.params else None
        self._engine = build_engine(
            self.train_cfg, self.model_dir, self.seed, before, self.temperature
        )

    @property
    def engine(self) -> TrainEngine:
        if self._engine is None:
            raise RuntimeError("the trainer was not started (TrainerPool.start)")
        return self._engine

    def train(self, lease: LeaseGrant, world: int) -> dict[str, float]:
        """One optimiser step on this rank's share of the leased rows; rank 0 then publishes
        the new version and returns the step's metrics (over every rank)."""
        t0 = time.monotonic()
        table = materialize(lease, list(TRAIN_FIELDS))  # zero-copy out of the object store
        if self.train_cfg.advantage in BATCH_NORMALISED:  # REINFORCE++: over the whole batch
            table = batch_normalised(table)
        batch = rank_batch(
            table, self.rank, world, self.engine.pad_id, self.train_cfg.critic is not None
        )
        metrics = self.engine.step_batch(batch)
        t1 = time.monotonic()
        publish_s = self._publish()
        if self.params is None:
            return {}
        staleness = lease.staleness
        return {
            **metrics,
            "samples": float(len(lease.sample_ids)),
            "staleness": sum(staleness) / len(staleness),
            "staleness_max": float(max(staleness)),
            # What the staleness rule lets through: a long sample's first token is older.
            "first_token_lag_max": float(max(lease.first_token_lag)),
            **{f"staleness_count/{k}": float(n) for k, n in Counter(staleness).items()},
            "step_s": t1 - t0,
            "publish_s": publish_s,
            "publish_bytes": float(self.params.version_bytes),
            # The relay's share: hand-overs to relay 0 that finished since the last step.
            **({"handover_s": max(handed)} if (handed := self.params.handed_over()) else {}),
        }

    def restore(self, files: Mapping[str, bytes], meta: dict[str, Any]) -> int:
        """Load a checkpoint (every rank); rank 0 publishes its weights for the workers."""
        self.engine.load_checkpoint(files, meta)
        self._publish()
        if self.params is not None:
            self.params.wait_snapshot()
        return self.engine.version()

    def _publish(self) -> float:
        """Publish the engine's version (rank 0); returns the seconds publish took. A sharded
        engine's weights are gathered one tensor at a time, every rank taking part, and rank
        0 hands them to the parameter service bucket by bucket as they come: no process
        holds the gathered model. Otherwise the background snapshot copies the live tensors
        while the trainer goes on."""
        engine = self.engine
        if not engine.sharded:
            state = engine.state()
            return self.params.publish(engine.version(), state) if self.params else 0.0
        if self.params is None:
            for _ in engine.gathered():  # this rank's part in each gather
                pass
            return 0.0
        return self.params.publish_from(engine.version(), engine.layout(), engine.gathered())

    def republish(self) -> int:
        """Publish the engine's version again, and wait until relay 0 holds it (every rank:
        a sharded engine gathers): relay 0 restarted in place and lost it. Relay 0 ignores
        it if it holds it after all. Returns the version."""
        if self.params is not None:
            self.params.reopen()
        self._publish()
        if self.params is not None:
            self.params.flush()
        return self.engine.version()

    def save_checkpoint(
        self, url: str, keep_last: int, step: int, meta: dict[str, Any], extra: dict[str, bytes]
    ) -> str:
        """Write an atomic checkpoint of the pool's state (gathered by every rank, written
        by rank 0) with the driver's ``extra`` files; returns its URL (rank 0) or ""."""
        files, counters = self.engine.checkpoint_files()
        if self.rank != 0:
            drain(files)  # this rank's part in each gather
            return ""
        return CheckpointStore(url, keep_last).save(step, {**files, **extra}, {**meta, **counters})

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The current policy's log-prob of each response token of ``samples`` (every rank
        runs the forward pass: a sharded model gathers its layers in it; rank 0's answer
        counts)."""
        return self.engine.logprobs(samples)

    def save(self, folder: str) -> None:
        """Write the current policy as a model folder (rank 0; the others take part in
        gathering sharded weights). The folder is written beside and swapped in whole, so one
        saved again (the run's best policy) is never seen half-written."""
        if self.rank != 0:
            if self.engine.sharded:
                for _ in self.engine.gathered():  # this rank's part in each gather
                    pass
            return
        out = Path(folder)
        staging, old = out.with_name(f".{out.name}.partial"), out.with_name(f".{out.name}.old")
        shutil.rmtree(staging, ignore_errors=True)
        self.engine.save(str(staging))
        if out.exists():
            os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)

    def free_port(self, address: str) -> int:
        """A port free on ``address`` for the group's rendezvous (rank 0)."""
        return free_port(address)

    def pid(self) -> int:
        return os.getpid()

    def devices(self) -> str:
        return visible_gpus()


TrainerActor = ray.remote(Trainer)


def rank_batch(
    table: pa.Table, rank: int, world: int, pad_id: int, skip_failed: bool = False
) -> TrainBatch:
    """Rank ``rank``'s token-balanced share of the leased rows, as training tensors. A rank
    left without rows (a batch smaller than the pool) trains on a row with no loss tokens,
    so it still takes part in the step's collectives. ``skip_failed``: rows whose reward
    failed get no loss tokens (``to_train_batch``)."""
    if world == 1:
        return to_train_batch(table, pad_id, skip_failed)
    lengths = pc.add(
        pc.list_value_length(table.column("prompt_ids")),
        pc.list_value_length(table.column("response_ids")),
    ).to_pylist()
    rows = shares(lengths, world)[rank]
    batch = to_train_batch(table.take(rows or [0]), pad_id, skip_failed)
    return batch if rows else replace(batch, mask=torch.zeros_like(batch.mask))


class TrainerPool:
    """The training pool's ranks, typed: each call goes to every rank and returns rank 0's
    Ray ref at once (the other ranks' refs are checked by the next call, so a rank that
    failed alone is not missed)."""

    def __init__(self, handles: list[Any], group: PlacementGroup | None) -> None:
        self.handles = handles
        self.group = group
        self._others: list[ObjectRef[Any]] = []

    @property
    def handle(self) -> Any:
        return self.handles[0]

    def _all(self, call: Callable[[Any], ObjectRef[T]]) -> ObjectRef[T]:
        """``call`` on every rank's handle; rank 0's ref."""
        if self._others:
            ray.get(self._others)  # done long since; raises a rank's error
        refs = [call(h) for h in self.handles]
        self._others = refs[1:]
        return refs[0]

    def start(self, timeout_s: float) -> None:
        """Join the ranks into one group and build their engines; waits (a model load)."""
        world = len(self.handles)
        address, port = "127.0.0.1", 0
        if world > 1:
            nodes = ray.get([h.address.remote() for h in self.handles])
            if len({node for node, _ in nodes}) > 1:
                address = nodes[0][1]  # ranks on several nodes: rank 0's node IP
            port = ray.get(self.handles[0].free_port.remote(address))
        places = [Rendezvous(address, port, rank, world) for rank in range(world)]
        ray.get([h.start.remote(p) for h, p in zip(self.handles, places, strict=True)])

    def train(self, lease: LeaseGrant) -> ObjectRef[dict[str, float]]:
        world = len(self.handles)
        return self._all(lambda h: h.train.remote(lease, world))

    def restore(self, files: Mapping[str, bytes], meta: dict[str, Any]) -> ObjectRef[int]:
        stored = ray.put(files)
        return self._all(lambda h: h.restore.remote(stored, meta))

    def save_checkpoint(
        self,
        url: str,
        keep_last: int,
        step: int,
        meta: dict[str, Any],
        extra: dict[str, bytes] | None = None,
    ) -> ObjectRef[str]:
        """``extra``: files of the driver's saved with the pool's (rank 0 writes them)."""
        return self._all(
            lambda h: h.save_checkpoint.remote(url, keep_last, step, meta, extra or {})
        )

    def logprobs(self, samples: list[Sample]) -> ObjectRef[list[list[float]]]:
        return self._all(lambda h: h.logprobs.remote(samples))

    def save(self, folder: str) -> ObjectRef[None]:
        return self._all(lambda h: h.save.remote(folder))

    def republish(self) -> ObjectRef[int]:
        return self._all(lambda h: h.republish.remote())

    def pids(self) -> list[int]:
        return ray.get([h.pid.remote() for h in self.handles])

    def devices(self) -> ObjectRef[str]:
        return self.handle.devices.remote()


def launch_trainer(
    train: TrainConfig,
    model_dir: str,
    seed: int,
    params: ParameterService,
    env_vars: dict[str, str],
    gpus: float | None = None,
    temperature: float = 1.0,
) -> TrainerPool:
    """The training pool's ``train.ranks`` actors, each on a node that offers
    ``train.cpus``, ``train.gpus_per_rank`` and ``train.resources``; several ranks are
    placed together as one placement group (``train.placement``: packed on few nodes or
    spread over many). ``gpus``: the GPUs each asks for, if the caller resolved them
    (``gpus_each``) already. ``temperature``: the rollouts' sampling temperature, which the
    trained policy's log-probs divide the logits by, as vLLM's do. Start them with
    ``TrainerPool.start`` once Ray placed them."""
    gpus = gpus_each(train.gpus_per_rank) if gpus is None else gpus
    train = train.model_copy(update={"dtype": pool_dtype(train.dtype, gpus)})
    ask: dict[str, Any] = {
        "num_cpus": train.cpus,
        "num_gpus": gpus,
        "resources": train.resources or None,
        "runtime_env": thread_env(train.threads, env_vars, gpus),
    }
    group = None
    if train.ranks > 1:
        bundle = {"CPU": train.cpus, **({"GPU": gpus} if gpus else {}), **train.resources}
        group = placement_group([bundle] * train.ranks, strategy=train.placement.upper())
    handles = []
    for rank in range(train.ranks):
        where = {}
        if group is not None:
            where["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank
            )
        handles.append(
            TrainerActor.options(**ask, **where).remote(
                train, model_dir, seed, params, Credentials.here(), rank, temperature
            )
        )
    return TrainerPool(handles, group)
