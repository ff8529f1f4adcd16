"""The real entry point on a GPU node: `sluice run configs/smoke.yaml` in async mode with two
rollout workers, Ray started by the run itself (it finds the node's GPUs).

``rollout.gpus_per_worker`` and ``train.gpus_per_rank`` unset: with three or more GPUs each
actor asks for one (the cluster has GPUs) and Ray gives each its own device. With fewer,
the three actors share by asking for a quarter GPU each, and each vLLM engine may take a
quarter of the memory (vLLM refuses to start when less than ``gpu_memory_utilization`` of
the device is free, a check it makes with an explicit KV-cache size too).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sluice.storage.ledger import Ledger, check_exactly_once, summarize

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).parents[2]
STEPS, BOUND = 8, 1
SHARED = ["rollout.gpus_per_worker=0.25", "train.gpus_per_rank=0.25"]
DEVICES = re.compile(
    r"devices \(CUDA_VISIBLE_DEVICES\): the trainer (\S+); rollout workers (\S+), (\S+)"
)


def test_two_worker_async_run_on_one_gpu_node(tmp_path, shared_cache):
    own_gpus = torch.cuda.device_count() >= 3
    settings = [
        f"root={tmp_path / 'runs'}",
        f"cache={shared_cache}",
        f"train.steps={STEPS}",
        "mode=async",
        f"max_staleness={BOUND}",
        "rollout.workers=2",
        "eval.every=4",
        *([] if own_gpus else [*SHARED, "rollout.gpu_memory_utilization=0.25"]),
    ]
    args = [sys.executable, "-m", "sluice.flows.cli", "run", "configs/smoke.yaml"]
    for setting in settings:
        args += ["--set", setting]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_HOME")}
    result = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert f"in {STEPS} async steps" in result.stdout

    # Every actor holds a GPU (Ray set its CUDA_VISIBLE_DEVICES); with enough, its own.
    seen = DEVICES.search(out)
    assert seen, out[-4000:]
    devices = seen.groups()
    assert all(d != "cpu" for d in devices), devices
    if own_gpus:
        assert len(set(devices)) == 3, devices

    table = Ledger((tmp_path / "runs" / "smoke").as_uri()).read()
    assert check_exactly_once(table) == []
    summary = summarize(table)
    assert summary["final"]["trained"] == STEPS * 16  # smoke: 4 prompts x 4 samples a step
    assert max(summary["staleness"]) <= BOUND
