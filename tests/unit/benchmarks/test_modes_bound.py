"""benchmarks/modes.py: the pipeline bound taken from the sync run, and the ratios to it,
paired round by round."""

from dataclasses import replace

import pytest

from benchmarks.modes import bound_line, median_result, paired, pipeline_bound, render
from benchmarks.records import Record

SYNC = {"samples_per_s": 128.0, "step_s": 1.0, "trainer_idle": 0.6}


def test_the_bound_is_a_step_of_samples_over_the_slower_of_generation_and_training():
    generation, training, bound = pipeline_bound(SYNC)
    assert (generation, training) == pytest.approx((0.6, 0.4))  # the trainer idled 60%
    assert bound == pytest.approx(128 / 0.6)


def test_async_variants_are_given_against_the_bound_and_one_step():
    results = {
        "sync": [SYNC],
        "one_step": [{"samples_per_s": 200.0}],
        "async k=2": [{"samples_per_s": 160.0}],
    }
    line = bound_line(results)
    assert "213.3 samples/s" in line
    assert "async k=2 0.75 of it and 0.80x one_step (at least one_step in 0 of 1 rounds)" in line
    assert bound_line({"async k=2": [{"samples_per_s": 1.0}]}) == ""  # no sync: no bound


def test_rounds_are_paired_and_reported_as_median_and_range():
    fast_sync = {**SYNC, "samples_per_s": 256.0}  # round 2's machine was twice as fast
    results = {
        "sync": [SYNC, fast_sync, SYNC],
        "one_step": [{"samples_per_s": 200.0}, {"samples_per_s": 400.0}, {"samples_per_s": 210}],
        "async k=2": [{"samples_per_s": 220.0}, {"samples_per_s": 380.0}, {"samples_per_s": 200}],
        "async k=2, ablation": [{"samples_per_s": 150.0}],  # ran in the first round only
    }
    assert paired(results, "one_step", "sync") == pytest.approx([200 / 128, 400 / 256, 210 / 128])
    assert paired(results, "async k=2, ablation", "sync") == pytest.approx([150 / 128])
    line = bound_line(results)
    # Bounds 213.3, 426.7, 213.3: async k=2 is 1.03, 0.89 and 0.94 of its round's.
    assert "async k=2 0.94 (0.89-1.03) of it and 0.95x (0.95-1.10) one_step" in line
    assert "(at least one_step in 1 of 3 rounds)" in line
    assert median_result(results["sync"])["samples_per_s"] == 128.0


def _result(samples_per_s: float, rollout_idle: float | None) -> dict:
    return {
        "samples_per_s": samples_per_s, "tokens_per_s": 10 * samples_per_s,
        "start_accuracy": 0.2, "end_accuracy": 0.3, "trainer_idle": 0.6,
        "rollout_idle": rollout_idle, "staleness": 0.0, "step_s": 1.0, "repacked": 0.0,
        "run": {"run": "x", "steps": [{"wall_s": 1.0}]},  # kept, not a column
    }  # fmt: skip


def test_the_section_is_rendered_from_the_rounds_its_record_holds():
    data = {
        "steps": 50,
        "seeds": [0, 1],
        "results": {
            "sync": [_result(128.0, None), _result(256.0, None)],
            "async k=2": [_result(192.0, 0.1), _result(256.0, 0.2)],
        },
    }
    made = Record.measured("modes", "Modes", render, data, ["torch"])
    text = replace(made, commit="abc1234").text()
    first, command = text.splitlines()[:2]
    assert " at commit abc1234 on " in first and "ran in 2 rounds (seeds 0, 1" in first
    assert command == f"Command: `make bench-modes` (`{made.command}`)."
    # paired ratios 1.5 and 1.0: median 1.25; rollout idle: a batch mode has none
    assert "| async k=2 | 224.0 | 2240 | 1.25 (1.00-1.50) | 1.000 | 0.60 | 0.15 |" in text
    assert "| sync | 192.0 | 1920 | 1.00 (1.00-1.00) | 1.000 | 0.60 | - |" in text
    assert median_result(data["results"]["sync"])["rollout_idle"] is None
