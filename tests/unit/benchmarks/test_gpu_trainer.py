"""The GPU trainer bench's rows: GPU peaks against the float32 weights ("-" where a run had
no GPU), the host's start-up peak above its base, and the sample rows it trains on (the
launches themselves: `make bench-gpu-trainer` on a GPU machine)."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.gpu_trainer import MIB, ROWS, VOCAB, long_samples, render, shared_commit, table
from benchmarks.records import Record

GIB = 1024 * MIB


def _result(memory: dict[str, int]) -> dict:
    return {
        "shape": "0.5b",
        "float32_bytes": 2 * GIB,
        "engines": {
            "torch (DDP)": {
                "memory": memory,
                "linear_dtypes": ["torch.bfloat16"],
                "step_s": [2.0, 0.75],
                "loss_gap": 0.0,
                "update_gap": 0.0,
            }
        },
    }


def test_a_row_gives_each_phases_gpu_peak_against_the_float32_weights():
    memory = {
        "base_bytes": 1 * GIB,
        "startup_peak_bytes": 4 * GIB,  # 3 GiB above the base: 1.5x
        "gpu_startup_peak_bytes": 2 * GIB,
        "gpu_steps_peak_bytes": 12 * GIB,
        "gpu_checkpoint_peak_bytes": 6 * GIB,
        "gpu_resume_peak_bytes": 10 * GIB,
    }
    row = table([_result(memory)]).splitlines()[2]
    assert row == (
        "| 0.5b (2.0 GiB) | torch (DDP) | 2.00 GiB (1.00x) | 12.00 GiB (6.00x) "
        "| 6.00 GiB (3.00x) | 10.00 GiB (5.00x) | 3,072 MB (1.50x) | bfloat16 | 0.75 "
        "| 0.0e+00 | 0.000 |"
    )


def test_a_run_without_a_gpu_shows_no_gpu_peaks():
    row = table([_result({"base_bytes": 0, "startup_peak_bytes": GIB})]).splitlines()[2]
    assert row.count("| - ") == 4


def test_the_samples_are_seeded_token_ids_of_the_vocabulary():
    rows = long_samples(4, 6)
    assert rows == long_samples(4, 6)
    assert len(rows) == ROWS
    assert all(len(r.prompt_ids) == 4 and len(r.response_ids) == 6 for r in rows)
    assert all(3 <= t < VOCAB for r in rows for t in r.prompt_ids + r.response_ids)
    assert [r.advantage for r in rows[:2]] == [1.0, -1.0]


def test_the_section_names_each_shapes_run_and_device_from_the_record():
    run = {
        **_result({"base_bytes": 0, "startup_peak_bytes": GIB, "gpu_steps_peak_bytes": 4 * GIB}),
        "steps": 2,
        "tokens_per_step": 8192,
        "device": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "date": "2026-11-28",
        "commit": "0be8037",
    }
    command = ".venv/bin/python -m benchmarks.gpu_trainer --table-only --write"
    title = "The trainer on one GPU"
    record = Record.measured("gpu-trainer", title, render, {"runs": [run]}, command=command)
    record = replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")
    text = record.text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{command}`" in first
    assert "0.5b: 2026-11-28, commit 0be8037, NVIDIA H200, torch 2.11.0+cu130" in first
    assert "2 steps of 8,192 tokens (8 rows of 128 + 896)" in first
    assert "| 0.5b (2.0 GiB) | torch (DDP) | - | 4.00 GiB (2.00x) | - | - | 1,024 MB" in text


def test_the_record_names_the_runs_commit_when_they_share_one():
    assert shared_commit([{"commit": "0be8037"}, {"commit": "0be8037"}]) == "0be8037"
    assert shared_commit([{"commit": "0be8037"}, {"commit": "c3a0547"}]) is None
