"""The frozen simulator profile against fresh measurements of this machine (marker
``bench``, outside the default suite): the modes benchmark's ``runs/bench-modes/modes.json``
(not committed; ``make bench-modes`` runs this after measuring), and the out-of-sample record
of ``make bench-sim-holdout``, which runs it too. The profile is not re-fitted to either."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks.modes import paired
from benchmarks.records import newest
from sluice.sim.calibrate import load_profile, predict

pytestmark = pytest.mark.bench

ROOT = Path(__file__).parents[2]
MEASUREMENT = ROOT / "runs" / "bench-modes" / "modes.json"
PROFILE = load_profile("cpu2core")
HOLDOUT = newest("simulator-holdout")
# The bar: the calibrated simulator predicts this machine's ratios to sync within 20%.
TOLERANCE = 0.20


@pytest.fixture(scope="module")
def measured() -> dict[str, float]:
    """Each variant's ratio to sync in the fresh measurement: the median over the rounds,
    paired within a round (the modes table's "x sync")."""
    if not MEASUREMENT.is_file():
        pytest.skip(f"{MEASUREMENT} is missing: run `make bench-modes`")
    record = json.loads(MEASUREMENT.read_text())
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


@pytest.mark.parametrize("row", HOLDOUT.data["rows"] if HOLDOUT else [], ids=lambda r: r["config"])
def test_the_simulator_predicts_configurations_it_was_not_fitted_on(row):
    assert abs(row["error"]) <= TOLERANCE, (
        f"{row['config']}: predicted {row['predicted']:.2f}x sync, measured "
        f"{statistics.median(row['measured']):.2f}x ({100 * row['error']:+.0f}%)"
    )
