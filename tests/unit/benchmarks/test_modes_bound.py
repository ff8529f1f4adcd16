"""benchmarks/modes.py: the pipeline bound taken from the sync run, and the ratios to it,
paired round by round."""

import pytest

from benchmarks.modes import bound_line, median_result, paired, pipeline_bound

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
