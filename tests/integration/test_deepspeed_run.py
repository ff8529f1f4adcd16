"""`sluice run` with `train.engine=deepspeed`: the real entry point on the DeepSpeed trainer."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from engines.deepspeed_trainer import DeepSpeedTrainer
from storage.checkpoints import CheckpointStore
from storage.ledger import Ledger, check_exactly_once

# About as long as the other smoke runs (~2 min here), so it stays out of the default suite.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).parents[2]


def test_smoke_run_on_the_deepspeed_engine(tmp_path):
    steps = 4
    args = ["run", "configs/smoke.yaml"]
    for setting in (
        f"root={tmp_path / 'runs'}",
        f"cache={tmp_path / 'cache'}",
        "mode=sync",
        f"train.steps={steps}",
        "train.engine=deepspeed",
        "train.zero_stage=2",
    ):
        args += ["--set", setting]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_HOME")}
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "the deepspeed ZeRO-2 trainer" in result.stdout
    assert f"step    {steps}/{steps}" in result.stdout

    run_dir = tmp_path / "runs" / "smoke"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
    with sqlite3.connect(run_dir / "mlflow.db") as db:
        params = dict(db.execute("SELECT key, value FROM params").fetchall())
        losses = db.execute("SELECT COUNT(*) FROM metrics WHERE key='train/loss'").fetchone()
    assert (params["train.engine"], params["train.zero_stage"]) == ("deepspeed", "2")
    assert losses == (steps,)
    assert check_exactly_once(Ledger(run_dir.as_uri()).read()) == []

    # The run's last checkpoint restores into a DeepSpeed trainer: the policy the run saved.
    latest = CheckpointStore(run_dir.as_uri()).load_latest()
    assert latest is not None and latest.meta["version"] == steps
    trainer = DeepSpeedTrainer(
        str(run_dir / "policy"),
        lr=1e-4,
        clip_eps=0.2,
        grad_clip=1.0,
        micro_batch=8,
        threads=1,
        seed=0,
    )
    trainer.load_checkpoint(latest.files, latest.meta)
    assert trainer.version() == steps
    final = load_file(run_dir / "policy" / "model.safetensors")
    assert set(final) == set(trainer.state())
    for name, tensor in trainer.state().items():
        assert tensor.equal(final[name]), name
