"""DeepSpeed on a CUDA device: the process group uses NCCL, the model and the step run on
the GPU. In a fresh process (a world of one), as the trainer actor runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).parents[2]
RANK = """
import json, math, sys
import torch.distributed as dist
from sluice.rl.batching import Sample
from tests.support.trainers import make_trainer, step

trainer = make_trainer(
    sys.argv[1], engine="deepspeed", zero_stage=2, lr=1e-3, clip_eps=0.2, grad_clip=1.0,
    micro_batch=2, threads=1, seed=0,
)
samples = [
    Sample([1, 30 + i], [20 + i, 21, 2], [-3.0, -3.1, -3.2], advantage=(-1.0) ** i)
    for i in range(4)
]
metrics = step(trainer, samples)
print(json.dumps({
    "backend": dist.get_backend(),
    "device": str(next(trainer.model.parameters()).device),
    "version": trainer.version(),
    "loss_finite": math.isfinite(metrics["loss"]),
}))
"""


def test_deepspeed_chooses_nccl_on_cuda(tiny_policy):
    # One device, and no torchrun variables: a lone process forms its own world of one.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    result = subprocess.run(
        [sys.executable, "-c", RANK, str(tiny_policy)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["backend"] == "nccl"
    assert report["device"].startswith("cuda")
    assert report["version"] == 1 and report["loss_finite"]
