"""The control plane's own deaths on a real ``async`` run: the trajectory store, relay 0
and the dispatcher each die twice in a row at a fault point (their process ends, as from a
kill) and Ray restarts them in place. The run goes on without a segment retry, and the
ledger shows every sample trained exactly once or dropped with a reason and no gap in
versions."""

from __future__ import annotations

import pytest

from tests.integration.test_faults import assert_ledger_whole, smoke_args
from tests.support.cli_job import Job

pytestmark = pytest.mark.integration

STEPS = 12
# Each fault point ends its process on two calls in a row, after letting some pass: the
# retried call meets the second death in the restarted process.
FAULTS = {"store.put": 3, "relay.handover": 3, "dispatcher.take": 10}


def test_the_store_relay_0_and_the_dispatcher_restart_in_place(tmp_path, shared_cache):
    (tmp_path / "faults").mkdir()
    env = {
        "SLUICE_FAULTS": ",".join(f"{point}=2@{skip}" for point, skip in FAULTS.items()),
        "SLUICE_FAULTS_DIR": str(tmp_path / "faults"),
    }
    settings = ["mode=async", f"train.steps={STEPS}", "checkpoint.every=100", "eval.every=100"]
    job = Job(smoke_args(tmp_path, shared_cache, *settings), tmp_path / "job.log", env)
    try:
        assert job.finish(timeout=600) == 0, job.output()[-4000:]
    finally:
        job.stop()
    out = job.output()
    fired = sorted(p.name for p in (tmp_path / "faults").iterdir() if ".call." not in p.name)
    assert fired == sorted(f"{point}.{i}" for point in FAULTS for i in (0, 1)), fired
    assert "resumed at step" not in out  # no segment was retried
    assert "the trajectory store restarted in place" in out
    assert "relay 0 restarted in place; the trainer published version" in out
    assert "the dispatcher restarted in place" in out
    assert_ledger_whole(tmp_path / "runs" / "smoke", STEPS)
