"""Ray clusters of several nodes on this machine, started the way infra/terraform's boot
scripts start them: ``ray start --head --block`` and ``ray start --block --address ...
--node-name ... --resources ...``, with token authentication (Ray 2.60's default) from a
token file of the test's own.

Each node is its own process group (``start_new_session``) with its own temp dir and its own
free ports, so a test can lose one node (SIGKILL its raylet) and stop every node by pid at
the end, and nothing collides with another Ray on this shared machine. Ray maps
``--node-ip-address 127.0.0.1`` to the machine's own address (it wants a reachable one for
multi-node clusters), so the nodes report that address; they all still run here, sharing
the filesystem (the actors import this checkout through ``PYTHONPATH``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tests.support.servers import free_port

REPO = Path(__file__).resolve().parents[2]
RAY_CLI = Path(sys.executable).with_name("ray")
# A node joins in ~15 s on a busy 2-core machine; leave room for a loaded CI box.
JOIN_TIMEOUT_S = 120.0
# The fixed-port services of a node (their defaults, e.g. 10001, would collide).
_PORT_FLAGS = (
    "--ray-client-server-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
    "--node-manager-port",
    "--object-manager-port",
)

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


# What ``ray start`` says when its raylet did not register with the GCS in time.
STARTUP_TIMEOUT = "The current node timed out during startup"
STARTUP_RETRIES = 2  # starts after the first that timed out so (a CI box timed out twice)


def _port_flags() -> list[str]:
    flags = []
    for flag in _PORT_FLAGS:
        flags += [flag, str(free_port())]
    return flags


@dataclass
class Node:
    """One ``ray start --block`` process (the leader of the node's process group)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    client_port: int

    def raylet(self) -> psutil.Process | None:
        """The node's raylet (a child of ``ray start``), None once it is gone."""
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.proc.pid).children():
                if child.name() == "raylet":
                    return child
        return None

    def workers(self) -> dict[int, str]:
        """pid -> process title of the Ray worker processes of this node (children of its
        raylet); an actor's title is ``ray::<ClassName>...``."""
        raylet = self.raylet()
        found = {}
        if raylet is not None:
            for child in raylet.children():
                with contextlib.suppress(psutil.NoSuchProcess):
                    found[child.pid] = " ".join(child.cmdline())
        return found

    def stop(self) -> None:
        """SIGTERM ``ray start --block`` (it stops its raylet, GCS, agents), then SIGKILL
        what is left of its process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class RayNodes:
    """A head and worker nodes on 127.0.0.1; ``close`` stops them all by pid."""

    def __init__(self, workdir: Path) -> None:
        # Ray's socket paths sit ~60 characters under a temp dir and may not exceed 107
        # bytes, so temp dirs are short ones in /tmp rather than pytest's deep tmp_path.
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="sluice-ray-", dir="/tmp"))
        self.workdir = workdir
        token = workdir / "ray-auth-token"
        token.write_text(os.urandom(32).hex())
        token.chmod(0o600)
        self.env = {
            **self.clean_env(),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            # Teardown only: Ray's own SIGTERM drain would wait up to 30 s per node.
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        }
        self.port = free_port()
        self.gcs_address = f"127.0.0.1:{self.port}"
        self.nodes: dict[str, Node] = {}
        self.args: dict[str, list[str]] = {}
        self.log_from: dict[str, int] = {}

    @staticmethod
    def clean_env() -> dict[str, str]:
        """This process's environment without its own Ray's settings (an address, a
        token), with this checkout importable: for nodes and drivers started by a test."""
        skip = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
        inherited = {k: v for k, v in os.environ.items() if k not in skip}
        return {**inherited, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO)}

    def start(
        self, name: str, cpus: int, resources: dict[str, float] | None = None, gpus: int = 0
    ) -> Node:
        """Start a node; the first one started is the head. Returns at once (see ``joined``).
        ``gpus``: logical GPUs the node declares (Ray hands them out; no device needed)."""
        temp = self.ray_tmp / name
        temp.mkdir()
        client_port = free_port()
        args = [
            *("--node-ip-address", "127.0.0.1", "--node-name", name),
            *("--num-cpus", str(cpus), "--num-gpus", str(gpus), "--temp-dir", str(temp)),
            "--disable-usage-stats",
            *_port_flags(),
        ]
        if not self.nodes:
            args += ["--head", "--port", str(self.port), "--include-dashboard", "false"]
            args[args.index("--ray-client-server-port") + 1] = str(client_port)
        else:
            args += ["--address", self.gcs_address]
        if resources:
            args += ["--resources", json.dumps(resources)]
        self.args[name] = args
        self.nodes[name] = node = Node(name, self._launch(name, args), self._log(name), client_port)
        return node

    def _log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def _launch(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = self._log(name)
        self.log_from[name] = log.stat().st_size if log.exists() else 0  # this start's lines
        with log.open("ab") as out:
            return subprocess.Popen(
                [str(RAY_CLI), "start", "--block", *args],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _restart_timed_out(self, names: list[str]) -> list[str]:
        """Start again the nodes among ``names`` whose ``ray start`` gave up because its
        raylet did not register within Ray's fixed 30 s (a loaded 2-core machine: the other
        test process was starting vLLM), on fresh ports in case one was taken meanwhile;
        the names restarted."""
        again = []
        for name in names:
            node = self.nodes[name]
            said = node.log.read_bytes()[self.log_from[name] :].decode(errors="replace")
            if node.proc.poll() is not None and STARTUP_TIMEOUT in said:
                args = self.args[name]
                for flag in _PORT_FLAGS:
                    if flag != "--ray-client-server-port":  # the head's: client_address
                        args[args.index(flag) + 1] = str(free_port())
                node.proc = self._launch(name, args)
                again.append(name)
        return again

    def _raylet_logs(self, name: str) -> str:
        """The ends of a node's raylet logs: why it did not register, when it did not."""
        logs = sorted((self.ray_tmp / name).glob("session_*/logs/raylet.*"))
        return "\n".join(
            f"--- {log.name}:\n{log.read_text(errors='replace')[-1500:]}" for log in logs
        )

    @property
    def client_address(self) -> str:
        """The head's Ray client server, as ``ray://127.0.0.1:PORT``."""
        head = next(iter(self.nodes.values()))
        return f"ray://127.0.0.1:{head.client_port}"

    def script(self, body: str, timeout_s: float = 120.0) -> Any:
        """Run ``body`` in a child Python with the cluster's auth settings (this process's
        own Ray stays out of it); it must print one JSON line last, which is returned."""
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

    def node_states(self) -> dict[str, dict[str, Any]]:
        """name -> id, state (0 alive, 1 dead), death reason and resources, from the GCS."""
        return dict(self.script(NODES_SCRIPT + "print(json.dumps(nodes()))"))

    def wait_state(self, names: list[str], state: int, timeout_s: float = JOIN_TIMEOUT_S) -> dict:
        """Wait until every node of ``names`` is in ``state`` (0 alive, 1 dead) in the GCS; a
        node that timed out starting up is started again once."""
        found = self._wait_state(names, state, timeout_s)
        missing = [n for n in names if found.get(n, {}).get("state") != state]
        for _ in range(STARTUP_RETRIES):
            if state != 0 or not self._restart_timed_out(missing):
                break
            found = self._wait_state(names, state, timeout_s)
            missing = [n for n in names if found.get(n, {}).get("state") != state]
        if missing:
            logs = "\n".join(
                f"--- {n}:\n{self.nodes[n].log.read_text()[-2000:]}\n{self._raylet_logs(n)}"
                for n in missing
            )
            raise AssertionError(f"nodes {missing} not in state {state}: {found}\n{logs}")
        return dict(found)

    def _wait_state(self, names: list[str], state: int, timeout_s: float) -> dict:
        found = self.script(
            NODES_SCRIPT
            + f"""
deadline = time.monotonic() + {timeout_s}
while time.monotonic() < deadline:
    try:
        found = nodes()
    except Exception:
        found = {{}}
    if all(found.get(name, {{}}).get("state") == {state} for name in {names!r}):
        break
    time.sleep(0.5)
print(json.dumps(found))
""",
            timeout_s=timeout_s + 30,
        )
        return dict(found)

    def close(self) -> None:
        for node in reversed(list(self.nodes.values())):
            node.stop()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def wait_gone(pid: int, timeout_s: float) -> bool:
    """True once process ``pid`` has exited (within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False
