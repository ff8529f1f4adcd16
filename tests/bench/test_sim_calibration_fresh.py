"""The calibrated simulator against a fresh measurement of this machine: the modes benchmark's
``runs/bench-modes/modes.json`` (not committed), which the profile's two fitted costs also
came from. ``make bench-modes`` runs this right after measuring (marker ``bench``); the
default suite leaves it out, since it needs that run."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks.modes import paired
from sluice.sim.calibrate import load_profile, predict

pytestmark = pytest.mark.bench

ROOT = Path(__file__).parents[2]
MEASUREMENT = ROOT / "runs" / "bench-modes" / "modes.json"
PROFILE = load_profile("cpu2core")
# The bar: the calibrated simulator predicts this machine's ratios to sync within 20%.
TOLERANCE = 0.20


@pytest.fixture(scope="module")
def measured() -> dict[str, float]:
    """Each variant's ratio to sync in the fresh measurement: the median over the rounds,
    paired within a round (the modes table's "x sync")."""
    assert MEASUREMENT.is_file(), f"{MEASUREMENT} is missing: run `make bench-modes`"
    record = json.loads(MEASUREMENT.read_text())
    stamp = PROFILE.calibration.get("measurement", {})
    assert (stamp.get("commit"), stamp.get("date")) == (record["commit"], record["date"]), (
        f"sim/profiles/cpu2core.json was fitted to the measurement of {stamp.get('date')} but "
        f"{MEASUREMENT} is from {record['date']}: run `make bench-modes`, which fits it anew"
    )
    return {
        label: statistics.median(paired(record["results"], label, "sync"))
        for label in record["results"]
    }


def held_out() -> list[str]:
    """The simulated variants no cost was fitted to (sync's ratio is 1 by definition)."""
    return [v for v in PROFILE.variants if v not in (*PROFILE.fitted, "sync")]


def test_the_async_variants_are_held_out():
    assert {"async k=1", "async k=2"} <= set(held_out())


@pytest.mark.parametrize("variant", held_out())
def test_the_simulator_predicts_the_fresh_measurement(measured, variant):
    (prediction,) = predict(PROFILE, [variant])
    ratio = measured[variant]
    error = prediction.predicted_ratio / ratio - 1.0
    assert abs(error) <= TOLERANCE, (
        f"{variant}: predicted {prediction.predicted_ratio:.2f}x sync, measured {ratio:.2f}x "
        f"({100 * error:+.0f}%)"
    )
