"""``wait_placed`` on a real Ray instance: an actor no node has room for."""

from __future__ import annotations

import logging
import os
import time

import pytest

from sluice.engines.cluster.placement import PlacementTimeout, wait_placed

pytestmark = pytest.mark.integration


def test_a_run_starts_without_an_unplaceable_actor_only_when_it_may(ray_local, caplog) -> None:
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Probe:
        def pid(self) -> int:
            return os.getpid()

    placed = Probe.remote()
    stuck = Probe.options(resources={"gpu_node": 1}).remote()  # no node offers it
    actors = {"the trainer": placed, "rollout worker 1": stuck}
    asks = {"the trainer": {"CPU": 0}, "rollout worker 1": {"CPU": 0, "gpu_node": 1}}
    try:
        with caplog.at_level(logging.INFO, logger="sluice"):
            pending = wait_placed(actors, asks, lambda p: "the trainer" not in p, timeout_s=60)
        assert pending == {"rollout worker 1"}
        assert "rollout worker 1: not placed yet" in caplog.text

        with pytest.raises(PlacementTimeout) as failed:
            wait_placed(actors, asks, lambda p: not p, timeout_s=2)
        message = str(failed.value)
        assert message.startswith("rollout worker 1 not placed on the Ray cluster within")
        assert "placement_timeout_s=2 s" in message
        assert "'gpu_node': 1" in message
        assert "free on the cluster: CPU=2" in message
        assert "the trainer" not in message  # it was placed
    finally:
        for actor in actors.values():
            ray.kill(actor)


def test_a_placed_actor_still_in_its_constructor_is_starting_not_unplaced(ray_local) -> None:
    """A worker loading vLLM holds its process long before it answers: the wait says it is
    starting, and a timeout says so too, not that the cluster has no room."""
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Slow:
        def __init__(self, seconds: float) -> None:
            time.sleep(seconds)

        def pid(self) -> int:
            return os.getpid()

    loading = Slow.remote(60)
    actors, asks = {"rollout worker 0": loading}, {"rollout worker 0": {"CPU": 0}}
    try:
        with pytest.raises(PlacementTimeout) as failed:
            wait_placed(actors, asks, lambda p: not p, timeout_s=15)
        message = str(failed.value)
        assert message.startswith("rollout worker 0 placed but not started within")
        assert "rollout.workers" in message
    finally:
        ray.kill(loading)


def test_more_trainer_ranks_than_the_cluster_holds_fail_naming_them(ray_local) -> None:
    from ray.util.placement_group import remove_placement_group

    from sluice.config.tree import TrainConfig
    from sluice.engines.train.pool import launch_trainer

    # Three ranks of one CPU each, on a cluster of two CPUs: the placement group of the
    # ranks is placed whole or not at all, so no rank starts.
    pool = launch_trainer(TrainConfig(ranks=3), "unused", 0, None, {}, gpus=0.0)  # type: ignore[arg-type]
    names = [f"trainer rank {i}" for i in range(3)]
    asks = {name: {"CPU": 1.0} for name in names}
    try:
        with pytest.raises(PlacementTimeout) as failed:
            wait_placed(dict(zip(names, pool.handles, strict=True)), asks, lambda p: not p, 2)
        message = str(failed.value)
        assert message.startswith("trainer rank 0, trainer rank 1, trainer rank 2 not placed")
        assert "trainer rank 0 asks for {'CPU': 1.0}" in message
        assert "free on the cluster: CPU=2" in message  # a group's own bundles not shown
        assert "train.cpus" in message
    finally:
        for handle in pool.handles:
            ray_local.kill(handle)
        assert pool.group is not None
        remove_placement_group(pool.group)
