"""Fault injection on the real components (the failure table of docs/operating.md): rollout
workers killed with SIGKILL (multi-turn episodes in flight), the trainer killed, a
checkpoint write that dies half way, and the whole job killed and resumed. After each run
the ledger must show every sample trained exactly once or dropped with a reason, and
trained versions 1..N without a gap.
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

import pytest

from sluice.storage.checkpoints import CheckpointStore
from sluice.storage.ledger import (
    Ledger,
    check_exactly_once,
    check_versions,
    dispatch_accounting,
    summarize,
)
from tests.support.cli_job import Job

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
SAMPLES_PER_STEP = 16  # smoke: 4 prompts x 4 samples


def smoke_args(tmp_path: Path, cache: Path, *settings: str) -> list[str]:
    args = ["run", "configs/smoke.yaml"]
    for s in (f"root={tmp_path / 'runs'}", f"cache={cache}", *settings):
        args += ["--set", s]
    return args


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def assert_ledger_whole(run_dir: Path, steps: int) -> dict:
    table = Ledger(run_dir.as_uri()).read()
    assert check_exactly_once(table, finished=True) == []
    assert check_versions(table) == []
    summary = summarize(table)
    assert summary["final"]["trained"] == steps * SAMPLES_PER_STEP
    assert set(summary["final"]) <= {"trained", "dropped"}
    dropped = table.filter(table.column("event").to_numpy(zero_copy_only=False) == "dropped")
    assert all(r for r in dropped.column("reason").to_pylist())
    sent = dispatch_accounting(table)  # async: every dispatched sample ended
    assert sent["dispatched"] > 0 and sent["open"] == 0, sent
    return summary


def test_killed_rollout_workers_a_killed_trainer_and_a_broken_checkpoint_write(
    tmp_path, shared_cache
):
    """On a multi-turn environment (the guessing game): a worker always dies holding
    episodes mid-way, some waiting for the environment, some decoding a later turn."""
    steps = 30
    job = Job(
        smoke_args(
            tmp_path,
            shared_cache,
            "mode=async",
            "env.name=guessing",
            "env.max_turns=6",
            "rollout.max_new_tokens=48",
            f"train.steps={steps}",
            "checkpoint.every=10",
            "checkpoint.segment_retries=3",
            "eval.every=100",
        ),
        tmp_path / "job.log",
        # the step-0 checkpoint dies half way through its files (its task retries it)
        env={"SLUICE_FAULTS": "checkpoint.write=1"},
    )
    try:
        first = job.expect(r"rollout worker\(s\) \(pids (\d+)\) and the trainer \(pid (\d+)\)")
        worker, trainer = int(first.group(1)), int(first.group(2))
        job.expect(r"step    2/")
        kill(worker)  # 1st kill: Ray restarts it, its groups go back to the queue
        job.expect(r"rollout worker 0 died")
        again = int(job.expect(rf"rollout worker 0 streams in process (?!{worker}\b)(\d+)")[1])
        kill(again)  # 2nd kill
        job.expect(r"rollout worker 0 died .*restart 2 of")
        job.expect(rf"rollout worker 0 streams in process (?!{again}\b)(\d+)")
        # the first checkpoint after the restarts (10 unless they took ten steps)
        taken = int(job.expect(r"checkpoint .*step-000000(10|20)\b")[1])
        kill(trainer)  # its segment fails; the retry starts new pools from the checkpoint
        resumed = int(job.expect(r"resumed at step (\d+) from")[1])
        assert job.finish() == 0, job.output()[-4000:]
    finally:
        job.stop()
    assert resumed in (taken, taken + 10)  # the next only if the kill landed after it
    out = job.output()
    # The episodes in flight at the checkpoint went on from their turns and tokens: their
    # old ids end with the reason, and each group is trained or dropped under a new one.
    kept = re.search(r"(\d+) groups in flight at the checkpoint go on from their (\d+) tokens", out)
    assert kept is not None, out[-4000:]
    assert "RayTaskError(InjectedFault)() - Retry 1/2" in out  # the checkpoint task retried
    assert "Traceback" not in out  # one console line per failure
    assert f"step   {steps}/{steps}" in out
    run_dir = tmp_path / "runs" / "smoke"
    assert_ledger_whole(run_dir, steps)
    reasons = Ledger(run_dir.as_uri()).read().column("reason").to_pylist()
    continued = [r for r in reasons if r and "continued from its tokens under a new id" in r]
    assert len(continued) == int(kept[1]) * 4 > 0 and int(kept[2]) > 0
    with sqlite3.connect(tmp_path / "runs" / "mlflow.db") as db:
        metrics = dict(
            db.execute(
                "SELECT key, SUM(value) FROM metrics WHERE key IN "
                "('rollout/requeued_groups', 'rollout/episode/turns') GROUP BY key"
            ).fetchall()
        )
    assert metrics["rollout/requeued_groups"] > 0  # the killed worker's episodes, again
    assert metrics["rollout/episode/turns"] > 1
    checkpoints = CheckpointStore(run_dir.as_uri(), keep_last=3)
    assert checkpoints.list()[-1] == steps
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if ".tmp-" in p.name]
    assert leftovers == []  # the half-written step-0 checkpoint was cleaned up


# Slow tier (make test-slow): CI's chaos seed kills and resumes the whole job every day.
@pytest.mark.slow
def test_a_killed_job_resumes_from_its_checkpoint(tmp_path, shared_cache):
    steps = 24
    args = smoke_args(
        tmp_path, shared_cache, "mode=async", f"train.steps={steps}", "checkpoint.every=10"
    )
    job = Job(args, tmp_path / "job.log")
    try:
        job.expect(r"checkpoint .*step-00000010")
        job.expect(r"step   11/")
        job.kill_everything()  # mid-segment: step 11 (at least) trained, not checkpointed
    finally:
        job.stop()
    run_dir = tmp_path / "runs" / "smoke"
    again = Job(["resume", "smoke", "--root", str(tmp_path / "runs")], tmp_path / "job.log")
    try:
        again.expect(r"resumed at step 10 from")
        assert again.finish() == 0, again.output()[-4000:]
    finally:
        again.stop()
    assert f"step   {steps}/{steps}" in again.output()
    assert "step   11/" in again.output()  # trained again, from the checkpoint's weights
    assert_ledger_whole(run_dir, steps)
    record = json.loads((run_dir / "ledger-rolled-back" / "0001" / "RESUMED.json").read_text())
    assert record["resumed_from_step"] == 10 and record["files"]  # step 11's events set aside
    # the same name again is refused, with the command that continues it
    refused = subprocess.run(
        [sys.executable, "-m", "sluice.flows.cli", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "sluice resume smoke" in refused.stderr


# Slow tier (make test-slow), to keep make test within its time.
@pytest.mark.slow
def test_a_failure_before_the_step_0_checkpoint_starts_the_run_again(tmp_path, shared_cache):
    """Nothing has been trained yet: the segment's retry starts from the beginning."""
    steps = 4
    faults = tmp_path / "faults"
    faults.mkdir()
    job = Job(
        smoke_args(tmp_path, shared_cache, "mode=async", f"train.steps={steps}"),
        tmp_path / "job.log",
        # Three failed writes in the whole run: the step-0 checkpoint task and both its
        # retries fail, so its segment fails; the segment's retry writes it.
        env={"SLUICE_FAULTS": "checkpoint.write=3", "SLUICE_FAULTS_DIR": str(faults)},
    )
    try:
        assert job.finish() == 0, job.output()[-4000:]
    finally:
        job.stop()
    out = job.output()
    assert "Retries are exhausted" in out
    assert "starting again from the beginning" in out
    # One console line per failure; the tracebacks are in the run's log file.
    assert "Traceback" not in out
    log = (tmp_path / "runs" / "smoke" / "run.log").read_text()
    assert "Traceback (most recent call last)" in log and "InjectedFault" in log
    assert f"step    {steps}/{steps}" in out
    assert sorted(p.name for p in faults.iterdir()) == [f"checkpoint.write.{i}" for i in range(3)]
    assert_ledger_whole(tmp_path / "runs" / "smoke", steps)


