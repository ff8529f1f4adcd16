"""Ray actors that host the engines: rollout workers (vLLM) and the trainer (torch).

Each actor gets a fixed number of Ray CPU slots and sets its own thread count to match,
so that pools never oversubscribe the cores they were given (Ray sets OMP_NUM_THREADS=1
in actors; torch would otherwise guess). The driver only holds handles: weights travel
trainer -> object store -> rollout worker, never through the driver.
"""

from __future__ import annotations

from typing import Any

import ray

from engines.torch_trainer import TorchTrainer
from engines.vllm_rollout import VLLMRolloutEngine


def _thread_env(threads: int, extra: dict[str, str]) -> dict[str, Any]:
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **extra}
    return {"env_vars": env}


@ray.remote
class RolloutWorker(VLLMRolloutEngine):
    """A rollout engine in its own process; vLLM runs in-process (no engine subprocess)."""

    def __init__(self, threads: int, **engine_args: Any) -> None:
        import torch

        torch.set_num_threads(threads)
        super().__init__(**engine_args)


@ray.remote
class TrainerActor(TorchTrainer):
    """The torch trainer in its own process."""


def launch_rollout_workers(
    count: int, cpus: float, threads: int, env_vars: dict[str, str], **engine_args: Any
) -> list[Any]:
    extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env_vars}
    return [
        RolloutWorker.options(  # type: ignore[attr-defined]
            num_cpus=cpus, runtime_env=_thread_env(threads, extra)
        ).remote(threads=threads, **{**engine_args, "seed": engine_args["seed"] + i})
        for i in range(count)
    ]


def launch_trainer(cpus: float, threads: int, env_vars: dict[str, str], **trainer_args: Any) -> Any:
    return TrainerActor.options(  # type: ignore[attr-defined]
        num_cpus=cpus, runtime_env=_thread_env(threads, env_vars)
    ).remote(threads=threads, **trainer_args)
