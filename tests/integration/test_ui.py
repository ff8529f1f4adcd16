"""What a person sees: the Prefect UI's runs page and the MLflow run page of a real job,
rendered by headless Chromium and checked not to be blank (`make ui-check`; marker `ui`).

Screenshots are written to ``$SLUICE_UI_SHOTS`` (default: the test's temp folder);
`make ui-check` points it at docs/images, which the README shows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from tests.support.cli import ROOT, sluice, smoke_run
from tests.support.servers import Server, free_port

pytestmark = [pytest.mark.integration, pytest.mark.ui]

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--window-size=1400,900",
    # Without these two the single-page apps are captured before they have drawn anything.
    "--virtual-time-budget=15000",
    "--run-all-compositor-stages-before-draw",
]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium is not installed (make ui-check installs it)")
    return found


def screenshot(url: str, out: Path) -> Path:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={out}", url],
            check=True,
            capture_output=True,
            timeout=120,
        )
    return out


def assert_not_blank(png: Path) -> None:
    image = Image.open(png).convert("L")
    colours = len(image.getcolors(maxcolors=1 << 16) or range(1 << 16))
    assert ImageStat.Stat(image).stddev[0] > 10, f"{png} looks blank"
    assert colours > 20, f"{png} has only {colours} grey levels: no text drawn"


def test_prefect_runs_page_and_mlflow_run_page(tmp_path, shared_cache):
    shots = Path(os.environ.get("SLUICE_UI_SHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    port, mlflow_port = free_port(), free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    prefect = Server(
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
        tmp_path / "prefect.log",
        env,
        ROOT,
    )
    mlflow = None
    try:
        prefect.wait_http(f"http://127.0.0.1:{port}/api/health", timeout=180)
        root = tmp_path / "runs"
        run = sluice(
            *smoke_run(root, shared_cache, "train.steps=4", "checkpoint.every=2"),
            env=env,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert_not_blank(screenshot(f"http://127.0.0.1:{port}/runs", shots / "prefect-runs.png"))

        summary = json.loads((root / "smoke" / "summary.json").read_text())
        mlflow = Server(
            [
                sys.executable,
                "-m",
                "mlflow",
                "ui",
                "--host",
                "127.0.0.1",
                "--port",
                str(mlflow_port),
                "--backend-store-uri",
                f"sqlite:///{root / 'mlflow.db'}",
            ],
            tmp_path / "mlflow.log",
            {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
            ROOT,
        )
        mlflow.wait_http(f"http://127.0.0.1:{mlflow_port}/health", timeout=120)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
        experiment = client.get_run(summary["mlflow_run_id"]).info.experiment_id
        page = (
            f"http://127.0.0.1:{mlflow_port}/#/experiments/{experiment}/runs/"
            f"{summary['mlflow_run_id']}"
        )
        assert_not_blank(screenshot(page, shots / "mlflow-run.png"))
    finally:
        if mlflow is not None:
            mlflow.stop()
        prefect.stop()
