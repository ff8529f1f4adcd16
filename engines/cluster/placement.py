"""Waiting for the pools' actors to be placed on the Ray cluster and started, with progress
and a limit.

``Session.open`` (``driver/session.py``) creates the trainer and the rollout workers, then
calls ``wait_placed``. An actor that asks for resources no live node has free (a cluster
that lost a node and has not regrown, a spot group still booting) stays pending in Ray
forever; without this the flow would hang without a word. ``wait_placed`` logs, apart,
the actors Ray has given a process that are still starting (a rollout worker loads vLLM)
and those still waiting for room, with what they ask for and what the cluster has free;
it returns once the actors the mode cannot start without answer, and raises
``PlacementTimeout`` naming them, and which of the two they are, when
``rollout.placement_timeout_s`` passes first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray._private.state import actors as gcs_actors

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


def _has_process(actor: Any) -> bool:
    """Whether Ray has given ``actor`` a process, which may still be in its constructor: the
    GCS's actor table names its pid once it has (Ray's own table; False when unreadable)."""
    try:
        return bool(gcs_actors(actor._actor_id.hex()).get("Pid"))
    except Exception:  # a private table: a Ray that changed it only loses the distinction
        return False


def _split(actors: Mapping[str, Any], names: list[str]) -> tuple[list[str], list[str]]:
    """``names`` as (starting: given a process, waiting for room)."""
    starting = [name for name in names if _has_process(actors[name])]
    return starting, [name for name in names if name not in starting]


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
        if now - started <= timeout_s and now - last_line < PROGRESS_EVERY_S:
            continue
        starting, waiting = _split(actors, sorted(pending))
        wants = "; ".join(f"{name} asks for {dict(asks[name])}" for name in waiting)
        if now - started > timeout_s:
            if waiting:
                raise PlacementTimeout(
                    f"{', '.join(waiting)} not placed on the Ray cluster within "
                    f"rollout.placement_timeout_s={timeout_s:g} s: {wants}; free on the "
                    f"cluster: {_free()}. Add a node that offers these resources, or lower the "
                    "asks (rollout.cpus_per_worker, rollout.gpus_per_worker, rollout.resources, "
                    "train.cpus, train.gpus_per_rank, train.resources)."
                )
            raise PlacementTimeout(
                f"{', '.join(starting)} placed but not started within "
                f"rollout.placement_timeout_s={timeout_s:g} s: their processes are still in "
                "their constructors (a rollout worker loads vLLM; a machine running more "
                "workers than it has cores and memory for takes the longest). Run fewer "
                "(rollout.workers), or raise rollout.placement_timeout_s."
            )
        last_line = now
        parts = [f"{', '.join(starting)} starting (placed)"] if starting else []
        if waiting:
            parts.append(f"{', '.join(waiting)} waiting for room ({wants}; free: {_free()})")
        log.info("waiting %.0f s for %s", now - started, "; ".join(parts))
    starting, waiting = _split(actors, sorted(pending))
    if starting:
        log.info("%s: still starting; the run hands it work once it is up", ", ".join(starting))
    if waiting:
        log.warning(
            "%s: not placed yet (no node has the resources it asks for free); the run "
            "starts without it and hands it work once Ray places it",
            ", ".join(waiting),
        )
    return pending
