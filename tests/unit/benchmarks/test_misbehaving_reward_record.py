"""benchmarks/misbehaving_reward.py: the "Misbehaving rewards" section is rendered from its
record alone, the step times' statistics from each run's steps."""

from dataclasses import replace

from benchmarks.misbehaving_reward import render
from benchmarks.records import Record

COMMAND = ".venv/bin/python -m benchmarks.misbehaving_reward --steps 10 --repeats 1 --write"
WALL = [0.3, 0.1, 0.2, 1.0, 0.5, 0.4, 0.6, 0.9, 0.7, 0.8]  # median 0.55, 90th 0.99


def _run(scale: float, samples_per_s: float, failed: int) -> dict:
    """A run as ``benchmarks.misbehaving_reward.run`` keeps it; its steps take ``WALL``
    times ``scale`` seconds."""
    steps = [{"wall_s": scale * s, "samples": 128, "tokens": 900, "trainer_wait_s": 0.0,
              "staleness": {}} for s in WALL]  # fmt: skip
    record = {"run": "bench", "mode": "async", "samples_per_s": samples_per_s, "steps": steps,
              "heldout": {"0": 0.2, "10": 0.3}}  # fmt: skip
    return {"failed_samples": failed, "run": record}


def _record() -> Record:
    data = {
        "steps": 10,
        "repeats": 1,
        "runs": {"clean": [_run(1.0, 287.1, 0)], "misbehaving": [_run(10.0, 13.1, 303)]},
    }
    record = Record.measured(
        "misbehaving-rewards", "Misbehaving rewards", render, data, command=COMMAND
    )
    return replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_the_section_names_the_commit_and_command_and_each_runs_step_times():
    text = _record().text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{COMMAND}`: `configs/default.yaml` for 10 async steps a run" in first
    lines = text.splitlines()
    clean = "| the verifier as a reward function | 0.55 | 0.99 | 1.00 | 287.1 | 0 |"
    failing = "| one call in six fails | 5.50 | 9.90 | 10.00 | 13.1 | 303 |"
    assert lines.index(clean) < lines.index(failing)  # the clean reward's runs first
