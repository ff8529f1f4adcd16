"""Where a run's Ray comes from: an existing cluster (``RAY_ADDRESS``) or a local one.

Driven by the flows' start-up (``tasks/job.py: start_ray``, ``flows/evaluate.py``). With
``RAY_ADDRESS`` set (``sluice run --address`` sets it) the driver joins that cluster as it
is: no temp dir, CPU count or resources of its own; the nodes decide those. The actors'
code is imported on the nodes from their own install (on a cluster built by
infra/terraform, the pip packages of its boot scripts; in the tests here, this checkout,
which every node on the machine shares through ``PYTHONPATH``). Without it, a local Ray
starts, sized for the pools and offering the custom resources they ask for, so a config
written for a cluster (``rollout.resources``, ``train.resources``) also runs on one machine.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger("sluice")

# `ray://host:port` (the Ray client server, 10001 on the head) or `host:port` (the GCS,
# 6379; the driver then needs a Ray node of the cluster on its own machine), or `auto`
# (the cluster this machine is a node of).
_ADDRESS = re.compile(r"^(ray://)?[A-Za-z0-9._-]+:(\d{1,5})$")
# Ray 2.60's client proxy forks one server per driver, and that child now and then dies at
# start on a busy machine (a gRPC thread crashes after the fork; seen 2 times in ~20 here):
# the connection fails with ConnectionAbortedError, and connecting again forks a new one.
CLIENT_CONNECT_ATTEMPTS = 3


def check_address(address: str) -> str:
    """``address`` if Ray can connect to it; a ValueError naming the allowed forms if not."""
    found = _ADDRESS.match(address)
    if address != "auto" and not (found and 0 < int(found.group(2)) < 65536):
        raise ValueError(
            f"Ray address {address!r} is none of ray://HOST:PORT (the Ray client server, "
            "port 10001 on the head), HOST:PORT (the head's GCS, port 6379) or auto"
        )
    return address


def summed(*asks: tuple[int, dict[str, float]]) -> dict[str, float]:
    """The custom resources of ``count`` actors asking for ``resources`` each, added up."""
    total: dict[str, float] = {}
    for count, resources in asks:
        for name, amount in resources.items():
            total[name] = total.get(name, 0.0) + count * amount
    return total


def start(cpus: float, resources: dict[str, float], temp_dir: Path) -> None:
    """Join the cluster at ``RAY_ADDRESS``, or start a local Ray with ``cpus`` CPU slots
    and ``resources``. On a cluster, warns about resources no node offers (yet); a local
    one warns when ``RAY_AUTH_MODE`` turns off Ray's token authentication, all that guards
    its sockets (they listen on every interface)."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        _join(check_address(address))
        offered = ray.cluster_resources()
        log.info(
            "joined the Ray cluster at %s: %d node(s), %s",
            address,
            len([n for n in ray.nodes() if n["Alive"]]),
            ", ".join(f"{k} {v:g}" for k, v in sorted(offered.items()) if "node:" not in k),
        )
        for name, amount in sorted(resources.items()):
            if offered.get(name, 0.0) < amount:
                log.warning(
                    "the cluster offers %g of Ray resource %r, the pools ask for %g: the "
                    "actors that need it wait until nodes offering it join",
                    offered.get(name, 0.0),
                    name,
                    amount,
                )
        return
    auth = os.environ.get("RAY_AUTH_MODE", "token")
    if auth.lower() != "token":
        log.warning(
            "RAY_AUTH_MODE=%s: the single-machine Ray cluster starts without token "
            "authentication, and Ray 2.60 listens on every interface (docs/operating.md): "
            "anyone who can reach this machine can run code in this run; unset it to keep "
            "Ray's default (token)",
            auth,
        )
    ray.init(
        num_cpus=max(math.ceil(cpus - 1e-9), 1),
        resources=resources or None,
        include_dashboard=False,  # when an operator turns it on: dashboard_host=127.0.0.1
        _temp_dir=str(temp_dir),
        log_to_driver=False,
        configure_logging=False,
    )


def _join(address: str, init: Callable[..., Any] = ray.init) -> None:
    """``init`` (Ray's) the cluster at ``address``; a ``ray://`` connection is tried up to
    CLIENT_CONNECT_ATTEMPTS times."""
    attempts = CLIENT_CONNECT_ATTEMPTS if address.startswith("ray://") else 1
    for attempt in range(1, attempts + 1):
        try:
            init(address=address, log_to_driver=False, configure_logging=False)
            return
        except ConnectionAbortedError as error:
            if attempt == attempts:
                raise
            log.warning("Ray client connection to %s failed (%s); connecting again", address, error)


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
        "SLUICE_FAULTS_DIR",
    )
    # Storage credentials are not among them: they travel as constructor arguments
    # (storage.urls.Credentials), since Ray logs runtime environments.
    return {k: os.environ[k] for k in keys if k in os.environ}


def thread_env(threads: int, extra: dict[str, str], gpus: float = 0.0) -> dict[str, Any]:
    """An actor's runtime environment: ``threads`` BLAS/OpenMP threads (Ray sets
    OMP_NUM_THREADS=1 in actors; the actor sets torch's to match), plus ``extra``.

    An actor that holds no GPU sees none: Ray 2.60 leaves ``CUDA_VISIBLE_DEVICES`` alone
    for actors with ``num_gpus=0``, so on a GPU node it would open the GPUs of others.
    """
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **extra}
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return {"env_vars": env}


def pool_dtype(dtype: str, gpus: float) -> str:
    """A pool's precision: ``dtype``, or for ``auto`` bfloat16 when its actors hold GPUs
    and float32 when they run on CPUs."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if gpus else "float32"


def visible_gpus() -> str:
    """The GPUs this process sees (``CUDA_VISIBLE_DEVICES``, which Ray sets for an actor
    holding GPUs), or ``cpu``."""
    return os.environ.get("CUDA_VISIBLE_DEVICES") or "cpu"


def gpus_each(asked: float | None, ranks: int = 1) -> float:
    """The GPUs an actor asks Ray for: ``asked``, or when unset ``ranks`` (its processes
    that each take a GPU: a tensor-parallel engine's ranks) if the Ray cluster has GPUs and
    0 if it has none (Ray then sets the actor's ``CUDA_VISIBLE_DEVICES``)."""
    if asked is not None:
        return asked
    return float(ranks) if ray.cluster_resources().get("GPU", 0.0) > 0 else 0.0


def on_driver_node() -> NodeAffinitySchedulingStrategy:
    """Where the control-plane actors go: the driver's node, and nowhere else.

    They hold the run's state (queued groups, stored trajectories, the published weights).
    On a cluster the driver runs on the head (on-demand capacity), which the run cannot
    lose and go on anyway; on a spot worker node they would share its fate.
    """
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
