"""The simulator's out-of-sample table (benchmarks/sim_holdout.py, BENCHMARKS.md "Simulator:
out of sample") is what the committed, frozen profile predicts: every prediction simulated
again from the recorded scenario, with the profile's costs; and the frozen fit itself."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.records import newest
from benchmarks.sim_holdout import ROLLOUT_COSTS, simulated_ratio
from benchmarks.sim_profile import FIT_VARIANT
from sluice.sim.calibrate import frozen_bounds, load_profile, refit_round

PROFILE = load_profile("cpu2core")
RECORD = newest("simulator-holdout")
RERUN = "the profile changed after the out-of-sample table was measured: `make bench-sim-holdout`"


def test_there_is_an_out_of_sample_record():
    assert RECORD is not None, "run `make bench-sim-holdout`"
    configs = {r["config"].split(",")[0] for r in RECORD.data["rows"]}
    assert configs == {"long tail", "default workload"}


@pytest.mark.parametrize("row", RECORD.data["rows"] if RECORD else [], ids=lambda r: r["config"])
def test_each_prediction_is_the_frozen_profiles(row):
    frozen = PROFILE.costs.model_dump()
    assert row["baseline"]["costs"] == frozen, RERUN
    # two engines share the rollout accelerator: each pays twice its own costs
    share = row["scenario"]["cluster"]["rollout_accelerators"]
    for key, value in row["scenario"]["costs"].items():
        if frozen[key] is None:
            assert value is None, (key, RERUN)
            continue
        expected = frozen[key] * share if key in ROLLOUT_COSTS else frozen[key]
        assert value == pytest.approx(expected, rel=1e-12), (key, RERUN)
    assert simulated_ratio(row["scenario"], row["baseline"]) == pytest.approx(
        row["predicted"], rel=1e-9
    ), RERUN
    assert row["error"] == pytest.approx(row["predicted"] / statistics.median(row["measured"]) - 1)


def test_the_frozen_fit_lies_within_its_frozen_bounds():
    low, high = frozen_bounds(PROFILE)
    assert "stream_factor_bounds" in PROFILE.calibration
    assert low < PROFILE.calibration["stream_factor"] < high


def _medians() -> dict[str, dict[str, float]]:
    """The profile's own measurement, as the rows ``refit_round`` takes."""
    modes = PROFILE.calibration["modes"]
    return {
        label: {**modes[label], "samples_per_s": PROFILE.measured[label]}
        for label in ("sync", "one_step", FIT_VARIANT)
    }


def test_refitting_the_profiles_own_measurement_gives_its_factors():
    fit = refit_round(PROFILE, _medians(), FIT_VARIANT)
    assert fit.train_overlap == pytest.approx(PROFILE.costs.train_overlap_factor, rel=1e-9)
    assert fit.stream_factor == pytest.approx(PROFILE.calibration["stream_factor"], rel=1e-4)


def test_a_round_no_factor_within_the_bounds_fits_gives_none():
    rows = _medians()
    rows[FIT_VARIANT] = {**rows[FIT_VARIANT], "samples_per_s": 0.2 * rows["sync"]["samples_per_s"]}
    assert refit_round(PROFILE, rows, FIT_VARIANT).stream_factor is None
