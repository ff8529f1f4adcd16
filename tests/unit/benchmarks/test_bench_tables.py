"""benchmarks/tables.py: the paired ratios' mean and bootstrap interval."""

from __future__ import annotations

import pytest

from benchmarks.tables import bootstrap_interval, geometric_mean, paired_ratio


def test_the_geometric_mean_treats_a_ratio_and_its_inverse_alike():
    assert geometric_mean([2.0, 0.5]) == pytest.approx(1.0)
    assert geometric_mean([1.0, 4.0]) == pytest.approx(2.0)


def test_the_interval_lies_within_the_rounds_and_is_reproducible():
    ratios = [1.02, 1.19, 1.07, 0.98, 1.11]
    low, high = bootstrap_interval(ratios)
    assert min(ratios) <= low < geometric_mean(ratios) < high <= max(ratios)
    assert bootstrap_interval(ratios) == (low, high)  # seeded: a rebuilt table agrees
    assert bootstrap_interval([1.5] * 5) == (1.5, 1.5)


def test_two_rounds_resample_to_both_first_mixed_or_both_second():
    # With 10,000 draws each of (a, a) and (b, b) is a quarter: the 2.5% and 97.5% points.
    assert bootstrap_interval([2.0, 8.0]) == pytest.approx((2.0, 8.0))
    assert paired_ratio([2.0, 8.0]) == "4.00x [2.00-8.00]"
    assert paired_ratio([1.234]) == "1.23x"
