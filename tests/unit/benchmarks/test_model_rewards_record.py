"""benchmarks/model_rewards.py: the "Rewards from models" section is rendered from its
record alone: the serving table and the runs' rates, ratios and shares."""

from dataclasses import replace

from benchmarks.model_rewards import render, share
from benchmarks.records import Record

COMMAND = ".venv/bin/python -m benchmarks.model_rewards --steps 20 --repeats 2 --rounds 3 --write"


def _run(samples: int, wall_s: float, model_s: float) -> dict:
    """A run as ``benchmarks.model_rewards.run`` keeps it, two steps."""
    steps = [{"wall_s": wall_s / 2, "samples": samples // 2, "tokens": 900,
              "trainer_wait_s": 0.1, "staleness": {"1": samples // 2}}] * 2  # fmt: skip
    record = {"run": "bench", "mode": "async", "samples_per_s": 0.0, "steps": steps,
              "heldout": {"0": 0.0, "20": 0.0}}  # fmt: skip
    return {"run": record, "model_s": model_s}


def _record() -> Record:
    data = {
        "steps": 20,
        "repeats": 2,
        "rounds": 3,
        "serving": {
            "judge": {"samples_per_s": [17.0, 18.0, 16.0], "agreement": [0.5, 0.5, 0.5]},
            "reward model": {"samples_per_s": [54.0, 50.0, 56.0], "agreement": [1.0, 0.0, 0.5]},
        },
        "runs": {
            "judge": [_run(256, 20.0, 19.0), _run(256, 16.0, 15.0)],  # 12.8, 16 samples/s
            "reward model": [_run(256, 8.0, 6.0), _run(256, 8.0, 7.0)],  # 32 samples/s
            "verifier": [_run(256, 0.5, 0.0), _run(256, 0.5, 0.0)],  # 512 samples/s
        },
    }
    record = Record.measured("model-rewards", "Rewards from models", render, data, command=COMMAND)
    return replace(record, commit="abc1234", date="2026-12-01 01:00 UTC")


def test_the_section_names_the_commit_and_command_and_rebuilds_the_tables():
    record = _record()
    text = record.text()
    assert text.startswith("Measured 2026-12-01 at commit abc1234 on ")
    assert f"`{COMMAND}`" in text.splitlines()[0]
    assert record.render == "benchmarks.model_rewards:render"
    assert "| judge | 17.0 (16.0-18.0) | 50% (50-50) |" in text
    assert "| reward model | 54.0 (50.0-56.0) | - |" in text  # no verdict to agree with
    # the rate is the steps' samples over their wall clock; the ratio of the medians
    assert "| judge | 14.4 (12.8-16.0) | 0.03 | 94% (94-95) |" in text
    assert "| reward model | 32.0 (32.0-32.0) | 0.06 | 81% (75-88) |" in text
    assert "| verifier | 512.0 (512.0-512.0) | 1.00 | - |" in text


def test_the_share_is_the_model_seconds_over_the_steps_seconds():
    assert share(_run(256, 20.0, 5.0)) == 0.25
