"""engines/cluster.py: the Ray addresses the CLI accepts, and the local Ray's resources."""

from __future__ import annotations

import pytest

from engines.cluster import check_address, summed


@pytest.mark.parametrize(
    "address", ["ray://localhost:10001", "10.40.1.7:6379", "head.internal:6379", "auto"]
)
def test_addresses_ray_can_connect_to(address):
    assert check_address(address) == address


@pytest.mark.parametrize(
    "address",
    ["localhost", "ray://localhost", "http://10.0.0.1:6379", "10.0.0.1:0", "10.0.0.1:70000", ""],
    ids=["no-port", "client-no-port", "http", "port-zero", "port-too-big", "empty"],
)
def test_other_addresses_are_refused_with_the_forms_allowed(address):
    with pytest.raises(ValueError, match=r"ray://HOST:PORT .*HOST:PORT .*auto"):
        check_address(address)


def test_summed_resources_count_every_actor():
    # two rollout workers asking {rollout: 1} and a trainer asking {trainer: 1, fast: 0.5}
    assert summed((2, {"rollout": 1.0}), (1, {"trainer": 1.0, "fast": 0.5})) == {
        "rollout": 2.0,
        "trainer": 1.0,
        "fast": 0.5,
    }
    assert summed((3, {}), (1, {})) == {}