def test_a_worker_that_dies_during_an_evaluation_is_left_out_and_restarted(tmp_path, shared_cache):
    """The first held-out generation of the run ends its worker's process (the step-0
    evaluation, before any checkpoint): the other worker takes its prompts and the run goes
    on without a segment retry; the next batch's call to the dead worker waits for Ray's
    restart of it, which then generates its shares of every batch (``sync`` waits for both
    workers to be placed before it evaluates, so two are there to share the work)."""
    steps = 4
    faults = tmp_path / "faults"
    faults.mkdir()
    job = Job(
        smoke_args(
            tmp_path,
            shared_cache,
            "mode=sync",
            f"train.steps={steps}",
            "rollout.workers=2",
            "eval.every=2",
        ),
        tmp_path / "job.log",
        env={"SLUICE_FAULTS": "worker.evaluate=1", "SLUICE_FAULTS_DIR": str(faults)},
    )
    try:
        assert job.finish() == 0, job.output()[-4000:]
    finally:
        job.stop()
    out = job.output()
    assert "died during the held-out evaluation" in out, out[-4000:]
    assert "its 16 prompts run on the others" in out  # half of the 32 held-out prompts
    assert "step    0/4 | held-out" in out
    assert "starting again from the beginning" not in out and "Retry" not in out
    assert f"step    {steps}/{steps}" in out
    assert [p.name for p in faults.iterdir()] == ["worker.evaluate.0"]
    table = Ledger((tmp_path / "runs" / "smoke").as_uri()).read()
    assert check_exactly_once(table, finished=True) == [] and check_versions(table) == []
    assert summarize(table)["final"]["trained"] == steps * SAMPLES_PER_STEP
