"""driver/step_log.py: the run's wall clock, the one the summary's throughput and the
benchmarks read."""

from __future__ import annotations

from types import SimpleNamespace

from sluice.driver.step_log import Totals


def test_the_clock_runs_from_the_first_steps_start_to_the_last_steps_end_less_evaluations(
    monkeypatch,
):
    now = SimpleNamespace(t=0.0)
    monkeypatch.setattr("sluice.driver.step_log.time", SimpleNamespace(monotonic=lambda: now.t))
    totals = Totals()
    now.t = 12.0
    totals.clock(started=10.0, eval_s=0.0)  # step 1: 10 s to 12 s
    now.t = 20.0  # step 2 began at 13 s: the second between (a checkpoint) counts too
    totals.clock(started=13.0, eval_s=3.0)  # and it evaluated for 3 s
    assert totals.loop_s == 2.0 + (20.0 - 12.0 - 3.0)
    assert totals.last_end == 20.0
