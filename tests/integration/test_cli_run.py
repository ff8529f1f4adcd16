"""The real entry point on a tiny budget: `sluice run` drives Prefect, Ray, vLLM, torch, MLflow."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.ledger import Ledger, check_exactly_once, latest_events, summarize
from sluice.storage.schema import VERSION_KEY

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
SLUICE = [sys.executable, "-m", "sluice.flows.cli"]


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_HOME")}
    return subprocess.run(
        [*SLUICE, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _smoke(
    tmp_path: Path, cache: Path, *settings: str, runs: str = "runs"
) -> subprocess.CompletedProcess[str]:
    """`sluice run configs/smoke.yaml` into ``tmp_path/runs`` with ``--set`` for each setting."""
    args = ["run", "configs/smoke.yaml"]
    for setting in (f"root={tmp_path / runs}", f"cache={cache}", *settings):
        args += ["--set", setting]
    return _run(args, timeout=600)


def test_smoke_run_end_to_end(tmp_path, shared_cache):
    """``sync`` (``one_step`` runs in tests/integration/test_gpu_placement.py, ``async``
    below) into a root with a space, '#', '%' and non-ASCII: everything lands where it
    says. The trainer carries a critic and a KL penalty toward a frozen reference: both
    run in the training pool, log per step and travel in the checkpoint."""
    mode, staleness, runs = "sync", [0, 0, 0, 0], "runs #1 100% é"
    steps = 4
    result = _smoke(
        tmp_path,
        shared_cache,
        f"train.steps={steps}",
        f"mode={mode}",
        "checkpoint.every=3",
        "train.critic={}",
        "train.kl_coef=0.01",
        runs=runs,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "== summary ==" in result.stdout
    assert f"step    {steps}/{steps}" in result.stdout

    assert [p.name for p in tmp_path.iterdir()] == [runs]
    run_dir = tmp_path / runs / "smoke"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert 0.0 <= summary["end_accuracy"] <= 1.0
    assert summary["samples_per_s"] > 0
    # every step's weight sync was watched (driver/weight_sync.py), its trend in the summary
    assert summary["weight_sync"].startswith(f"weight loads: {steps}, median ")
    assert summary["weight_sync"] in result.stdout
    # everything the run wrote is under its folder or the cache
    assert (run_dir / "prefect").is_dir()
    assert (run_dir / "policy" / "model.safetensors").is_file()
    assert list((shared_cache / "policies").iterdir())

    with sqlite3.connect(run_dir.parent / "mlflow.db") as db:
        rows = db.execute("SELECT key, COUNT(*) FROM metrics GROUP BY key").fetchall()
        params = dict(db.execute("SELECT key, value FROM params").fetchall())
        recorded = db.execute(
            "SELECT value FROM metrics WHERE key='train/staleness' ORDER BY step"
        ).fetchall()
    counts = dict(rows)
    for key in (
        "rollout/reward",
        "train/loss",
        "train/kl_behaviour",
        "train/entropy",
        "perf/tokens_per_s",
        "perf/step_s",
        "train/value_loss",
        "train/value_grad_norm",
        "train/kl_reference",
    ):
        assert counts.get(key) == steps, f"{key}: {counts.get(key)} values, want {steps}"
    assert counts["eval/accuracy"] >= 2  # start and end
    assert params["train.steps"] == str(steps)
    assert params["env.name"] == "addition"
    assert params["mode"] == mode
    assert [int(v) for (v,) in recorded] == staleness  # sync: every sample on-policy

    # the ledger accounts for every sample: generated once, trained exactly once
    table = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(table) == []
    summary = summarize(table)
    assert summary["final"] == {"trained": steps * 4 * 4}  # smoke: 4 prompts x 4 samples
    assert summary["staleness"] == dict(Counter(s for s in staleness for _ in range(16)))
    report = _run(["ledger", str(run_dir)], timeout=120)
    assert report.returncode == 0, report.stderr
    assert "exactly-once: ok" in report.stdout and "trained versions: no gap" in report.stdout
    prompt_id = table.column("prompt_id")[0].as_py()
    trace = _run(["ledger", str(run_dir), "--prompt", prompt_id], timeout=120)
    assert trace.returncode == 0, trace.stderr
    assert " generated" in trace.stdout and " trained version=" in trace.stdout

    # checkpoints at 0, 3 and the end, with the data cursor and the ledger watermark
    store = CheckpointStore(run_dir.as_uri())
    assert store.list() == [0, 3, steps]  # step 0: what a failure before step 3 resumes from
    latest = store.load_latest()
    assert latest.meta["version"] == steps and latest.meta["ledger_watermark"] > 0
    assert len(latest.meta["data_cursor"]["prompts"]["order"]) > 0
    assert {"model.safetensors", "optimizer.json", "critic.safetensors"} <= set(latest.files)
    # every trained block also has its Parquet copy (what a restarted store re-offers)
    assert len(list((run_dir / "trajectories").glob("*.parquet"))) == steps
    _a_foreign_schema_fails_the_resume_at_once(run_dir)  # the finished run, reused


def _a_foreign_schema_fails_the_resume_at_once(run_dir: Path) -> None:
    """A trajectory file of another schema version fails the resume before Ray or a pool
    starts, with its one line (no retry could read it)."""
    first = sorted((run_dir / "trajectories").glob("*.parquet"))[0]
    table = pq.read_table(first)
    pq.write_table(table.replace_schema_metadata({VERSION_KEY: b"9"}), first)
    args = ["resume", run_dir.name, "--root", str(run_dir.parent), "--set", "train.steps=5"]
    result = _run(args, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert " - Retry " not in out, out[-3000:]  # Prefect's line for a retry (test_faults.py)
    assert "start-ray" not in out, out[-3000:]  # refused before Ray started
    (line,) = [line for line in result.stderr.splitlines() if "SchemaError" in line]
    assert f"{first.name}: trajectory data was written with schema version 9" in line


def test_async_run_keeps_the_staleness_bound(tmp_path, shared_cache):
    """Two streaming workers, a dispatcher's admission control and repack, and the store's
    staleness bound. The run also trains with options that travel through the actors: the
    workers' advantages (REINFORCE++-baseline, overlong shaping), the trainer pool's batch
    normalisation, sequence-mean aggregation and clip-higher."""
    # Repacks come in bursts, mostly when both workers restart together after an eval: 20
    # steps give several such chances (10 steps once gave none). On a loaded machine async
    # may start before Ray has placed the second worker, and the first steps (under a
    # second each) run on one worker, without a chance: 30 steps leave room for that.
    steps, bound = 30, 1
    result = _smoke(
        tmp_path,
        shared_cache,
        f"train.steps={steps}",
        "mode=async",
        f"max_staleness={bound}",
        "eval.every=3",  # a pause of the streams in mid-run, for held-out evaluation
        "train.loss=decoupled_ppo",
        "rollout.workers=2",
        # Every worker straggles whenever admission holds it back: repack on every chance.
        "rollout.repack_max_stragglers=16",
        "rollout.repack_min_age_s=0",
        "train.advantage=reinforce_pp_baseline",
        "train.loss_agg=seq_mean_token_mean",
        "train.clip_eps_high=0.28",
        "train.overlong_buffer=8",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"in {steps} async steps" in result.stdout
    run_dir = tmp_path / "runs" / "smoke"
    with sqlite3.connect(run_dir.parent / "mlflow.db") as db:
        worst = [
            v for (v,) in db.execute("SELECT value FROM metrics WHERE key='train/staleness_max'")
        ]
        # A group is dated by its last token; its first tokens may be older, never newer.
        first = [
            v
            for (v,) in db.execute(
                "SELECT value FROM metrics WHERE key='train/first_token_lag_max' ORDER BY step"
            )
        ]
        weights = db.execute(
            "SELECT COUNT(*) FROM metrics WHERE key='train/is_weight_mean'"
        ).fetchone()
        loads = db.execute(
            "SELECT SUM(value) FROM metrics WHERE key='rollout/worker0/weight_loads'"
        ).fetchone()
        (repacked,) = db.execute(
            "SELECT SUM(value) FROM metrics WHERE key='rollout/repacked_groups'"
        ).fetchone()
        penalties = [
            v
            for (v,) in db.execute(
                "SELECT value FROM metrics WHERE key='rollout/reward/overlong_penalty'"
            )
        ]
    assert len(worst) == steps and max(worst) <= bound
    assert len(first) == steps and max(first) >= max(worst)
    assert weights == (steps,) and loads[0] >= 1  # the worker pulled new weights itself
    # Groups moved between the workers, and were trained (below).
    assert repacked >= 1, result.stdout[-3000:]
    assert penalties and max(penalties) <= 0.0  # the workers shaped their groups
    table = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(table) == []
    summary = summarize(table)
    assert summary["final"]["trained"] == steps * 16
    assert set(summary["final"]) <= {"trained", "dropped"}  # leftovers dropped with a reason
    assert max(summary["staleness"]) <= bound
    generated = {r["sample_id"] for r in table.to_pylist() if r["event"] == "generated"}
    # Every sample the dispatcher handed out was generated, then trained or dropped.
    dispatched = {r["sample_id"] for r in table.to_pylist() if r["event"] == "dispatched"}
    assert generated == dispatched == set(latest_events(table))
    report = _run(["ledger", str(run_dir)], timeout=120)
    assert "exactly-once: ok" in report.stdout and "every one accounted for" in report.stdout


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("train.lr=-1", "train.lr: Input should be greater than 0"),
        (
            "storage.url=ftp://host/x",
            "storage.url: bad storage URL 'ftp://host/x': unsupported scheme 'ftp'",
        ),
        ("name=[x", "override 'name=[x': the value is not valid YAML"),
        ("rollout.max_new_tokens=250", "plus rollout.max_new_tokens (250) is 257 tokens"),
    ],
    ids=["config", "storage-url", "yaml-in-set", "context"],
)
def test_bad_input_is_one_readable_message(setting, message):
    result = _run(["run", "configs/smoke.yaml", "--set", setting], timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_pools_that_cannot_fit_the_embedded_cluster_fail_at_once(tmp_path):
    """A thousand rollout workers on this machine's embedded Ray: refused before Prefect, Ray
    or the starting policy start, with what would fit."""
    args = [
        "run",
        "configs/smoke.yaml",
        "--set",
        f"root={tmp_path}",
        "--set",
        "rollout.workers=1000",
    ]
    result = _run(args, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert "does not fit this machine's Ray cluster: the pools need about" in result.stderr
    assert re.search(r"rollout.workers=1000 x ~[\d.]+ GiB", result.stderr), result.stderr
    assert "Lower rollout.workers (at most" in result.stderr
    assert "Fix the config file or the --set value" in result.stderr
    assert "start-ray" not in out and "prefect" not in out.lower(), out[-3000:]
    assert "Traceback" not in result.stderr
