"""benchmarks/kill_resume.py: the "Rollouts in flight across a kill and resume" section is
rendered from its record alone."""

from dataclasses import replace

from benchmarks.kill_resume import render
from benchmarks.records import Record

COMMAND = ".venv/bin/python -m benchmarks.kill_resume --steps 30 --every 10 --kill-at 11 --write"


def _measured(kept: int, kept_tokens: int, started_over: int) -> dict:
    """One run's numbers as ``benchmarks.kill_resume.measure`` gives them."""
    return {
        "trained": 3840, "mean": 127.64, "p50": 130.0, "p90": 150.4, "max": 160.0,
        "kept_samples": kept, "kept_tokens": kept_tokens,
        "continued_samples": kept, "continued_tokens": kept_tokens,
        "stored_samples": 0, "started_over": started_over,
        "after_samples": 3, "after_tokens": 381,
    }  # fmt: skip


def _record() -> Record:
    runs = [
        {"label": "no kill", "kill_at": 0, "keep_in_flight": True, "wall_s": 137.2,
         "measured": _measured(0, 0, 0)},
        {"label": "killed, kept", "kill_at": 11, "keep_in_flight": True, "wall_s": 172.6,
         "measured": _measured(192, 10_951, 0)},
        {"label": "killed, not kept", "kill_at": 11, "keep_in_flight": False, "wall_s": 163.0,
         "measured": _measured(0, 0, 32)},
    ]  # fmt: skip
    data = {"steps": 30, "every": 10, "kill_at": 11, "runs": runs}
    title = "Rollouts in flight across a kill and resume"
    record = Record.measured("kill-resume", title, render, data, command=COMMAND)
    return replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_the_section_names_the_commit_and_command_and_a_row_per_run():
    text = _record().text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{COMMAND}`: `configs/agentic.yaml`" in first
    assert "once step 11 is logged and continue with `sluice resume` from step 10." in first
    assert (
        "| killed, kept | 3,840 | 127.6 | 130 | 150 | 160 | 192 (10,951) | 192 (10,951) | 0 "
        "| 0 | 3 (381) | 173 |" in text
    )
    assert "| killed, not kept | 3,840 | 127.6 | 130 | 150 | 160 | - | - | - | 32 | 3 (381) |" in (
        text
    )
    assert text.splitlines()[-1].startswith("Kept: the samples in flight at the checkpoint")
