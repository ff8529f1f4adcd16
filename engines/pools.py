"""Ray actors that host the engines: rollout workers (vLLM) and the trainer (torch or
DeepSpeed, ``train.engine``).

Each actor gets a fixed number of Ray CPU slots and sets its own thread count to match,
so that pools never oversubscribe the cores they were given (Ray sets OMP_NUM_THREADS=1
in actors; torch would otherwise guess). The driver only holds handles: trajectories travel
rollout worker -> trajectory store -> trainer, weights trainer -> parameter service ->
rollout worker, both through Ray's object store, never through the driver.

Rollout workers are restarted by Ray when their process dies (``max_restarts``); the flow
sees the failed call, hands the worker's unfinished prompts back to the queue and gives it
new work (``tasks/rollout.py``). The trainer is not restarted in place: a trainer failure
fails its segment, and the flow rebuilds every pool from the last checkpoint.

Placement on a cluster: rollout workers and the trainer ask for the custom Ray resources
of ``rollout.resources`` / ``train.resources`` (e.g. ``rollout`` and ``trainer``, which the
infra/terraform worker groups advertise), so they land on the nodes meant for them. A
rollout worker whose node is lost waits, restarting, until a node with its resources joins.
The control-plane actors (trajectory store, dispatcher, parameter relay 0) go on the
driver's own node (``on_driver_node``).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sluice.engines.rollout_worker import RolloutWorkerBase
from sluice.engines.torch_trainer import TorchTrainer
from sluice.storage.batches import TRAIN_FIELDS, to_train_batch
from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.params import ParameterService
from sluice.storage.trajectory_store import StoreClient
from sluice.storage.urls import Credentials


def child_env() -> dict[str, str]:
    """Variables Ray actors need (they do not inherit this process's later changes)."""
    keys = (
        "VLLM_CACHE_ROOT",
        "VLLM_NO_USAGE_STATS",
        "VLLM_DO_NOT_TRACK",
        "TORCHINDUCTOR_CACHE_DIR",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HOME",
        "TOKENIZERS_PARALLELISM",
        "PYTHONPATH",
        "SLUICE_FAULTS",  # storage/faults.py: fault points armed by the failure tests
    )
    # Storage credentials are not among them: they travel as constructor arguments
    # (storage.urls.Credentials), since Ray logs runtime environments.
    return {k: os.environ[k] for k in keys if k in os.environ}


def on_driver_node() -> NodeAffinitySchedulingStrategy:
    """Where the control-plane actors go: the driver's node, and nowhere else.

    They hold the run's state (queued groups, stored trajectories, the published weights).
    On a cluster the driver runs on the head (on-demand capacity), which the run cannot
    lose and go on anyway; on a spot worker node they would share its fate.
    """
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def _thread_env(threads: int, extra: dict[str, str]) -> dict[str, Any]:
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **extra}
    return {"env_vars": env}


@ray.remote
class RolloutWorker(RolloutWorkerBase):
    """A rollout worker in its own process; vLLM runs in-process (no engine subprocess)."""


class StoreTraining:
    """What a trainer actor adds to its engine: consuming from the store, publishing weights."""

    def __init__(
        self, params: ParameterService, credentials: Credentials | None = None, **trainer_args: Any
    ) -> None:
        if credentials:
            credentials.apply()  # checkpoints under an s3:// url
        super().__init__(**trainer_args)
        # One publisher handle for the actor's life: it holds the staging buffers and the
        # snapshot in flight, which the next optimiser step must wait for.
        self._params = params
        self.before_update = params.wait_snapshot

    def train_from_store(
        self,
        store: StoreClient,
        count: int,
        max_staleness: int,
        lease_timeout_s: float,
    ) -> dict[str, float]:
        """Lease ``count`` samples, take one step, publish the new version, acknowledge.

        The order is the life of a trajectory (DESIGN.md section 4): the weights are
        published before the lease is acknowledged, so a trained sample always has a
        published version behind it.
        """
        t0 = time.monotonic()
        lease = store.lease(
            count, self.version(), max_staleness, list(TRAIN_FIELDS), timeout_s=lease_timeout_s
        )
        t1 = time.monotonic()
        metrics = self.step_batch(to_train_batch(lease.table, self.pad_id))
        t2 = time.monotonic()
        publish_s = self._params.publish(self.version(), self.state())
        store.ack(lease, self.version())
        return {
            **metrics,
            "samples": float(len(lease.sample_ids)),
            "staleness": sum(lease.staleness) / len(lease.staleness),
            "staleness_max": float(max(lease.staleness)),
            **{f"staleness_count/{k}": float(n) for k, n in Counter(lease.staleness).items()},
            "lease_s": t1 - t0,
            "step_s": t2 - t1,
            "publish_s": publish_s,
        }

    def restore(self, files: dict[str, bytes], meta: dict[str, Any]) -> int:
        """Load a checkpoint and publish its weights, so rollout workers can pull them."""
        self.load_checkpoint(files, meta)
        self._params.publish(self.version(), self.state())
        self._params.wait_snapshot()
        return self.version()

    def pid(self) -> int:
        return os.getpid()

    def save_checkpoint(self, url: str, keep_last: int, step: int, meta: dict[str, Any]) -> str:
        """Write an atomic checkpoint of the trainer's state; returns its URL."""
        files, counters = self.checkpoint_files()
        return CheckpointStore(url, keep_last).save(step, files, {**meta, **counters})


@ray.remote
class TrainerActor(StoreTraining, TorchTrainer):
    """The torch trainer in its own process."""


def launch_rollout_workers(
    count: int,
    cpus: float,
    threads: int,
    env_vars: dict[str, str],
    max_restarts: int = 0,
    resources: dict[str, float] | None = None,
    **engine_args: Any,
) -> list[Any]:
    """``count`` rollout actors; each asks for ``cpus`` CPU slots and the custom Ray
    ``resources`` (``rollout.resources``), so it lands only on a node that offers them."""
    extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env_vars}
    return [
        RolloutWorker.options(  # type: ignore[attr-defined]
            num_cpus=cpus,
            resources=resources or None,
            runtime_env=_thread_env(threads, extra),
            max_restarts=max_restarts,
        ).remote(
            threads=threads,
            credentials=Credentials.here(),
            **{**engine_args, "seed": engine_args["seed"] + i},
        )
        for i in range(count)
    ]


def launch_trainer(
    cpus: float,
    threads: int,
    env_vars: dict[str, str],
    engine: str = "torch",
    zero_stage: int = 2,
    resources: dict[str, float] | None = None,
    **trainer_args: Any,
) -> Any:
    """The trainer actor of ``engine`` (torch, or DeepSpeed ZeRO at ``zero_stage``), on a node
    that offers ``cpus`` and ``resources`` (``train.resources``)."""
    actor: Any = TrainerActor
    if engine == "deepspeed":
        # Imported here: only a DeepSpeed run should pay for importing DeepSpeed.
        from sluice.engines.deepspeed_actor import DeepSpeedTrainerActor

        actor, trainer_args = DeepSpeedTrainerActor, {**trainer_args, "zero_stage": zero_stage}
    elif engine != "torch":
        raise ValueError(f"unknown training engine {engine!r}; allowed: torch, deepspeed")
    return actor.options(
        num_cpus=cpus, resources=resources or None, runtime_env=_thread_env(threads, env_vars)
    ).remote(threads=threads, credentials=Credentials.here(), **trainer_args)
