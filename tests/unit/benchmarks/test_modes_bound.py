"""benchmarks/modes.py: the pipeline bound taken from the sync run, and the ratios to it."""

import pytest

from sluice.benchmarks.modes import bound_line, pipeline_bound

SYNC = {"samples_per_s": 128.0, "step_s": 1.0, "trainer_idle": 0.6}


def test_the_bound_is_a_step_of_samples_over_the_slower_of_generation_and_training():
    generation, training, bound = pipeline_bound(SYNC)
    assert (generation, training) == pytest.approx((0.6, 0.4))  # the trainer idled 60%
    assert bound == pytest.approx(128 / 0.6)


def test_async_variants_are_given_against_the_bound_and_one_step():
    results = {
        "sync": SYNC,
        "one_step": {"samples_per_s": 200.0},
        "async k=2": {"samples_per_s": 160.0},
    }
    line = bound_line(results)
    assert "213.3 samples/s" in line
    assert "async k=2 0.75 of it and 0.80x one_step" in line
    assert bound_line({"async k=2": {"samples_per_s": 1.0}}) == ""  # no sync: no bound
