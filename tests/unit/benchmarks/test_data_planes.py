"""benchmarks/data_planes.py: its table pairs each ratio's rounds and gives median (min-max)."""

from benchmarks.data_planes import VARIANTS, store_table


def test_ratios_are_paired_within_a_round_and_shown_as_median_and_range():
    rounds = {
        "store": [100.0, 200.0, 300.0],
        "store+file": [80.0, 90.0, 150.0],
        "queue": [10.0, 20.0, 30.0],
        "queue, blocks": [50.0, 100.0, 100.0],
        "queue, pipelined": [100.0, 100.0, 100.0],
    }
    assert set(rounds) == set(VARIANTS)
    row = {"row_kb": 4, "samples": 4096, "row_bytes": 4000, **rounds}
    header, _, line = store_table([row]).splitlines()
    assert header.startswith("| row size | rows | store samples/s")
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:2] == ["4 KB", "4096"]
    assert cells[2] == "200 (1 MB/s)"  # the store's median round
    # store+file / queue, pipelined: 0.8, 0.9, 1.5; store / queue, blocks: 2.0, 2.0, 3.0;
    # store / queue: 10 every round.
    assert cells[-3:] == ["0.9x (0.8-1.5)", "2.0x (2.0-3.0)", "10.0x (10.0-10.0)"]
