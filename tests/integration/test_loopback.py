"""The sockets a run listens on, in the embedded default (no ``--address``).

While a smoke run trains, every listening TCP socket of the job's processes is listed
(then the job is stopped, its processes killed by id: the rest of the run adds nothing).
Everything Sluice starts itself (Prefect's temporary API; MLflow writes to SQLite and
starts no server) listens on loopback only. Ray 2.60's own processes are the exception
this test names: its GCS, raylets and workers bind the wildcard address and its agents
the node's address whatever ``_node_ip_address`` says (docs/operating.md). The driver is a
Ray worker as well and holds one such socket (Ray's core-worker server). The test fails if
any other process of the run listens beyond loopback, or the driver on more than that one
socket.

Until Ray binds loopback, its token authentication is what guards those sockets: the same
test asks the run's GCS for a key with the token (answered) and without it (refused).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.integration.test_faults import smoke_args
from tests.support.cli_job import Job

pytestmark = pytest.mark.integration

LOOPBACK = {"127.0.0.1", "::1"}


def _is_ray(process: psutil.Process) -> bool:
    """Ray's processes: its binaries, its Python services and its workers (``ray::``)."""
    name, cmdline = process.name(), " ".join(process.cmdline())
    return name in ("raylet", "gcs_server") or name.startswith("ray::") or "/ray/" in cmdline


def _listening(root: int) -> dict[str, list[str]]:
    """The job's listening sockets as ``"<process> <ip>"``, sorted into Ray's processes,
    the driver (it hosts Ray's core worker) and the rest (Sluice's own)."""
    family = {root: psutil.Process(root)}
    family |= {p.pid: p for p in psutil.Process(root).children(recursive=True)}
    found: dict[str, list[str]] = {"ray": [], "driver": [], "sluice": []}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in family:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            process = family[conn.pid]
            kind = "driver" if conn.pid == root else "ray" if _is_ray(process) else "sluice"
            found[kind].append(f"{' '.join(process.cmdline())} {conn.laddr.ip}")
    return found


def _wide(sockets: list[str]) -> list[str]:
    return [s for s in sockets if s.rsplit(" ", 1)[1] not in LOOPBACK]


def _gcs_port(root: int) -> int:
    """The port the GCS server among ``root``'s descendants listens on."""
    for process in psutil.Process(root).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.name() == "gcs_server":
                (port,) = {
                    c.laddr.port
                    for c in process.net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN
                }
                return port
    raise AssertionError("no gcs_server among the job's processes")


def _ask_gcs(port: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One request to the GCS at ``port``, from a process of its own with ``env``."""
    request = (
        "from ray._raylet import GcsClient; "
        f"GcsClient(address='127.0.0.1:{port}').internal_kv_get(b'x', None, timeout=30); "
        "print('answered')"
    )
    return subprocess.run(
        [sys.executable, "-c", request], env=env, capture_output=True, text=True, timeout=120
    )


def test_what_sluice_starts_listens_on_loopback_only(tmp_path: Path, shared_cache: Path) -> None:
    job = Job(
        smoke_args(tmp_path, shared_cache, "mode=async", "train.steps=60", "eval.every=100"),
        tmp_path / "job.log",
        {"PREFECT_API_URL": ""},  # the run's own temporary Prefect server, checked below
    )
    try:
        job.expect(r"step    1/60")
        found = _listening(job.proc.pid)
        port = _gcs_port(job.proc.pid)  # (60 steps: the run still stands while it is asked)
        plain = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        with_token = _ask_gcs(port, {**plain, "RAY_AUTH_MODE": "token"})
        home = tmp_path / "home"  # no ~/.ray/auth_token there
        home.mkdir()
        without = _ask_gcs(port, {**plain, "HOME": str(home), "RAY_AUTH_MODE": "disabled"})
        assert job.proc.poll() is None, job.output()[-3000:]  # it stood while it was asked
    finally:
        job.stop()
    assert any("prefect.server" in s for s in found["sluice"]), found  # the temporary API
    assert _wide(found["sluice"]) == [], found
    # The driver is a Ray worker too: its one wide socket is Ray's core-worker server.
    assert len(_wide(found["driver"])) <= 1, found
    assert _wide(found["ray"]), found  # Ray's processes were seen: the named exception
    # ... and what guards them: a client with the run's token is answered, one without is not
    assert "answered" in with_token.stdout, with_token.stderr[-2000:]
    assert without.returncode != 0 and "answered" not in without.stdout
    assert "InvalidAuthToken" in without.stderr, without.stderr[-2000:]
