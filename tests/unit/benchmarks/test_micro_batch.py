"""The micro-batch benchmark's batch has the long-tail workload's shape, and its section,
rendered from its record, reports each setting against the 4096-token one, with its
tokens/s."""

import statistics
from dataclasses import replace

from benchmarks.engines import fixed_batch
from benchmarks.micro_batch import MAX_TOKENS, batch_shape, longtail_length, render
from benchmarks.records import Record


def test_batch_has_the_long_tail_shape():
    batch = fixed_batch(99, 0, response_len=longtail_length)
    lengths = batch.mask.sum(dim=1).tolist()
    assert len(lengths) == 128
    assert 15 <= statistics.median(lengths) <= 23  # configs/longtail.yaml: median 19
    assert max(lengths) <= MAX_TOKENS
    assert sorted(lengths)[-2] > 2 * statistics.median(lengths)  # a tail, not a spread


def _record(step_s: dict[str, list[float]]) -> Record:
    batch = batch_shape(fixed_batch(99, 0, response_len=longtail_length))
    data = {"repeats": 3, "warmup": 2, "batch": {**batch, "tokens": 9000}, "step_s": step_s}
    command = ".venv/bin/python -m benchmarks.micro_batch --repeats 3"
    record = Record.measured(
        "micro-batch", "Trainer micro-batches", render, data, ["torch"], command
    )
    return replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_the_batch_shape_counts_real_tokens_not_padding():
    batch = fixed_batch(99, 0, response_len=longtail_length)
    shape = batch_shape(batch)
    assert shape["samples"] == 128 and shape["row_min"] < shape["row_max"]
    assert shape["tokens"] == int(batch.attention_mask.sum()) < batch.attention_mask.numel()
    assert shape["response_tokens"] == int(batch.mask.sum())


def test_the_section_pairs_each_setting_with_4096_round_by_round():
    step_s = {"1024": [0.4, 0.5, 0.9], "4096": [0.8, 0.5, 0.6]}
    text = _record(step_s).text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert "`.venv/bin/python -m benchmarks.micro_batch --repeats 3`" in first
    assert "median of 3 steps per setting" in first and "(9000 in all)" in first
    # 1024: median 0.5 s, ratios 0.5, 1.0, 1.5 -> 1.00 (not 0.5 / 0.6), 9000 / 0.5 tokens/s
    assert "| 1024 | 0.500 | 1.00 | 18000 |" in text
    assert "| 4096 | 0.600 | 1.00 | 15000 |" in text
    assert text.index("| 1024 |") < text.index("| 4096 |")
