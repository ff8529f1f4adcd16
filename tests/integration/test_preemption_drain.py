"""engines/preemption.py on a real two-node Ray cluster: a spot notice drains the worker node.

The cluster is what the Terraform user data starts, on one machine: ``ray start --head --block``
and ``ray start --block --address ... --node-name ... --resources '{"rollout": 1}'``, with
token authentication (Ray 2.60's default) from a token file of the test's own. The watcher
runs as its own process (``python -m engines.preemption``), as the systemd unit runs it; only
the metadata service is a stand-in (tests/support/fake_imds.py). Every Ray call of the test
runs in a child process with the cluster's auth settings, so this test process's own Ray
state (other tests' local ``ray.init``) stays out of it.

Ray maps ``--node-ip-address 127.0.0.1`` to the machine's own address (it wants a reachable
one for multi-node clusters), so the nodes report that address; both still run here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.support.fake_imds import running_imds

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RAY_CLI = Path(sys.executable).with_name("ray")
WORKER_NAME = "i-0spotworker0test"
# A node joins in ~15 s on a busy 2-core machine; leave room for a loaded CI box.
JOIN_TIMEOUT_S = 120.0
# How long the test waits for the drained node's raylet to exit once the node is idle.
EXIT_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_flags() -> list[str]:
    """Free ports for every fixed-port service, so the test cannot collide with another
    Ray on this shared machine (the defaults are fixed numbers like 10001 and 52365)."""
    flags = []
    for flag in (
        "--ray-client-server-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
        "--node-manager-port",
        "--object-manager-port",
    ):
        flags += [flag, str(_free_port())]
    return flags


@dataclass
class Cluster:
    gcs_address: str
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]]

    def ray_script(self, body: str, timeout_s: float = 120.0) -> Any:
        """Run ``body`` in a child Python with the cluster's auth settings; it must print one
        JSON line last, which is returned."""
        prelude = f"import json, time\nGCS = {self.gcs_address!r}\n"
        done = subprocess.run(
            [sys.executable, "-c", prelude + textwrap.dedent(body)],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"child failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        # Its own session, so that teardown can end the node's whole process group by id.
        return subprocess.Popen(
            [str(RAY_CLI), "start", "--block", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM ``ray start --block`` (it stops its own raylet, GCS, agents), then make sure."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    # Children that outlived their parent are still in its process group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


NODES_SCRIPT = """
from ray._raylet import GcsClient
gcs = GcsClient(address=GCS)
def nodes():
    return {
        info.node_name: {
            "id": node_id.hex(),
            "state": info.state,
            "death": info.death_info.reason,
            "death_message": info.death_info.reason_message,
            "resources": dict(info.resources_total),
        }
        for node_id, info in gcs.get_all_node_info(timeout=10).items()
    }
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    # Ray's socket paths sit ~60 characters under its temp dir and may not exceed 107 bytes,
    # so the temp dir is a short one in /tmp rather than pytest's deep tmp_path.
    ray_tmp = Path(tempfile.mkdtemp(prefix="sluice-drain-", dir="/tmp"))
    token = tmp_path / "ray-auth-token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    # Nothing of the test process's own Ray (an address, a token) may leak into the cluster.
    inherited = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env = {
        **inherited,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
        # Teardown only: Ray's own SIGTERM drain would wait up to 30 s per node.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        "PYTHONPATH": str(REPO),
    }
    port = _free_port()
    gcs_address = f"127.0.0.1:{port}"
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--num-gpus", "0"]
    procs = []
    try:
        procs.append(
            _start(
                [
                    *("--head", "--port", str(port), "--include-dashboard", "false"),
                    *("--temp-dir", str(ray_tmp), "--disable-usage-stats"),
                    *common,
                    *_port_flags(),
                ],
                env,
                tmp_path / "head.log",
            )
        )
        procs.append(
            _start(
                [
                    *("--address", gcs_address, "--node-name", WORKER_NAME),
                    *("--resources", json.dumps({"rollout": 1}), "--disable-usage-stats"),
                    *common,
                    *_port_flags(),
                ],
                env,
                tmp_path / "worker.log",
            )
        )
        result = Cluster(gcs_address, env, procs)
        joined = result.ray_script(
            NODES_SCRIPT
            + f"""
deadline = time.monotonic() + {JOIN_TIMEOUT_S}
while time.monotonic() < deadline:
    try:
        found = nodes()
    except Exception:
        found = {{}}
    if found.get({WORKER_NAME!r}, {{}}).get("state") == 0:
        break
    time.sleep(0.5)
print(json.dumps(found))
""",
            timeout_s=JOIN_TIMEOUT_S + 30,
        )
        worker = joined.get(WORKER_NAME)
        assert worker is not None and worker["state"] == 0, (
            f"worker never joined: {joined}\n{(tmp_path / 'worker.log').read_text()[-3000:]}"
        )
        assert worker["resources"]["rollout"] == 1.0
        yield result
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_spot_notice_drains_the_worker_and_it_leaves_once_its_work_is_gone(
    cluster: Cluster, tmp_path: Path
) -> None:
    # A rollout actor on the spot worker, placed by the resource the worker advertises.
    placed = cluster.ray_script("""
        import ray
        ray.init(address=GCS, namespace="drain", logging_level="ERROR", log_to_driver=False)

        @ray.remote(num_cpus=0, resources={"rollout": 1})
        class Rollout:
            def node(self):
                return ray.get_runtime_context().get_node_id()

        actor = Rollout.options(name="rollout-0", lifetime="detached").remote()
        print(json.dumps({"node": ray.get(actor.node.remote(), timeout=60)}))
    """)
    before = cluster.ray_script(NODES_SCRIPT + "print(json.dumps(nodes()))")
    assert placed["node"] == before[WORKER_NAME]["id"]

    # EC2 posts the notice; the watcher, run as the systemd unit runs it, drains the node.
    notice_time = (datetime.now(UTC) + timedelta(minutes=2)).replace(microsecond=0)
    with running_imds() as imds:
        imds.notice = json.dumps(
            {"action": "terminate", "time": notice_time.strftime("%Y-%m-%dT%H:%M:%SZ")}
        ).encode()
        watcher = subprocess.run(
            [
                *(sys.executable, "-m", "engines.preemption"),
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
    draining = cluster.ray_script("""
        from ray._raylet import GcsClient
        gcs = GcsClient(address=GCS)
        print(json.dumps(gcs.get_draining_nodes(timeout=10)))
    """)
    assert draining == {placed["node"]: int(notice_time.timestamp() * 1000)}
    during = cluster.ray_script(NODES_SCRIPT + "print(json.dumps(nodes()))")
    assert during[WORKER_NAME]["state"] == 0

    # The work is handed back (the actor ends); the idle, draining node then leaves, recorded
    # as preempted by the drain rather than as a crash.
    after = cluster.ray_script(
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
