"""The judge's or reward model's Ray actors: launched by the session (``driver/session.py``)
beside the rollout workers with resources of their own, each holding one engine
(``judge.py``, ``classifier.py``); rollout workers and the driver's evaluation send them
groups through a ``ModelScorer`` (``scorer.py``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from sluice.config.tree import JudgeConfig, RewardModelConfig
from sluice.engines.cluster.ray_cluster import thread_env
from sluice.engines.reward_models.classifier import ClassifierEngine
from sluice.engines.reward_models.judge import Answer, JudgeEngine

log = logging.getLogger(__name__)
# Ray restarts an actor whose process died (out of memory, killed) this many times; the
# groups it held fail with the reason, the next ones reach the restarted actor.
MAX_RESTARTS = 3
# How long the actors may take to load their model before the run stops with the reason.
LOAD_TIMEOUT_S = 900.0


def kind_of(cfg: JudgeConfig | RewardModelConfig) -> str:
    """``judge`` or ``reward model``, as messages name it."""
    return "judge" if isinstance(cfg, JudgeConfig) else "reward model"


@ray.remote
class ServedModelActor:
    """One engine; ``score`` answers a list of texts (a question each for a judge)."""

    def __init__(self, build: Callable[[], Callable[[list[str]], list[Answer]]], threads: int):
        import os

        import torch

        torch.set_num_threads(threads)
        self._engine = build()
        self._pid = os.getpid()

    def score(self, texts: list[str]) -> tuple[list[Answer], float]:
        """The answers, and the seconds the engine took for them (queueing left out)."""
        start = time.perf_counter()
        answers = self._engine(texts)
        return answers, time.perf_counter() - start

    def pid(self) -> int:
        return self._pid


def engine_of(cfg: JudgeConfig | RewardModelConfig, seed: int) -> Callable[[], Any]:
    """What an actor builds its engine with (picklable)."""
    if isinstance(cfg, JudgeConfig):
        return partial(
            JudgeEngine, cfg.model, seed, cfg.max_new_tokens, cfg.kv_cache_gib, cfg.max_model_len
        )
    return partial(ClassifierEngine, cfg.model, cfg.max_length, cfg.batch_size)


@dataclass
class ServedModels:
    """The actors serving one judge or reward model; picklable (handles only)."""

    cfg: JudgeConfig | RewardModelConfig
    handles: list[Any]

    @property
    def kind(self) -> str:
        return kind_of(self.cfg)

    def wait_loaded(self, timeout_s: float = LOAD_TIMEOUT_S) -> None:
        """Return once every actor has loaded its model; ``RuntimeError`` with the reason
        when one cannot, or not within ``timeout_s``."""
        start = time.monotonic()
        log.info("loading the %s %s in %d actor(s)", self.kind, self.cfg.model, len(self.handles))
        try:
            pids = ray.get([h.pid.remote() for h in self.handles], timeout=timeout_s)
        except GetTimeoutError:
            raise RuntimeError(
                f"the {self.kind} {self.cfg.model} did not load within {timeout_s:.0f} s: are "
                "its actors placed (reward.*.cpus_per_worker, gpus_per_worker)?"
            ) from None
        except RayActorError as error:
            raise RuntimeError(
                f"the {self.kind} {self.cfg.model} failed to load: {error}"
            ) from None
        log.info(
            "the %s is served by pid(s) %s (loaded in %.0f s)",
            self.kind,
            ", ".join(map(str, pids)),
            time.monotonic() - start,
        )

    def close(self) -> None:
        for handle in self.handles:
            ray.kill(handle, no_restart=True)
        self.handles = []


def launch_served(
    cfg: JudgeConfig | RewardModelConfig, seed: int, env_vars: dict[str, str]
) -> ServedModels:
    """``cfg.workers`` actors, each asking Ray for ``cpus_per_worker`` CPU slots and
    ``gpus_per_worker`` GPUs; they load their model in the background. A relative folder is
    this process's (an actor's working folder is Ray's)."""
    cfg = cfg.model_copy(update={"model": str(Path(cfg.model).expanduser().resolve())})
    extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env_vars}  # vLLM inside the actor
    handles = [
        ServedModelActor.options(  # type: ignore[attr-defined]
            num_cpus=cfg.cpus_per_worker,
            num_gpus=cfg.gpus_per_worker,
            runtime_env=thread_env(cfg.threads_per_worker, extra, cfg.gpus_per_worker),
            max_restarts=MAX_RESTARTS,
        ).remote(engine_of(cfg, seed + i), cfg.threads_per_worker)
        for i in range(cfg.workers)
    ]
    return ServedModels(cfg, handles)
