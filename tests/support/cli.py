"""The `sluice` command as the end-to-end tests run it: a subprocess from the repo root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

# configs/smoke.yaml's run sizes, for a run on a model folder (whose own sizes stand).
SMALL_RUN = (
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "rollout.kv_cache_gib=0.25",
    "train.steps=4",
    "eval.every=2",
    "eval.prompts=32",
)

# What torch.distributed reads to join a group. A DeepSpeed test that formed a world of one
# in the test process left them set, and its store still listens on MASTER_PORT: a child
# that inherited them would try to join that group (EADDRINUSE).
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child process, less the rendezvous variables."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    return env | extra


def sluice(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice.flows.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def smoke_run(root: Path, cache: Path, *settings: str) -> list[str]:
    """Arguments of `sluice run configs/smoke.yaml` into ``root``, one --set per setting."""
    args = ["run", "configs/smoke.yaml"]
    for setting in (f"root={root}", f"cache={cache}", *settings):
        args += ["--set", setting]
    return args
