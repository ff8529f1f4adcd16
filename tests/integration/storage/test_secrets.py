"""Storage credentials from a Prefect secret block reach every actor that needs them, and
appear nowhere they should not: the job's output, MLflow, the run folder, Ray's session
logs, the ledger, checkpoints and trajectories in the bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import s3fs

from sluice.storage.layout import RunLayout
from sluice.storage.urls import CREDENTIAL_VARS
from tests.support.cli import ROOT, sluice, smoke_run

pytestmark = pytest.mark.integration

BLOCK = "sluice-test-s3"


def _files_containing(folder: Path, needle: bytes) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_credentials_come_from_a_secret_block_and_never_leak(s3_server, tmp_path, shared_cache):
    access_key, secret_key = s3_server.access_key, s3_server.secret_key
    root = tmp_path / "runs"
    layout = RunLayout(root / "smoke", shared_cache)
    # No credential in the job's environment: the secret block is the only source.
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIAL_VARS}
    layout.create()
    env["PREFECT_HOME"] = str(layout.prefect_home)  # the run's own Prefect database
    secret = {
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "SLUICE_S3_ENDPOINT": s3_server.endpoint,
    }
    saved = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys; from prefect.blocks.system import Secret; "
            f"Secret(value=json.loads(sys.argv[1])).save({BLOCK!r})",
            json.dumps(secret),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert saved.returncode == 0, saved.stderr[-3000:]
    prefix = f"s3://{s3_server.bucket}/secrets-{tmp_path.name}"
    run = sluice(
        *smoke_run(
            root,
            shared_cache,
            "train.steps=2",
            "mode=async",
            f"storage.url={prefix}",
            f"storage.credentials_block={BLOCK}",
        ),
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "== summary ==" in run.stdout

    secret_bytes = secret_key.encode()
    assert secret_key not in run.stdout + run.stderr
    # The Prefect database is the secret's own store; everything else must be clean.
    leaks = [f for f in _files_containing(root, secret_bytes) if str(layout.prefect_home) not in f]
    leaks += _files_containing(layout.ray_temp, secret_bytes)
    fs = s3fs.S3FileSystem(key=access_key, secret=secret_key, endpoint_url=s3_server.endpoint)
    stored = fs.find(prefix)
    assert any("/ledger/" in k for k in stored) and any("/checkpoints/" in k for k in stored)
    leaks += [k for k in stored if secret_bytes in fs.cat_file(k)]
    assert leaks == []
