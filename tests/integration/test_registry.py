"""The model registry and the retrain flow's promote/keep step, on MLflow's sqlite backend
and on a real MLflow tracking server (127.0.0.1, stopped by pid at the end)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from sluice.driver.tracking import MlflowLogger
from sluice.tasks import registry
from sluice.tasks.registry import promote_or_keep
from tests.support.servers import Server, free_port

pytestmark = pytest.mark.integration

MODEL = "test-policy"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    server = Server(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{folder / 'mlflow.db'}",
            "--default-artifact-root",
            (folder / "artifacts").as_uri(),
        ],
        folder / "server.log",
        {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
        Path.cwd(),
    )
    try:
        server.wait_http(f"http://127.0.0.1:{port}/health", timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "server"])
def tracking(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'mlflow.db'}"
    return request.getfixturevalue("mlflow_server")


def _trained(uri: str, tmp_path: Path, accuracy: float, name: str) -> tuple[MlflowClient, str]:
    """A finished run whose policy folder is registered (a stand-in folder, a real registry)."""
    logger = MlflowLogger(uri, (tmp_path / "artifacts").as_uri(), f"exp-{name}", name)
    logger.log_metrics(1, {"eval/accuracy": accuracy})
    policy = tmp_path / name
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps({"model_type": "llama"}))
    version = registry.register_policy(logger.client, MODEL, logger.run_id, policy, accuracy)
    logger.close()
    return logger.client, version


def test_promote_or_keep_both_ways(tracking, tmp_path):
    client, first = _trained(tracking, tmp_path, 0.40, "first")
    assert registry.alias_version(client, MODEL, registry.CHALLENGER) == first
    decision = promote_or_keep.fn(client, MODEL, first, None, 0.40, 0.0)
    assert decision.promote and decision.reason == "there is no champion yet"
    assert registry.alias_version(client, MODEL, registry.CHAMPION) == first

    # worse on the same held-out set: the champion stays, and the version says why
    client, worse = _trained(tracking, tmp_path, 0.35, "worse")
    decision = promote_or_keep.fn(client, MODEL, worse, 0.40, 0.35, 0.0)
    assert not decision.promote and "-5.0 points" in decision.reason
    assert registry.alias_version(client, MODEL, registry.CHAMPION) == first
    assert client.get_model_version(MODEL, worse).tags["promotion"] == decision.reason

    # better by more than min_gain: promoted
    client, better = _trained(tracking, tmp_path, 0.50, "better")
    decision = promote_or_keep.fn(client, MODEL, better, 0.40, 0.50, 0.05)
    assert decision.promote
    assert registry.alias_version(client, MODEL, registry.CHAMPION) == better

    # the registered folder comes back as it was logged
    folder = registry.download_policy(client, MODEL, better, tmp_path / "download")
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "llama"}
