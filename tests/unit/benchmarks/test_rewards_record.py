"""benchmarks/rewards.py: the "Isolated rewards" section is rendered from its record alone."""

from dataclasses import replace

from benchmarks.records import Record
from benchmarks.rewards import render

COMMAND = ".venv/bin/python -m benchmarks.rewards --steps 200 --repeats 3 --write"


def _run(samples_per_s: float, end_accuracy: float) -> dict:
    """A run as ``benchmarks.rewards.run`` keeps it, its ``run_record`` cut to one step."""
    steps = [{"wall_s": 0.4, "samples": 128, "tokens": 900, "trainer_wait_s": 0.1,
              "staleness": {"1": 128}}]  # fmt: skip
    record = {"run": "bench", "mode": "async", "samples_per_s": samples_per_s, "steps": steps,
              "heldout": {"0": 0.2, "200": end_accuracy}}  # fmt: skip
    return {"end_accuracy": end_accuracy, "run": record}


def _record() -> Record:
    data = {
        "steps": 200,
        "repeats": 3,
        "micro_us": {
            "in-process verifier": [13.0, 13.2, 12.8],
            "isolated reward function": [30.0, 28.0, 39.0],
        },
        "runs": {
            "in-process verifier": [_run(300.0, 0.42), _run(290.0, 0.41), _run(310.0, 0.45)],
            "isolated reward function": [_run(264.0, 0.4), _run(240.0, 0.38), _run(270.0, 0.44)],
        },
    }
    record = Record.measured("rewards", "Isolated rewards", render, data, command=COMMAND)
    return replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_the_section_names_the_commit_and_command_and_rebuilds_the_table():
    record = _record()
    text = record.text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{COMMAND}`" in first
    assert "3 interleaved rounds of groups of 8" in first
    assert "`configs/default.yaml` for 200 async steps, 3 runs of each path" in first
    assert record.render == "benchmarks.rewards:render"
    # medians (min-max); the ratio is 264 / 300, the medians' samples/s
    assert (
        "| in-process verifier | 13.0 (12.8-13.2) | 300.0 (290.0-310.0) | 1.000 "
        "| 42.0 (41.0-45.0) |" in text
    )
    assert (
        "| isolated reward function | 30.0 (28.0-39.0) | 264.0 (240.0-270.0) | 0.880 "
        "| 40.0 (38.0-44.0) |" in text
    )
