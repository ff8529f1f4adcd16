"""The bf16 bench's arithmetic: an update's gap as a fraction of the reference update's
norm, and the section rendered from its record (the launches themselves:
`make bench-bf16-ranks`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks.bf16_ranks import render, update_gap
from benchmarks.records import Record

COMMAND = ".venv/bin/python -m benchmarks.bf16_ranks --model models/m --write"


def _record(engines: list[dict]) -> Record:
    data = {
        "model": "smollm2-135m-instruct",
        "steps": 2,
        "lr": 1e-5,
        "bf16_losses": [0.50, 0.40],
        "float32_losses": [0.51, 0.38],  # largest gap 0.02
        "float32_update_gap": 0.7,
        "engines": engines,
    }
    record = Record.measured("bf16-ranks", "bf16 at two ranks", render, data, command=COMMAND)
    return replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_the_update_gap_is_the_difference_over_the_reference_updates_norm():
    start = {"a": torch.zeros(2), "b": torch.zeros(1)}
    want = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}  # moved by 5
    got = {"a": torch.tensor([3.0, 1.0]), "b": torch.tensor([4.0]).bfloat16()}  # 1 away
    assert update_gap(want, want, start) == 0.0
    assert update_gap(got, want, start) == pytest.approx(0.2)


def test_the_section_gives_each_engines_gaps_and_whether_they_stay_under_bf16s_own():
    ddp = {"engine": "torch (DDP)", "ranks": 2, "losses": [0.505, 0.40], "update_gap": 0.1}
    text = _record([ddp]).text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{COMMAND}`" in first
    assert "`smollm2-135m-instruct`, 2 steps of 8 samples at lr 1e-05" in first
    assert "| one torch process, float32 | 1 | 2.0e-02 | 0.700 |" in text
    assert "| torch (DDP) | 2 | 5.0e-03 | 0.100 |" in text
    assert text.endswith("(the float32 row: loss 2.0e-02, update 0.700): yes.")
    fsdp = {"engine": "fsdp (FSDP2)", "ranks": 2, "losses": [0.5, 0.4], "update_gap": 0.8}
    assert _record([ddp, fsdp]).text().endswith("update 0.700): no.")
