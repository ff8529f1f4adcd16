"""``wait_placed`` on a real Ray instance: an actor no node has room for."""

from __future__ import annotations

import logging
import os

import pytest

from sluice.engines.placement import PlacementTimeout, wait_placed

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
