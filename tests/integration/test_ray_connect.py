"""engines/cluster/ray_cluster.py against real Ray: a local Ray sized for the pools and offering
their resources, and joining an existing two-node cluster (tests/support/ray_nodes.py) by its GCS
address and through its Ray client server (``ray://``). Each driver runs in a child process,
so this test process's own Ray (other tests' ``ray.init``) stays out of it.

In every case the control-plane actors' placement
(``engines.cluster.ray_cluster.on_driver_node``) puts an actor on the driver's node: the
head, for a driver that joined by address (Ray picks the head among nodes on the driver's
machine), or the node of the client server (the head).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ray_nodes import REPO, RayNodes

pytestmark = pytest.mark.integration

DRIVER = """
import json, logging, sys
from pathlib import Path
import ray
from sluice.engines.cluster import ray_cluster
from sluice.engines.cluster.ray_cluster import on_driver_node

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

@ray.remote(num_cpus=0)
class Where:
    def node(self):
        return ray.get_runtime_context().get_node_id()

ray_cluster.start(3, {"rollout": 2.0, "trainer": 1.0}, Path(sys.argv[1]))
actor = Where.options(scheduling_strategy=on_driver_node()).remote()
print(json.dumps({
    "resources": {k: v for k, v in ray.cluster_resources().items() if "node:" not in k},
    "driver_node": ray.get_runtime_context().get_node_id(),
    "actor_node": ray.get(actor.node.remote(), timeout=120),
}))
ray.shutdown()
"""


def _drive(env: dict[str, str]) -> tuple[dict, str]:
    """Run DRIVER in a child Python; returns (its JSON line, its whole output)."""
    with tempfile.TemporaryDirectory(prefix="sluice-ray-", dir="/tmp") as temp:
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, temp],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout


def test_a_local_ray_offers_the_cpus_and_resources_the_pools_ask_for(tmp_path: Path) -> None:
    env = {k: v for k, v in RayNodes.clean_env().items() if k != "RAY_ADDRESS"}
    found, _ = _drive(env)
    assert found["resources"]["CPU"] == 3.0
    assert found["resources"]["rollout"] == 2.0 and found["resources"]["trainer"] == 1.0
    assert found["actor_node"] == found["driver_node"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayNodes]:
    nodes = RayNodes(tmp_path_factory.mktemp("ray-connect"))
    try:
        nodes.start("head", cpus=1)
        nodes.start("rollout-a", cpus=1, resources={"rollout": 1})
        nodes.wait_state(["head", "rollout-a"], state=0)
        yield nodes
    finally:
        nodes.close()


@pytest.mark.parametrize("how", ["gcs", "client"])
def test_joining_an_existing_cluster_uses_its_nodes_as_they_are(
    two_nodes: RayNodes, how: str
) -> None:
    address = two_nodes.gcs_address if how == "gcs" else two_nodes.client_address
    found, out = _drive({**two_nodes.env, "RAY_ADDRESS": address})
    # The cluster's own CPUs and resources, not the 3 CPUs the pools would ask a local Ray for.
    assert found["resources"]["CPU"] == 2.0 and found["resources"]["rollout"] == 1.0
    assert "trainer" not in found["resources"]
    assert f"joined the Ray cluster at {address}: 2 node(s)" in out
    assert "offers 1 of Ray resource 'rollout', the pools ask for 2" in out
    assert "offers 0 of Ray resource 'trainer', the pools ask for 1" in out
    head = two_nodes.node_states()["head"]["id"]
    assert found["driver_node"] == head and found["actor_node"] == head
