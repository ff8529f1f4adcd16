"""The GPU trainer bench's rows: GPU peaks against the float32 weights ("-" where a run had
no GPU), the host's start-up peak above its base, and the sample rows it trains on (the
launches themselves: `make bench-gpu-trainer` on a GPU machine)."""

from __future__ import annotations

from benchmarks.gpu_trainer import MIB, ROWS, VOCAB, long_samples, table

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
