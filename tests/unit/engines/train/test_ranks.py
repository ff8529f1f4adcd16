"""The training pool's ranks: token-balanced shares, and collectives that time out."""

from __future__ import annotations

import subprocess
import sys

from sluice.engines.train.ranks import free_port, shares


def test_shares_balance_tokens_and_cover_every_row_once():
    lengths = [90, 12, 14, 11, 13, 80, 10, 15, 12, 9]
    split = shares(lengths, 2)
    assert sorted(row for rows in split for row in rows) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in rows) for rows in split]
    assert abs(loads[0] - loads[1]) <= max(
        lengths[i] for i in range(len(lengths)) if i not in (0, 5)
    )
    # dealing rows by count instead would give one rank both long answers: 90 + 80 + ...
    assert {0, 5} not in [set(rows) & {0, 5} for rows in split]
    assert all(rows == sorted(rows) for rows in split)  # batch order within a share


def test_a_pool_larger_than_the_batch_leaves_ranks_empty_not_doubled():
    assert shares([5, 7], 3) == [[1], [0], []]
    assert shares([4, 4, 4], 1) == [[0, 1, 2]]


RANK = """
import sys, torch
from sluice.engines.train.ranks import Rendezvous, join, all_sum
rank, port = int(sys.argv[1]), int(sys.argv[2])
join(Rendezvous("127.0.0.1", port, rank, 2), timeout_s=3)
if rank == 1:
    sys.stdin.read()  # joined, then hangs: never reaches the collective
else:
    all_sum([1.0], torch.device("cpu"))
"""


def test_a_collective_with_a_hung_rank_fails_after_the_timeout():
    port = free_port()
    hung = subprocess.Popen(
        [sys.executable, "-c", RANK, "1", str(port)], stdin=subprocess.PIPE, text=True
    )
    try:
        waiting = subprocess.run(
            [sys.executable, "-c", RANK, "0", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert waiting.returncode != 0
        assert "Timed out waiting 3000ms" in waiting.stderr, waiting.stderr[-3000:]
    finally:
        hung.kill()  # by its handle: the process this test started
        hung.wait()
