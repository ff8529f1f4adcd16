"""benchmarks/data_planes.py: its table pairs each ratio's rounds and gives median (min-max);
its section is rendered from its record."""

from dataclasses import replace

from benchmarks.data_planes import VARIANTS, render, store_table
from benchmarks.records import Record

ROUNDS = {
    "store": [100.0, 200.0, 300.0],
    "store+file": [80.0, 90.0, 150.0],
    "queue": [10.0, 20.0, 30.0],
    "queue, blocks": [50.0, 100.0, 100.0],
    "queue, pipelined": [100.0, 100.0, 100.0],
}


def test_ratios_are_paired_within_a_round_and_shown_as_median_and_range():
    assert set(ROUNDS) == set(VARIANTS)
    row = {"row_kb": 4, "samples": 4096, "row_bytes": 4000, **ROUNDS}
    header, _, line = store_table([row]).splitlines()
    assert header.startswith("| row size | rows | store samples/s")
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:2] == ["4 KB", "4096"]
    assert cells[2] == "200 (1 MB/s)"  # the store's median round
    # store+file / queue, pipelined: 0.8, 0.9, 1.5; store / queue, blocks: 2.0, 2.0, 3.0;
    # store / queue: 10 every round.
    assert cells[-3:] == ["0.9x (0.8-1.5)", "2.0x (2.0-3.0)", "10.0x (10.0-10.0)"]


def test_the_section_holds_both_tables_from_the_record():
    weights = {"size_mb": 4, "publish_s": 0.00015, "snapshot_s": 0.0009, "pull_s": 0.0091,
               "ratio": 0.016, "first_snapshot_s": 0.0072}  # fmt: skip
    data = {
        "block": 64,
        "rounds": 3,
        "repeats": 5,
        "store": [{"row_kb": 4, "samples": 4096, "row_bytes": 4000, **ROUNDS}],
        "weights": [weights],
    }
    command = ".venv/bin/python -m benchmarks.data_planes"
    record = Record.measured("data-planes", "Data planes", render, data, ["ray"], command)
    record = replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")
    text = record.text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{command}`" in first and ", ray " in first
    assert "Trajectories, blocks of 64 rows, 3 rounds;" in text
    assert "| 4 KB | 4096 | 200 (1 MB/s) |" in text
    assert "| 4 | 0.15 | 0.9 | 9.1 | 0.016 | 7.2 |" in text
    assert text.index("Trajectories") < text.index("Weights (publish holds the trainer")
