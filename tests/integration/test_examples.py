"""The worked example of docs/tutorial.md, as a user runs it: ``examples/my_project`` holds
a JSONL data set, a reward module and an environment class outside the package, and
``sluice run`` trains on each in ``async`` mode (at the smoke config's size, so it takes
about a minute each)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from sluice.storage.ledger import Ledger, check_exactly_once
from tests.support.cli import ROOT, sluice

pytestmark = pytest.mark.integration

EXAMPLE = ROOT / "examples" / "my_project"
# configs/smoke.yaml's sizes: a tiny policy and a few short steps.
SMALL = [
    "policy.layers=2",
    "policy.hidden=64",
    "policy.heads=2",
    "policy.intermediate=128",
    "policy.warmstart_target=0.05",
    "policy.warmstart_max_steps=40",
    "policy.warmstart_eval_every=20",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "rollout.kv_cache_gib=0.25",
    "train.steps=4",
    "eval.every=2",
    "eval.prompts=32",
]


def _run(config: str, tmp_path: Path, cache: Path) -> tuple[str, Path]:
    args = ["run", str(EXAMPLE / config)]
    for setting in (f"root={tmp_path / 'runs'}", f"cache={cache}", *SMALL):
        args += ["--set", setting]
    result = sluice(*args, env={**os.environ, "PYTHONPATH": str(EXAMPLE)})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return out, tmp_path / "runs"


def test_the_dataset_example_trains_on_its_jsonl_with_the_users_reward(
    tmp_path: Path, shared_cache: Path
) -> None:
    out, runs = _run("addition.yaml", tmp_path, shared_cache)
    assert "step    4/4" in out
    table = Ledger((runs / "my-addition").as_uri()).read()
    assert check_exactly_once(table) == []
    trained = {
        p
        for p, e in zip(table["prompt_id"].to_pylist(), table["event"].to_pylist(), strict=True)
        if e == "trained"
    }
    assert trained and all(p.startswith("dataset/train/") for p in trained)
    with sqlite3.connect(runs / "mlflow.db") as db:
        keys = {k for (k,) in db.execute("SELECT DISTINCT key FROM metrics")}
    # each function of the weighted sum is logged as its own metric, with its extras
    assert {"rollout/reward/final_sum", "rollout/reward/shows_work"} <= keys
    assert "rollout/reward/final_sum/answered" in keys


def test_the_environment_example_trains_the_users_class(tmp_path: Path, shared_cache: Path) -> None:
    out, runs = _run("reverse.yaml", tmp_path, shared_cache)
    assert "step    4/4" in out
    table = Ledger((runs / "my-reverse").as_uri()).read()
    assert check_exactly_once(table) == []
    assert all(p.startswith("reverse/") for p in table["prompt_id"].to_pylist())
