"""`sluice run` in ``async`` mode scored by a model instead of a verifier: a tiny
sequence-classification reward model built here (in the default suite), and the SmolLM2
folder as a generative judge (``make test-real``). Each is served in Ray actors of its own
beside the rollout worker and the trainer; the run finishes with every sample accounted
for, the judge's verdicts are in the ledger, and the comparison with the exact answer
reaches MLflow."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from sluice.storage.ledger import Ledger, check_exactly_once, summarize
from tests.support.cli import ROOT, sluice, smoke_run
from tests.support.reward_model import build_reward_model

pytestmark = pytest.mark.integration

SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
# Enough steps for the worker's reports (which carry the reward metrics) to reach the
# dispatcher: the first steps may train only what the worker generated during the start.
STEPS = 8


def _run(tmp_path: Path, cache: Path, *settings: str) -> tuple[Path, list[float]]:
    """A short async smoke run with ``settings``: its folder and the agreement metric."""
    args = smoke_run(
        tmp_path / "runs", cache, "mode=async", f"train.steps={STEPS}", "eval.every=4", *settings
    )
    result = sluice(*args, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"in {STEPS} async steps" in result.stdout
    run_dir = tmp_path / "runs" / "smoke"
    with sqlite3.connect(run_dir.parent / "mlflow.db") as db:
        agreement = [
            v
            for (v,) in db.execute(
                "SELECT value FROM metrics WHERE key='rollout/reward/agrees_with_verifier'"
            )
        ]
    return run_dir, agreement


def _accounted(run_dir: Path):
    table = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(table) == []
    assert summarize(table)["final"]["trained"] == STEPS * 16
    return [r for r in table.to_pylist() if r["event"] == "scored"]


def test_an_async_run_scored_by_a_reward_model(tmp_path, shared_cache):
    folder = build_reward_model(tmp_path / "rm")
    run_dir, agreement = _run(
        tmp_path, shared_cache, f"reward.model.model={folder}", "reward.correct_at=0.5"
    )
    scored = _accounted(run_dir)
    assert scored and all(r["verdict"] is None for r in scored)  # a classifier has no verdict
    assert agreement and all(0.0 <= v <= 1.0 for v in agreement)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2.is_dir(), reason=f"{SMOLLM2} is missing: `make model` writes it")
def test_an_async_run_judged_by_smollm2(tmp_path, shared_cache):
    run_dir, agreement = _run(
        tmp_path,
        shared_cache,
        f"reward.judge.model={SMOLLM2}",
        "reward.judge.prompt='Question: {prompt}\nReply: {completion}\n"
        "Is the reply the right answer? Answer yes or no.'",
        "reward.judge.max_new_tokens=8",
    )
    scored = _accounted(run_dir)
    verdicts = [r["verdict"] for r in scored]
    assert verdicts and all(v for v in verdicts), verdicts[:5]  # every sample's verdict kept
    assert agreement and all(0.0 <= v <= 1.0 for v in agreement)
    # `sluice ledger --prompt` shows a prompt's verdicts beside its events.
    traced = sluice("ledger", str(run_dir), "--prompt", scored[0]["prompt_id"], timeout=120)
    assert traced.returncode == 0, traced.stderr[-2000:]
    assert f"scored verdict={scored[0]['verdict']!r}" in traced.stdout
