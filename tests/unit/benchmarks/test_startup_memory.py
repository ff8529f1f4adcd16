"""The start-up memory bench's arithmetic: the folder's float32 bytes and the table's
peaks above each rank's base (the launches themselves: `make bench-startup-memory`)."""

from __future__ import annotations

from safetensors.torch import load_file

from sluice.benchmarks.startup_memory import ENGINES, MIB, RANKS, float32_bytes, table


def test_float32_bytes_count_every_stored_element_at_four_bytes(tiny_policy):
    stored = load_file(tiny_policy / "model.safetensors")
    assert float32_bytes(tiny_policy) == 4 * sum(t.numel() for t in stored.values())


def test_the_table_gives_the_worst_ranks_peak_above_its_base():
    weights = 100 * MIB
    ranks = {
        "base_bytes": 500 * MIB,
        "startup_peak_bytes": 550 * MIB,  # half the weights above its base
        "before_checkpoint_bytes": 600 * MIB,
        "checkpoint_peak_bytes": 900 * MIB,  # three times the weights
        "before_resume_bytes": 900 * MIB,
        "resume_peak_bytes": 1000 * MIB,  # the weights once
    }
    worse = {**ranks, "startup_peak_bytes": 580 * MIB}
    results = {(label, n): [ranks, worse][:n] for label, _, _ in ENGINES for n in RANKS}
    rows = table(results, weights).splitlines()
    assert len(rows) == 2 + len(ENGINES) * len(RANKS)
    assert "| 50 MB (0.50x) | 300 MB (3.00x) | 100 MB (1.00x) |" in rows[2]  # one rank
    assert "| 80 MB (0.80x) | 300 MB (3.00x) | 100 MB (1.00x) |" in rows[3]  # two: the worse
