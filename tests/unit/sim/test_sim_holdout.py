"""The simulator's out-of-sample table (benchmarks/sim_holdout.py, BENCHMARKS.md "Simulator:
out of sample") is what the committed, frozen profile predicts: every prediction simulated
again from the recorded workloads and policies, with the profile's costs; and the frozen fit
itself."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.records import newest
from benchmarks.sim_holdout import predict_rows
from benchmarks.sim_profile import FIT_VARIANT
from sluice.sim.calibrate import (
    ENGINE_COSTS,
    CalibrationError,
    frozen_bounds,
    load_profile,
    refit_round,
)

PROFILE = load_profile("cpu2core")
RECORD = newest("simulator-holdout")
RERUN = "the profile changed after the out-of-sample table was measured: `make bench-sim-holdout`"


def test_there_is_an_out_of_sample_record():
    assert RECORD is not None, "run `make bench-sim-holdout`"
    configs = {r["config"].split(",")[0] for r in RECORD.data["rows"]}
    assert configs == {"long tail", "default workload"}
    assert {r["workload"] for r in RECORD.data["rows"]} == set(RECORD.data["workloads"])


def test_the_predictions_were_made_with_the_frozen_profiles_costs():
    assert RECORD is not None
    assert RECORD.data["costs"] == PROFILE.costs.model_dump(), RERUN
    assert RECORD.data["workloads"]["long tail"] == PROFILE.scenario, RERUN


@pytest.mark.parametrize("row", RECORD.data["rows"] if RECORD else [], ids=lambda r: r["config"])
def test_each_prediction_is_the_frozen_profiles(row):
    assert RECORD is not None
    (again,) = predict_rows(PROFILE, RECORD.data["workloads"], [row])
    assert again["predicted"] == pytest.approx(row["predicted"], rel=1e-9), RERUN
    assert again["error"] == pytest.approx(row["error"], rel=1e-9)


def test_the_frozen_fit_lies_within_its_frozen_bounds():
    low, high = frozen_bounds(PROFILE)
    assert low < PROFILE.calibration["stream_factor"] < high


def test_a_profile_fitted_before_the_bounds_were_frozen_is_named():
    older = replace(PROFILE, calibration={"stream_factor": 1.0})
    with pytest.raises(
        CalibrationError, match=r"no calibration\.stream_factor_bounds.*sim-profile"
    ):
        frozen_bounds(older)


def test_engines_sharing_an_accelerator_each_pay_their_own_costs_that_many_times():
    frozen = PROFILE.costs.model_dump()
    one, two = PROFILE.tree({"mode": "sync"}), PROFILE.tree({"mode": "sync"}, engines=2)
    assert one["costs"] == frozen and one["cluster"] == PROFILE.scenario["cluster"]
    assert two["cluster"]["rollout_accelerators"] == 2
    for key, value in frozen.items():
        shared = value if value is None or key not in ENGINE_COSTS else 2 * value
        assert two["costs"][key] == shared, key
    assert frozen["decode_step_s"] and two["costs"]["decode_step_s"] == 2 * frozen["decode_step_s"]
    assert two["costs"]["train_overlap_factor"] == frozen["train_overlap_factor"]
    assert PROFILE.tree({"mode": "async"})["policy"]["mode"] == "async"


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
