"""The published-scale cost model against its formulas, and the scale report on a small grid."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.records import Record
from benchmarks.sim_scale import POLICIES, render, report, run_grid, scenario
from sluice.sim.hardware import (
    H100,
    HBM_EFFICIENCY,
    QWEN_7B,
    QWEN_32B,
    TRAIN_MFU,
    costs_for,
    engine_concurrency,
    split,
)


def test_7b_decode_step_reads_the_weights_once():
    costs = costs_for(QWEN_7B, H100, mean_context=2000, train_accelerators=64)
    assert costs.decode_step_s == pytest.approx(15.2e9 / (3.35e12 * HBM_EFFICIENCY))
    # Per request: its KV cache (28 layers x 4 heads x 128 x K,V x bf16 per token) at the
    # context, plus 2N FLOPs at half of peak.
    kv = 28 * 4 * 128 * 2 * 2 * 2000 / (3.35e12 * HBM_EFFICIENCY)
    assert costs.decode_per_request_s == pytest.approx(kv + 2 * 7.6e9 / (989e12 * 0.5))
    assert costs.train_per_token_s == pytest.approx(8 * 7.6e9 / (989e12 * TRAIN_MFU))


def test_tensor_parallel_engines_split_weights_and_kv():
    one = costs_for(QWEN_32B, H100, 4000, 64)
    assert one.model_bytes == pytest.approx(2 * 32.8e9 / 2)
    # 2 x 80 GB minus 65.6 GB of weights, 90% of it for KV at 262 KB per token.
    fits = int((160e9 - 65.6e9) * 0.9 // (64 * 8 * 128 * 4 * 4000))
    assert engine_concurrency(QWEN_32B, H100, 4000) == fits


@pytest.mark.parametrize(("n", "share", "tp"), [(64, 0.43, 1), (256, 0.6, 2), (1024, 0.99, 2)])
def test_split_keeps_tp_multiples_and_a_trainer(n, share, tp):
    rollout, train = split(n, share, tp)
    assert rollout + train == n
    assert rollout % tp == 0
    assert train >= 8


def test_colocated_cells_use_every_accelerator_for_both():
    sc = scenario("32B", 256, "sync (colocated)", {"mode": "sync"}, steps=3)
    assert sc.cluster.rollout_accelerators == sc.cluster.train_accelerators == 256
    assert sc.cluster.instances == 128
    assert sc.costs.colocated_switch_s > 0


def test_the_report_is_rendered_from_its_record_with_a_row_per_policy_and_a_column_per_cell():
    grid = run_grid(steps=3, sizes=(64,), groups=32)
    data = {
        "steps": 3,
        "elapsed_s": 1.0,
        "grid": {n: {str(s): {k: c.kept() for k, c in row.items()} for s, row in by.items()}
                 for n, by in grid.items()},
        "full_run": {"steps": 100, "runs": [
            {"label": "sync (colocated)", "wall_s": 2.0, "cpu_s": 1.9, "trained": 8192,
             "events": 12345}]},
    }  # fmt: skip
    made = Record.measured("simulator-scale", "t", render, data, ["numpy"])
    record = replace(made, commit="abc1234")
    text = record.text()
    assert text.startswith("Measured ") and " at commit abc1234 on " in text.splitlines()[0]
    assert text == report(record, grid, steps=3, elapsed=1.0) + "\n\n" + (
        "A full 7B run at 1024 accelerators (100 steps) simulated in: sync (colocated): 2.0 s "
        "wall, 1.9 s CPU for 8,192 trained samples (12,345 events)."
    )  # the cells read back from the record render as the simulated ones
    for label, _ in POLICIES:
        assert f"| {label} |" in text
    assert "| policy | 7B x64 | 32B x64 |" in text
    assert "| sync (colocated) | 1.00 | 1.00 |" in text
