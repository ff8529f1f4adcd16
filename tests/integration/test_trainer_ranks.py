"""`sluice run` with `train.ranks=2`: a training pool of two ranks under a real async job.

The two FSDP2 ranks (weights sharded over gloo, packed rows) train on token-balanced shares
of each leased batch; one lease, one acknowledgement and one version per step, as with one
rank, each version gathered one tensor at a time into the parameter service. Mid-run one
rank's process is killed: the other's collective fails with it, the segment fails, and the
retry resumes from the checkpoint the two ranks wrote, with a fresh group. The last
checkpoint, gathered from two ranks, then resumes in one process on the other engines.
A second, shorter run trains LoRA adapters on two torch DDP ranks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from sluice.engines.train.lora import ADAPTER_CONFIG, ADAPTER_FILE
from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.ledger import Ledger, check_exactly_once, check_versions
from tests.support.cli import sluice, smoke_run
from tests.support.trainers import make_trainer

# A smoke run with one restart (~1.5 min here) and a LoRA run (~1 min): out of the default
# suite, run by `make test-ranks` (and CI).
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).parents[2]
STARTED = re.compile(r"and 2 trainer ranks \(pids (\d+), (\d+)\) on torch FSDP2;")


def test_a_two_rank_async_run_survives_losing_a_rank(tmp_path, shared_cache):
    steps, every = 6, 2
    args = [sys.executable, "-m", "sluice.flows.cli", "run", "configs/smoke.yaml"]
    for setting in (
        f"root={tmp_path / 'runs'}",
        f"cache={shared_cache}",
        "mode=async",
        f"train.steps={steps}",
        f"checkpoint.every={every}",
        "train.ranks=2",
        "train.engine=fsdp",
        "train.packing=true",
        "train.collective_timeout_s=60",
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
    ranks: list[int] = []
    killed = False
    try:
        assert job.stdout is not None
        for line in job.stdout:  # the run's whole output; the timeout mark bounds it
            lines.append(line)
            started = STARTED.search(line)
            if started and not ranks:
                ranks = [int(started[1]), int(started[2])]
            if re.match(rf"\S+ checkpoint \S+step-{every:08d}$", line) and not killed:
                assert ranks, line
                assert " ".join(psutil.Process(ranks[1]).cmdline()).startswith("ray::"), line
                os.kill(ranks[1], signal.SIGKILL)  # rank 1 of the first pool, by its pid
                killed = True  # once: the retry's ranks live on
        out = "".join(lines)
        assert job.wait(timeout=60) == 0, out[-4000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # the group this test started, by its id
            job.wait()
    assert killed, out[-4000:]
    assert len(STARTED.findall(out)) == 2, out[-4000:]  # the first pool and the retry's
    assert f"resumed at step {every} from" in out
    assert f"step    {steps}/{steps}" in out

    run_dir = tmp_path / "runs" / "smoke"
    table = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(table, finished=True) == []
    assert check_versions(table) == []  # trained versions 1..6, each once, across the restart

    # The checkpoint two ranks wrote resumes in one process, on the other engines: the policy
    # the run saved.
    latest = CheckpointStore(run_dir.as_uri()).load_latest()
    assert latest is not None and latest.meta["version"] == steps
    final = load_file(run_dir / "policy" / "model.safetensors")
    settings = {"lr": 1e-4, "clip_eps": 0.2, "grad_clip": 1.0, "micro_batch": 8}
    for engine in ("torch", "deepspeed"):
        restored = make_trainer(run_dir / "policy", engine=engine, threads=1, seed=0, **settings)
        restored.load_checkpoint(latest.files, latest.meta)
        assert restored.version() == steps
        assert set(final) == set(restored.state())
        for name, tensor in restored.state().items():
            torch.testing.assert_close(tensor, final[name], atol=0, rtol=0, msg=name)


def test_a_two_rank_lora_run_publishes_adapters_to_the_workers(tmp_path, shared_cache):
    """Two torch DDP ranks train LoRA adapters and publish only them; the rollout workers,
    whose vLLM serves adapters (a full-weight version would not load into it), load each;
    the ledger holds, and the saved policy is the adapter over its base."""
    steps = 4
    lora = "train.lora={rank: 8, target_modules: [q_proj, v_proj, down_proj]}"
    args = smoke_run(tmp_path / "runs", shared_cache, "mode=async", f"train.steps={steps}",
                     "train.ranks=2", lora)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_HOME")}
    done = sluice(*args, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "2 trainer ranks" in out and "on torch DDP;" in out, out[-4000:]
    run_dir = tmp_path / "runs" / "smoke"
    table = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(table, finished=True) == []
    assert check_versions(table) == []
    policy = run_dir / "policy"
    assert (policy / ADAPTER_CONFIG).is_file() and (policy / ADAPTER_FILE).is_file()
    adapter = load_file(policy / ADAPTER_FILE)
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
