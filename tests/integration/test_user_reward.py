"""A run whose reward is the user's own function, named by import path, from a module that
lives outside the package; the function fails in every way a user's code can (it hangs,
kills its process, returns NaN, returns text) on some calls.

The run finishes; each failed sample is recorded in the ledger with its reason and counted,
the first reasons reach the console, and the function's own metric reaches MLflow.
"""

from __future__ import annotations

import os
import sqlite3
import textwrap
from pathlib import Path

import pyarrow.compute as pc
import pytest

from sluice.storage.ledger import Ledger, check_exactly_once
from tests.support.cli import sluice, smoke_run

pytestmark = pytest.mark.integration

# One sample in ten of each kind fails, chosen by a stable hash of the prompt and the
# completion (a count of calls would restart with each replaced process).
REWARDS = """
import os, signal, time, zlib

def flaky(prompt, completion, answer):
    kind = zlib.crc32((prompt + completion).encode()) % 10
    if kind == 0:
        time.sleep(600)
    if kind == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == 2:
        return float("nan")
    if kind == 3:
        return "1.0"
    right = completion.strip().split("|")[-1] == answer.strip().split("|")[-1]
    return {"reward": float(right), "chars": len(completion)}
"""


def test_a_user_reward_that_fails_fails_its_samples_and_the_run_finishes(
    tmp_path: Path, shared_cache: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_rewards.py").write_text(textwrap.dedent(REWARDS))
    env = {**os.environ, "PYTHONPATH": str(project)}
    result = sluice(
        *smoke_run(
            tmp_path / "runs",
            shared_cache,
            "mode=async",
            "train.steps=4",
            "reward.functions=[my_rewards:flaky]",
            "reward.timeout_s=1",
        ),
        env=env,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "a sample's reward failed (recorded in the ledger): reward my_rewards:flaky" in out

    run_dir = tmp_path / "runs" / "smoke"
    table = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(table) == []
    reasons = [r for r in pc.unique(table.column("reason")).to_pylist() if r]
    for why in (
        "timed out after 1 s (reward.timeout_s)",
        "the reward process was killed by SIGKILL",
        "returned nan, not a finite number",
        "returned a str, not a number or a mapping",
    ):
        assert any(why in r for r in reasons), (why, reasons)

    with sqlite3.connect(run_dir.parent / "mlflow.db") as db:
        errors = db.execute(
            "SELECT SUM(value) FROM metrics WHERE key='rollout/reward_errors'"
        ).fetchone()[0]
        chars = db.execute(
            "SELECT COUNT(*) FROM metrics WHERE key='rollout/reward/flaky/chars'"
        ).fetchone()[0]
    assert errors >= 4 and chars >= 1
