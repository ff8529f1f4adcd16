"""Rollout workers that die: each one's deaths counted against ``rollout.max_restarts``, and
the waits for Ray to bring one back. Both ways of driving rollouts use it (``driver/batch.py``,
``driver/stream.py``), and so does held-out evaluation (``driver/held_out.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from sluice.engines.rollout.worker import RolloutWorkerClient

log = logging.getLogger("sluice")

# Waits for Ray refs, restarting dead rollout workers and logging progress meanwhile
# (``Session.wait``).
Waiter = Callable[[Any, str], Any]


# A restarted rollout worker loads vLLM again (~25 s on 2 cores); give up after this.
RESTART_TIMEOUT_S = 300.0


class RolloutFailure(RuntimeError):
    """A rollout worker died more often than ``rollout.max_restarts`` allows."""


class Restarts:
    """Counts each worker's deaths; says what happened, and fails past the limit.

    While Ray restarts a worker, calls to it fail with ``ActorUnavailableError``; ``back``
    probes it without blocking, ``wait_back`` blocks until it answers.
    """

    def __init__(self, workers: list[RolloutWorkerClient], limit: int) -> None:
        self.workers = workers
        self.counts = [0] * len(workers)
        self.limit = limit
        self._probes: dict[int, tuple[Any, Any]] = {}

    def back(self, worker: int) -> bool:
        """True once the restarted ``worker`` answers; raises if it is dead for good."""
        probe = self._probes.get(worker)
        if probe is None:
            client = self.workers[worker]
            self._probes[worker] = (client.pid(), client.devices())
            return False
        if len(ray.wait(list(probe), num_returns=2, timeout=0)[0]) < 2:
            return False
        del self._probes[worker]
        try:
            pid, devices = ray.get(list(probe))
        except ActorUnavailableError:
            return False  # still restarting: the next call probes again
        except RayActorError as error:
            raise RolloutFailure(
                f"rollout worker {worker} could not be restarted: {error}"
            ) from error
        # A worker Ray places late is not in the session's start-up devices line.
        on = "" if devices == "cpu" else f", CUDA_VISIBLE_DEVICES {devices}"
        log.info("rollout worker %d is up (pid %d%s)", worker, pid, on)
        return True

    def wait_back(self, worker: int, timeout_s: float = RESTART_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.back(worker):
            if time.monotonic() > deadline:
                raise RolloutFailure(
                    f"rollout worker {worker} did not come back within {timeout_s:g} s"
                )
            time.sleep(0.2)

    def died(self, worker: int, error: BaseException, handed_back: str) -> None:
        self.counts[worker] += 1
        if self.counts[worker] > self.limit:
            raise RolloutFailure(
                f"rollout worker {worker} died {self.counts[worker]} times, more than "
                f"rollout.max_restarts={self.limit}: {type(error).__name__}"
            ) from error
        cause = getattr(error, "cause", None)  # a RayTaskError: what the worker raised
        log.warning(
            "rollout worker %d died (%s); %s; Ray restarts it (restart %d of at most %d)",
            worker,
            type(error).__name__ + (f": {cause}"[:300] if cause is not None else ""),
            handed_back,
            self.counts[worker],
            self.limit,
        )
