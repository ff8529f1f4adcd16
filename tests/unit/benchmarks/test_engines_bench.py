"""benchmarks/engines.py's section, rendered from its record: each engine against torch
paired round by round, its median step and quartiles, its build time."""

from dataclasses import replace

from benchmarks.engines import render
from benchmarks.records import Record

COMMAND = ".venv/bin/python -m benchmarks.engines --repeats 4 --warmup 1 --threads 1"


def _record(sizes: dict) -> Record:
    data = {
        "repeats": 4,
        "warmup": 1,
        "threads": 1,
        "batch_samples": 128,
        "one_time_s": 26.54,
        "load_average": [2.31, 1.04],
        "sizes": sizes,
    }
    title = "Training engines: torch vs DeepSpeed"
    record = Record.measured("engines", title, render, data, ["torch"], COMMAND)
    return replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_each_engine_is_paired_with_torch_in_its_round():
    size = {
        "params": 1_081_344,
        "build_s": {"torch": 0.021, "deepspeed ZeRO-1": 0.044},
        "step_s": {"torch": [1.0, 2.0, 3.0, 4.0], "deepspeed ZeRO-1": [2.0, 2.0, 3.0, 8.0]},
    }
    text = _record({"default (4 x 128)": size}).text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{COMMAND}`" in first
    assert "median of 4 steps per engine after 1 warm-up steps" in first
    assert "26.5 s, not in build s" in first and "2.3 at the start, 1.0 at the end" in first
    assert "| default (4 x 128) | 1.08M | torch | 1.00 | 2.500 | 1.250-3.750 | 0.02 |" in text
    # ratios 2, 1, 1, 2: their median, not the ratio of medians (2.5 / 2.5)
    assert "| deepspeed ZeRO-1 | 1.50 | 2.500 | 2.000-6.750 | 0.04 |" in text
