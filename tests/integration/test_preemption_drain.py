"""engines/cluster/preemption.py on a real two-node Ray cluster: a spot notice drains the
worker node.

The cluster is what the Terraform user data starts, on one machine
(``tests/support/ray_nodes.py``): ``ray start --head --block`` and ``ray start --block
--address ... --node-name ... --resources '{"rollout": 1}'``, with token authentication
(Ray 2.60's default) from a token file of the test's own. The watcher runs as its own
process (``python -m sluice.engines.cluster.preemption``), as the systemd unit runs it; only
the metadata service is a stand-in (tests/support/fake_imds.py). Every Ray call of the test
runs in a child process with the cluster's auth settings, so this test process's own Ray
state (other tests' local ``ray.init``) stays out of it.

Ray maps ``--node-ip-address 127.0.0.1`` to the machine's own address (it wants a reachable
one for multi-node clusters), so the nodes report that address; both still run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.support.fake_imds import running_imds
from tests.support.ray_nodes import NODES_SCRIPT, REPO, RayNodes

pytestmark = pytest.mark.integration

WORKER_NAME = "i-0spotworker0test"
# How long the test waits for the drained node's raylet to exit once the node is idle.
EXIT_TIMEOUT_S = 60.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RayNodes]:
    nodes = RayNodes(tmp_path)
    try:
        nodes.start("head", cpus=1)
        nodes.start(WORKER_NAME, cpus=1, resources={"rollout": 1})
        joined = nodes.wait_state([WORKER_NAME], state=0)
        assert joined[WORKER_NAME]["resources"]["rollout"] == 1.0
        yield nodes
    finally:
        nodes.close()


def test_spot_notice_drains_the_worker_and_it_leaves_once_its_work_is_gone(
    cluster: RayNodes, tmp_path: Path
) -> None:
    # A rollout actor on the spot worker, placed by the resource the worker advertises.
    placed = cluster.script("""
        import ray
        ray.init(address=GCS, namespace="drain", logging_level="ERROR", log_to_driver=False)

        @ray.remote(num_cpus=0, resources={"rollout": 1})
        class Rollout:
            def node(self):
                return ray.get_runtime_context().get_node_id()

        actor = Rollout.options(name="rollout-0", lifetime="detached").remote()
        print(json.dumps({"node": ray.get(actor.node.remote(), timeout=60)}))
    """)
    before = cluster.node_states()
    assert placed["node"] == before[WORKER_NAME]["id"]

    # EC2 posts the notice; the watcher, run as the systemd unit runs it, drains the node.
    notice_time = (datetime.now(UTC) + timedelta(minutes=2)).replace(microsecond=0)
    with running_imds() as imds:
        imds.notice = json.dumps(
            {"action": "terminate", "time": notice_time.strftime("%Y-%m-%dT%H:%M:%SZ")}
        ).encode()
        watcher = subprocess.run(
            [
                *(sys.executable, "-m", "sluice.engines.cluster.preemption"),
                *("--gcs-address", cluster.gcs_address, "--node-name", WORKER_NAME),
                *("--imds-url", imds.url, "--poll-interval", "0.2"),
            ],
            env=cluster.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert watcher.returncode == 0, watcher.stderr[-3000:]
    assert f"draining Ray node {placed['node']}" in watcher.stderr

    # While the actor still runs there, the node is alive but draining, with the notice's
    # time as its deadline: what a pool reads to hand the actor's work back.
    draining = cluster.script("""
        from ray._raylet import GcsClient
        gcs = GcsClient(address=GCS)
        print(json.dumps(gcs.get_draining_nodes(timeout=10)))
    """)
    assert draining == {placed["node"]: int(notice_time.timestamp() * 1000)}
    during = cluster.node_states()
    assert during[WORKER_NAME]["state"] == 0

    # The work is handed back (the actor ends); the idle, draining node then leaves, recorded
    # as preempted by the drain rather than as a crash.
    after = cluster.script(
        NODES_SCRIPT
        + f"""
import ray
ray.init(address=GCS, namespace="drain", logging_level="ERROR", log_to_driver=False)
ray.kill(ray.get_actor("rollout-0"))
deadline = time.monotonic() + {EXIT_TIMEOUT_S}
while time.monotonic() < deadline and nodes()[{WORKER_NAME!r}]["state"] == 0:
    time.sleep(0.5)
print(json.dumps(nodes()))
""",
        timeout_s=EXIT_TIMEOUT_S + 60,
    )
    worker = after[WORKER_NAME]
    assert worker["state"] == 1, f"worker still alive after its work ended: {worker}"
    from ray.core.generated import common_pb2

    assert worker["death"] == common_pb2.NodeDeathInfo.Reason.Value("AUTOSCALER_DRAIN_PREEMPTED")
    assert "spot interruption notice: terminate at" in worker["death_message"]
    # The head is untouched.
    head = next(node for name, node in after.items() if name != WORKER_NAME)
    assert head["state"] == 0
