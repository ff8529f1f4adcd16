"""The control plane's own deaths on a real ``async`` run: the trajectory store, relay 0
and the dispatcher each die twice in a row at a fault point (their process ends, as from a
kill) and Ray restarts them in place. The run goes on without a segment retry, and the
ledger shows every sample trained exactly once or dropped with a reason and no gap in
versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_faults import assert_ledger_whole, smoke_args
from tests.support.cli_job import Job

pytestmark = pytest.mark.integration

STEPS = 12


def _run(tmp_path: Path, cache: Path, faults: str) -> str:
    (tmp_path / "faults").mkdir()
    env = {"SLUICE_FAULTS": faults, "SLUICE_FAULTS_DIR": str(tmp_path / "faults")}
    settings = ["mode=async", f"train.steps={STEPS}", "checkpoint.every=100", "eval.every=100"]
    job = Job(smoke_args(tmp_path, cache, *settings), tmp_path / "job.log", env)
    try:
        assert job.finish(timeout=600) == 0, job.output()[-4000:]
    finally:
        job.stop()
    out = job.output()
    fired = sorted(p.name for p in (tmp_path / "faults").iterdir() if ".call." not in p.name)
    point = faults.split("=")[0]
    assert fired == [f"{point}.0", f"{point}.1"], fired  # it died twice
    assert "resumed at step" not in out  # no segment was retried
    assert_ledger_whole(tmp_path / "runs" / "smoke", STEPS)
    return out


def test_the_trajectory_store_restarts_in_place(tmp_path, shared_cache):
    out = _run(tmp_path, shared_cache, "store.put=2@3")
    assert "trajectory store restarted in place" in out


def test_relay_0_restarts_in_place(tmp_path, shared_cache):
    out = _run(tmp_path, shared_cache, "relay.handover=2@3")
    assert "relay 0 restarted in place; the trainer published version" in out


def test_the_dispatcher_restarts_in_place(tmp_path, shared_cache):
    out = _run(tmp_path, shared_cache, "dispatcher.take=2@10")
    assert "the dispatcher restarted in place" in out
