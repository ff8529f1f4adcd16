"""The end-to-end tests' Prefect API: one server per test process, on 127.0.0.1.

Every ``sluice run`` would otherwise start a temporary Prefect server of its own and stop
it at the end (~8 s on 2 cores, some 40 times in ``make test``). The runs these tests start
inherit ``PREFECT_API_URL`` and report to this one; a test that needs a run's own
temporary server (the loopback test looks for it) sets ``PREFECT_API_URL`` empty for that
run. The server is started on the first integration test a process runs and stopped, by
its process group, when the process's tests are done.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import Server, free_port

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="session", autouse=True)
def prefect_api(session_dir: Path) -> Iterator[str]:
    folder = session_dir / f"prefect-api-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(folder / "home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_UI_ENABLED": "false",
    }
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
    server = Server([*command, "--port", str(port)], folder / "server.log", env, ROOT)
    try:
        server.wait_http(f"{api}/health", timeout=180)
        os.environ["PREFECT_API_URL"] = api
        yield api
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()
