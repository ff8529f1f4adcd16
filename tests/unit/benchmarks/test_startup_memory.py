"""The start-up memory bench's arithmetic: the folder's float32 bytes and the table's
peaks above each rank's base (the launches themselves: `make bench-startup-memory`)."""

from __future__ import annotations

from dataclasses import replace

from safetensors.torch import load_file

from benchmarks.records import Record
from benchmarks.startup_memory import ENGINES, MIB, RANKS, float32_bytes, render, table


def _launches(per_rank: list[dict[str, int]]) -> list[dict]:
    """Every engine at every rank count, its ranks' records the first ``ranks`` of these."""
    return [
        {"engine": label, "ranks": n, "per_rank": per_rank[:n]}
        for label, _, _ in ENGINES
        for n in RANKS
    ]


def test_float32_bytes_count_every_stored_element_at_four_bytes(tiny_policy):
    stored = load_file(tiny_policy / "model.safetensors")
    assert float32_bytes(tiny_policy) == 4 * sum(t.numel() for t in stored.values())


def test_the_table_gives_the_worst_ranks_peak_above_its_base():
    weights = 100 * MIB
    ranks = {
        "base_bytes": 500 * MIB,
        "startup_peak_bytes": 550 * MIB,  # half the weights above its base
        "before_step_bytes": 550 * MIB,
        "step_peak_bytes": 750 * MIB,  # twice the weights: gradients and activations
        "before_checkpoint_bytes": 600 * MIB,
        "checkpoint_peak_bytes": 900 * MIB,  # three times the weights
        "before_resume_bytes": 900 * MIB,
        "resume_peak_bytes": 1000 * MIB,  # the weights once
    }
    worse = {**ranks, "startup_peak_bytes": 580 * MIB}
    rows = table(_launches([ranks, worse]), weights).splitlines()
    assert len(rows) == 2 + len(ENGINES) * len(RANKS)
    one, two = "| 50 MB (0.50x) | - | 200 MB", "| 80 MB (0.80x) | - | 200 MB"  # two: the worse
    assert f"{one} (2.00x) | 300 MB (3.00x) | 100 MB (1.00x) |" in rows[2]
    assert f"{two} (2.00x) | 300 MB (3.00x) | 100 MB (1.00x) |" in rows[3]


def test_the_start_up_peak_is_split_into_heap_and_mapped_files():
    weights = 100 * MIB
    rank = {
        "base_bytes": 500 * MIB,
        "base_anon_bytes": 300 * MIB,
        "base_file_bytes": 200 * MIB,
        "startup_peak_bytes": 700 * MIB,
        "startup_peak_anon_bytes": 450 * MIB,  # the heap rose 1.5 weights at its peak
        "startup_peak_file_bytes": 250 * MIB,  # the safetensors file's pages: half
        "after_startup_anon_bytes": 400 * MIB,  # and kept one
        **{f"{phase}_bytes": 0 for phase in ("before_step", "step_peak")},
        **{f"{phase}_bytes": 0 for phase in ("before_checkpoint", "checkpoint_peak")},
        **{f"{phase}_bytes": 0 for phase in ("before_resume", "resume_peak")},
    }
    row = table(_launches([rank, rank]), weights).splitlines()[2]
    assert "| 200 MB (2.00x) | 1.50x / 0.50x; 1.00x | 0 MB (0.00x) | 0 MB (0.00x) |" in row


def test_the_section_names_the_model_and_its_weights_from_the_record():
    rank = {
        "base_bytes": 0,
        "startup_peak_bytes": 513 * MIB,
        **{f"{phase}_bytes": 0 for phase in ("before_step", "step_peak", "before_checkpoint")},
        **{f"{phase}_bytes": 0 for phase in ("checkpoint_peak", "before_resume", "resume_peak")},
    }
    data = {"model": "smollm2-135m-instruct", "float32_bytes": 513 * MIB,
            "launches": _launches([rank, rank])}  # fmt: skip
    command = ".venv/bin/python -m benchmarks.startup_memory --model models/m --write"
    title = "Trainer memory at start-up"
    record = Record.measured("startup-memory", title, render, data, command=command)
    record = replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")
    text = record.text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{command}`" in first
    assert "`smollm2-135m-instruct`, float32 weights 513 MB, one thread a rank" in first
    assert "| torch (DDP) | 2 | 513 MB (1.00x) | - | 0 MB (0.00x) |" in text
