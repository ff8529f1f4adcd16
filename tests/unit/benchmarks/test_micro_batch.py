"""The micro-batch benchmark's batch has the long-tail workload's shape, and its table
reports each setting against the 4096-token one, with its tokens/s."""

import statistics

from benchmarks.engines import fixed_batch
from benchmarks.micro_batch import MAX_TOKENS, longtail_length, table


def test_batch_has_the_long_tail_shape():
    batch = fixed_batch(99, 0, response_len=longtail_length)
    lengths = batch.mask.sum(dim=1).tolist()
    assert len(lengths) == 128
    assert 15 <= statistics.median(lengths) <= 23  # configs/longtail.yaml: median 19
    assert max(lengths) <= MAX_TOKENS
    assert sorted(lengths)[-2] > 2 * statistics.median(lengths)  # a tail, not a spread


def test_table_rows_are_the_settings_in_order():
    results = {
        "1024": {"median": 0.45, "ratio": 0.77, "tokens_per_s": 9200.4},
        "4096": {"median": 0.59, "ratio": 1.0, "tokens_per_s": 7000.0},
    }
    text = table(results, fixed_batch(99, 0, response_len=longtail_length), repeats=3)
    assert "| 1024 | 0.450 | 0.77 | 9200 |" in text and "| 4096 | 0.590 | 1.00 | 7000 |" in text
    assert text.index("| 1024 |") < text.index("| 4096 |")
    assert "median of 3 steps" in text
