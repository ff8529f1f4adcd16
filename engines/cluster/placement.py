"""Waiting for the pools' actors to be placed on the Ray cluster, with progress and a limit.

``Session.open`` (``driver/session.py``) creates the trainer and the rollout workers, then
calls ``wait_placed``. An actor that asks for resources no live node has free (a cluster
that lost a node and has not regrown, a spot group still booting) stays pending in Ray
forever; without this the flow would hang without a word. ``wait_placed`` logs what is
still pending, what it asks for and what the cluster has free, returns once the actors the
mode cannot start without answer, and raises ``PlacementTimeout`` naming them when
``rollout.placement_timeout_s`` passes first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray

from sluice.storage.trajectory_store import PROGRESS_EVERY_S

log = logging.getLogger("sluice")

# How often the wait checks the actors (it says what it still waits for every
# PROGRESS_EVERY_S, as every other wait does).
POLL_S = 1.0


class PlacementTimeout(RuntimeError):
    """Actors the run needs were not placed on the cluster in time."""


def _free() -> str:
    """CPUs, GPUs and custom resources free now (not memory, not Ray's per-node labels,
    not the resources a placement group holds for its own actors)."""
    free = sorted(ray.available_resources().items())
    hidden = ("memory", "object_store_memory")
    shown = [
        f"{k}={round(v, 2):g}"
        for k, v in free
        if k not in hidden and ":" not in k and not k.startswith("bundle_group_")
    ]
    return ", ".join(shown) or "nothing"


def wait_placed(
    actors: Mapping[str, Any],
    asks: Mapping[str, Mapping[str, float]],
    enough: Callable[[set[str]], bool],
    timeout_s: float,
) -> set[str]:
    """Wait until ``enough(pending)`` holds; return the names still pending then.

    ``actors``: name -> actor handle (each has a ``pid`` method); ``asks``: name -> the
    resources it asked Ray for (for the messages); ``enough``: whether the run can start
    with the actors in ``pending`` still unplaced (the caller treats those as on their way).
    """
    probes = {name: actor.pid.remote() for name, actor in actors.items()}
    started = last_line = time.monotonic()
    pending = set(actors)
    while True:
        ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=POLL_S)
        for name, ref in list(probes.items()):
            if ref in ready:
                ray.get(ref)  # an actor whose constructor raised: surface it here
                pending.discard(name)
                del probes[name]
        if enough(pending):
            break
        now = time.monotonic()
        waiting = sorted(pending)
        wants = "; ".join(f"{name} asks for {dict(asks[name])}" for name in waiting)
        if now - started > timeout_s:
            raise PlacementTimeout(
                f"{', '.join(waiting)} not placed on the Ray cluster within "
                f"rollout.placement_timeout_s={timeout_s:g} s: {wants}; free on the cluster: "
                f"{_free()}. Add a node that offers these resources, or lower the asks "
                "(rollout.cpus_per_worker, rollout.gpus_per_worker, rollout.resources, train.cpus, "
                "train.gpus_per_rank, train.resources)."
            )
        if now - last_line >= PROGRESS_EVERY_S:
            last_line = now
            log.info(
                "waiting %.0f s for Ray to place %s (%s; free on the cluster: %s)",
                now - started,
                ", ".join(waiting),
                wants,
                _free(),
            )
    if pending:
        log.warning(
            "%s: not placed yet (no node has the resources it asks for free); the run "
            "starts without it and hands it work once Ray places it",
            ", ".join(sorted(pending)),
        )
    return pending
