"""Deployments on a real Prefect server: `sluice deploy` registers prefect.yaml's train,
retrain (with its cron schedule) and eval deployments; a process worker runs `train` on a
tiny config to completion. The server and worker listen on / talk to 127.0.0.1 only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.servers import Server, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def _post(url: str, body: dict) -> list | dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


@pytest.fixture(scope="module")
def prefect(tmp_path_factory, shared_cache):
    """A Prefect server and a process worker; yields (api url, env, folder)."""
    folder = tmp_path_factory.mktemp("prefect-deploy")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(folder / "home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
    }
    server = Server(
        [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        folder / "server.log",
        env,
        ROOT,
    )
    worker = None
    try:
        server.wait_http(f"{api}/health", timeout=180)
        subprocess.run(
            [sys.executable, "-m", "prefect", "work-pool", "create", "sluice", "--type", "process"],
            env=env,
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=120,
        )
        worker = Server(
            [
                sys.executable,
                "-m",
                "prefect",
                "worker",
                "start",
                "--pool",
                "sluice",
                "--limit",
                "1",
            ],
            folder / "worker.log",
            env,
            ROOT,
        )
        yield api, env, folder
    finally:
        if worker is not None:
            worker.stop()
        server.stop()


def test_deploy_then_train_from_a_process_worker(prefect, shared_cache):
    api, env, folder = prefect
    deployed = subprocess.run(
        [sys.executable, "-m", "sluice.flows.cli", "deploy"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    deployments = {d["name"]: d for d in _post(f"{api}/deployments/filter", {})}
    assert set(deployments) == {"train", "retrain", "eval"}
    schedules = deployments["retrain"]["schedules"]
    assert [s["schedule"]["cron"] for s in schedules] == ["0 3 * * 0"]

    root = folder / "runs"
    params = {
        "config": "configs/smoke.yaml",
        "overrides": [f"root={root}", f"cache={shared_cache}", "train.steps=2", "mode=async"],
    }
    started = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect",
            "deployment",
            "run",
            "sluice-train/train",
            "--params",
            json.dumps(params),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)
    deadline, state = time.monotonic() + 600, None
    while time.monotonic() < deadline:
        state = _get(f"{api}/flow_runs/{run_id}")["state"]["type"]
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        time.sleep(3)
    worker_log = (folder / "worker.log").read_text()[-4000:]
    assert state == "COMPLETED", worker_log
    summary = json.loads((root / "smoke" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["model_version"] == "1"
