"""benchmarks/agentic.py: the "Agentic workload: modes" section is rendered from its record
alone, the ratios to sync, and a mode without a rollout idle fraction kept as such."""

import math
from dataclasses import replace

from benchmarks.agentic import quotes, render
from benchmarks.records import Record, keep, read

COMMAND = ".venv/bin/python -m benchmarks.agentic --steps 40 --write"


def _result(samples_per_s: float, rollout_idle: float, end_accuracy: float) -> dict:
    """One mode's numbers as ``benchmarks.modes.run_variant`` gives them."""
    return {
        "samples_per_s": samples_per_s,
        "tokens_per_s": 88 * samples_per_s,
        "start_accuracy": 0.672,
        "end_accuracy": end_accuracy,
        "trainer_idle": 0.11,
        "rollout_idle": rollout_idle,
        "staleness": 1.03,
        "step_s": 128 / samples_per_s,
        "repacked": 0.0,
    }


def _record() -> Record:
    runs = {
        "sync": _result(14.6, math.nan, 0.781),  # batch modes log no rollout idle fraction
        "one_step": _result(19.5, math.nan, 0.781),
        "async k=2": _result(40.1, 0.0, 0.766),
    }
    data = {"steps": 40, "runs": runs}
    record = Record.measured("agentic", "Agentic workload: modes", render, data, ["torch"],
                             command=COMMAND)  # fmt: skip
    return replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_the_section_names_the_commit_and_command_and_gives_ratios_to_sync():
    text = _record().text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{COMMAND}`: `configs/agentic.yaml`, 40 steps" in first
    assert "| sync | 14.6 | 1285 | 1.00 | 8.767 | 0.11 | - | 1.03 | 0 | 67.2% -> 78.1% |" in text
    # 40.1 / 14.6 = 2.75
    assert (
        "| async k=2 | 40.1 | 3529 | 2.75 | 3.192 | 0.11 | 0.00 | 1.03 | 0 | 67.2% -> 76.6% |"
        in text
    )


def test_the_kept_record_renders_the_same(tmp_path):
    record = _record()
    again = read(keep(record, tmp_path))
    assert again.data["runs"]["sync"]["rollout_idle"] is None  # NaN is kept as None
    assert again.text() == record.text()


def test_docs_quote_each_modes_samples_per_s_and_its_ratio_to_sync():
    got = quotes(_record())
    # 40.1 / 14.6 = 2.75, as the table writes it
    assert got["async-k-2.x-sync"] == "2.75x" and got["async-k-2.samples-per-s"] == "40.1"
    assert got["sync.x-sync"] == "1.00x" and got["one-step.samples-per-s"] == "19.5"
