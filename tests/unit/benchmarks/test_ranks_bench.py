"""benchmarks/ranks.py's section, rendered from its record: a launch's step time is the
median of its steps after the warm-up, and each layout's speed-up over the engine's first is
paired by round."""

from dataclasses import replace

from benchmarks.ranks import render
from benchmarks.records import Record

COMMAND = ".venv/bin/python -m benchmarks.ranks --rounds 2 --write"


def _record(launches: list[dict]) -> Record:
    data = {
        "rounds": 2,
        "steps": 4,
        "warmup": 2,
        "batch_samples": 128,
        "load_average": [2.04, 1.46],
        "launches": launches,
    }
    record = Record.measured("ranks", "Training ranks", render, data, ["torch"], COMMAND)
    return replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_the_warm_up_steps_are_left_out_and_speed_ups_are_paired_by_round():
    launches = [
        # rounds' medians after two warm-up steps: 1.0 and 2.0
        {"engine": "torch (DDP)", "layout": "1 rank x 1 thread",
         "step_s": [[9.0, 9.0, 0.9, 1.1], [9.0, 9.0, 2.0, 2.0]]},
        # 0.5 and 2.0: speed-ups 2.0 and 1.0
        {"engine": "torch (DDP)", "layout": "2 ranks x 1 thread",
         "step_s": [[9.0, 9.0, 0.5, 0.5], [9.0, 9.0, 2.0, 2.0]]},
        {"engine": "fsdp (FSDP2)", "layout": "1 rank x 1 thread",
         "step_s": [[5.0, 5.0, 4.0, 4.0], [5.0, 5.0, 4.0, 4.0]]},
    ]  # fmt: skip
    text = _record(launches).text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{COMMAND}`" in first
    assert "2 rounds of launches, each the median of steps 3-4" in first
    assert "load average 2.0 before, 1.5 after" in first
    assert "| torch (DDP) | 1 rank x 1 thread | 1.500 | 1.000-2.000 | 1.00x |" in text
    assert "| torch (DDP) | 2 ranks x 1 thread | 1.250 | 0.500-2.000 | 1.50x |" in text
    assert "| fsdp (FSDP2) | 1 rank x 1 thread | 4.000 | 4.000-4.000 | 1.00x |" in text
