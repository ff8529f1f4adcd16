"""The three modes in one place: ``schedule`` is the one reader of the config's ``mode``, and
``batch_step`` and ``stream_step`` are what a step does in each (the flow's ``rl_step`` calls
one of them).

- ``sync``: one batch a step, split over every rollout worker. The batch of step i+1 starts
  once every worker holds version i: each sample trains the weights that generated it.
- ``one_step``: the same batches, but the batch of step i+1 starts before the trainer
  trains step i, so generation overlaps training and every sample is one version old.
- ``async``: every worker streams prompt groups from the dispatcher and pulls new weights
  when it chooses; a step leases the groups that are ready, none more than
  ``max_staleness`` versions old (``stale_by`` says how a sample's age is counted).

Either way a step's training is the same: lease a batch, train on it (the trainer publishes
the new version before it answers), acknowledge (``Session.train``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ray.exceptions import RayActorError

from sluice.config.tree import RunConfig
from sluice.driver.batch import BatchRollouts
from sluice.driver.step_log import StepTimes
from sluice.driver.stream import StreamRollouts
from sluice.engines.rollout.worker import RolloutWorkerClient

# Trains step i on a batch leased from the store: the trainer's metrics, and when the lease
# was granted (``Session.train``).
TrainStep = Callable[[int], tuple[dict[str, float], float]]


@dataclass(frozen=True)
class Schedule:
    """What the mode decides, read from the config in one place (``schedule``)."""

    max_staleness: int  # versions a trained sample may lag the trainer
    streaming: bool  # async: workers stream; else one batch a step
    overlap: bool  # one_step: the next batch generates while this one trains
    min_workers: int  # rollout workers a run waits for before it starts (async: 1)


def schedule(cfg: RunConfig) -> Schedule:
    """The one place that reads ``mode``."""
    workers = cfg.rollout.workers
    return {
        "sync": Schedule(0, streaming=False, overlap=False, min_workers=workers),
        "one_step": Schedule(1, streaming=False, overlap=True, min_workers=workers),
        "async": Schedule(cfg.max_staleness, streaming=True, overlap=False, min_workers=1),
    }[cfg.mode]


def batch_step(
    batch: BatchRollouts, step: int, last: int, overlap: bool, train: TrainStep
) -> tuple[dict[str, float], StepTimes]:
    """``sync`` and ``one_step``: step ``step`` of ``last`` on the batch generated for it."""
    start = time.monotonic()
    batch.collect()  # this step's groups are scored and in the store
    if overlap and step < last:
        batch.generate(step + 1)  # one_step: on the weights it has, while this one trains
    generated = time.monotonic()
    trained, leased = train(step)  # publishes version `step`
    done = time.monotonic()
    batch.load(step)  # every worker holds version `step` (one_step: after its generation)
    if not overlap and step < last:
        batch.generate(step + 1)  # sync: on version `step`
    return trained, StepTimes(start, generated, leased, done, time.monotonic())


def stream_step(
    stream: StreamRollouts, step: int, train: TrainStep
) -> tuple[dict[str, float], StepTimes]:
    """``async``: step ``step`` on whatever the streams put in the store; the lease waits
    for enough groups young enough."""
    start = time.monotonic()
    stream.check()  # a dead worker's groups go back to the queue; its stream starts again
    checked = time.monotonic()
    trained, leased = train(step)  # publishes version `step`; workers pull it when they choose
    done = time.monotonic()
    return trained, StepTimes(start, checked, leased, done, done)


class Rollouts(Protocol):
    """What a session does with either mode's rollouts (``BatchRollouts``,
    ``StreamRollouts``)."""

    def start(self) -> None:
        """Start generating (after the pools opened, and the step-0 checkpoint)."""

    def drain(self, step: int, dropped_groups: int) -> dict[str, float]:
        """Rollout metrics since the last step; ``dropped_groups`` the store dropped."""

    def live(self) -> list[RolloutWorkerClient]:
        """The workers that answer now (held-out evaluation runs on them)."""

    def died_loading(self, worker: RolloutWorkerClient, step: int, error: RayActorError) -> None:
        """``worker`` died loading version ``step`` outside any rollout call (held-out
        evaluation, a resume): Ray restarts it."""

    def cursor(self) -> dict[str, Any]:
        """Where the prompt stream stands, for a checkpoint."""

    def restore(self, cursor: dict[str, Any], step: int, held_groups: int) -> None:
        """Continue from a checkpoint's ``cursor`` at ``step``; the restored store re-offers
        ``held_groups`` groups."""
