"""`sluice run` with `train.engine=deepspeed`: the real entry point on the DeepSpeed trainer.

Mid-run the trainer's process is killed; the flow retries the segment with new pools, and
the new DeepSpeed trainer resumes from the checkpoint the old one wrote.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.ledger import Ledger, check_exactly_once, check_versions
from tests.support.trainers import make_trainer

# A smoke run with one restart (~2.5 min here): out of the default suite.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).parents[2]


def test_a_deepspeed_run_survives_losing_its_trainer(tmp_path, shared_cache):
    steps, every = 4, 2
    args = [sys.executable, "-m", "sluice.flows.cli", "run", "configs/smoke.yaml"]
    for setting in (
        f"root={tmp_path / 'runs'}",
        f"cache={shared_cache}",
        "mode=sync",
        f"train.steps={steps}",
        f"checkpoint.every={every}",
        "train.engine=deepspeed",
        "train.zero_stage=2",
    ):
        args += ["--set", setting]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_HOME")}
    job = subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, to stop it whole if this test fails
    )
    lines: list[str] = []
    first_trainer: int | None = None
    killed = False
    try:
        assert job.stdout is not None
        for line in job.stdout:  # the run's whole output; the timeout mark bounds it
            lines.append(line)
            started = re.search(r"and the trainer \(pid (\d+)\) on deepspeed ZeRO-2;", line)
            if started and first_trainer is None:
                first_trainer = int(started[1])
            if re.match(rf"\S+ checkpoint \S+step-{every:08d}$", line) and not killed:
                assert first_trainer is not None and first_trainer > 1, line
                assert " ".join(psutil.Process(first_trainer).cmdline()).startswith("ray::"), line
                os.kill(first_trainer, signal.SIGKILL)  # the first trainer actor, by its pid
                killed = True  # once: the retry's trainer lives on
        out = "".join(lines)
        assert job.wait(timeout=60) == 0, out[-4000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # the group this test started, by its id
            job.wait()
    assert killed, out[-4000:]
    assert f"resumed at step {every} from" in out
    assert len(re.findall(r"\) on deepspeed ZeRO-2;", out)) == 2  # the first pools and the retry's
    assert f"step    {steps}/{steps}" in out

    run_dir = tmp_path / "runs" / "smoke"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
    with sqlite3.connect(run_dir.parent / "mlflow.db") as db:  # shared by the runs in root
        params = dict(db.execute("SELECT key, value FROM params").fetchall())
    assert (params["train.engine"], params["train.zero_stage"]) == ("deepspeed", "2")
    table = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(table, finished=True) == []
    assert check_versions(table) == []  # trained versions 1..4, no gap across the restart

    # The last checkpoint restores into a DeepSpeed trainer: the policy the run saved.
    latest = CheckpointStore(run_dir.as_uri()).load_latest()
    assert latest is not None and latest.meta["version"] == steps
    trainer_args = {"lr": 1e-4, "clip_eps": 0.2, "grad_clip": 1.0, "micro_batch": 8}
    restored = make_trainer(
        str(run_dir / "policy"), engine="deepspeed", threads=1, seed=0, **trainer_args
    )
    restored.load_checkpoint(latest.files, latest.meta)
    assert restored.version() == steps
    final = load_file(run_dir / "policy" / "model.safetensors")
    assert set(final) == set(restored.state())
    for name, tensor in restored.state().items():
        assert tensor.equal(final[name]), name
