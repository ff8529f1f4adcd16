"""Calibration: costs recovered from a run's files, the fit of the profile's two fitted
costs, and the committed profile reproducing the variant it was fitted to. The held-out
variants are compared with a fresh measurement in tests/bench/test_sim_calibration_fresh.py
(``make bench-modes``)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sluice.sim.calibrate import (
    CalibrationError,
    calibration_rows,
    derive_costs,
    load_profile,
    measure_run,
    nonnegative_fit,
    predict,
    train_overlap,
)
from sluice.storage.schema import batch_from_rows

PROFILE = load_profile("cpu2core")


@pytest.fixture(scope="module")
def predictions():
    return {p.variant: p for p in predict(PROFILE)}


def test_the_fitted_variant_is_reproduced(predictions):
    fitted = PROFILE.calibration["stream_factor_fitted_to"]
    assert abs(predictions[fitted].error) < 0.01


def test_nonnegative_fit_drops_a_negative_column():
    x = np.array([[1.0, 1.0, 0.0], [1.0, 2.0, 1.0], [1.0, 3.0, 0.0], [1.0, 4.0, 1.0]])
    y = 0.5 + 2.0 * x[:, 1] - 0.3 * x[:, 2]  # the third cost would come out negative
    coef = nonnegative_fit(x, y)
    assert coef[2] == 0.0
    assert (coef >= 0).all()


def test_train_overlap_is_the_ratio_of_trainer_busy_times():
    assert train_overlap(1.0, 0.5, 0.6, 0.0) == pytest.approx(1.2)
    assert train_overlap(1.0, 0.5, 0.4, 0.0) == 1.0  # never below 1
    with pytest.raises(CalibrationError):
        train_overlap(1.0, 1.0, 0.5, 0.0)


def _fake_sync_run(folder: Path, a: float, b: float, c0: float, fixed: float, per: float) -> None:
    """A run folder as a sync run leaves it, with times that follow the cost model exactly."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"mlflow_run_id": "r1"}))
    db = sqlite3.connect(folder.parent / "mlflow.db")  # one database per root of runs
    db.execute("CREATE TABLE metrics (key TEXT, step INTEGER, value REAL, run_uuid TEXT)")
    rows, now = [], datetime.now(UTC)
    for step in range(1, 21):
        lengths = rng.integers(1, 60, size=(4, 2))
        for g, group in enumerate(lengths):
            for j, n in enumerate(group):
                rows.append(
                    {
                        # as driver/batch.py tags a sync step's groups: r<step>w<worker>.<place>
                        "sample_id": f"p{g}@r{step}w0.{g}/{j}",
                        "prompt_id": f"p{g}",
                        "group_id": f"p{g}@r{step}w0.{g}",
                        "env": "addition",
                        "prompt_ids": [1] * (3 + g),
                        "response_ids": [7] * int(n),
                        "behaviour_logprobs": [-0.5] * int(n),
                        "token_versions": [0] * int(n),
                        "reward": 1.0,
                        "advantage": 0.0,
                        "prompt_len": 3 + g,
                        "response_len": int(n),
                        "status": "scored",
                        "generated_at": now,
                        "scored_at": now,
                    }
                )
        tokens = int(lengths.sum()) + 2 * sum(3 + g for g in range(4))
        values = {
            "perf/rollout_s": c0 + a * lengths.max() + b * lengths.sum(),
            "perf/train_s": fixed + per * tokens,
            "perf/weight_sync_s": 0.03,
            "train/publish_s": 0.001,
        }
        db.executemany(
            "INSERT INTO metrics VALUES (?, ?, ?, ?)",
            # another run in the same database, with other times: must not be mixed in
            [
                (k, step, v * scale, run)
                for run, scale in (("r1", 1), ("r2", 9))
                for k, v in values.items()
            ],
        )
    db.commit()
    db.close()
    (folder / "trajectories").mkdir()
    pq.write_table(
        pa.Table.from_batches([batch_from_rows(rows)]), folder / "trajectories" / "a.parquet"
    )


def test_costs_are_recovered_from_a_runs_files(tmp_path):
    _fake_sync_run(tmp_path / "run", a=0.002, b=1e-4, c0=0.15, fixed=0.2, per=1.5e-4)
    run = measure_run(tmp_path / "run")
    assert len(run.steps) == 20
    assert len(run.groups) == 80
    costs, sources = derive_costs(run, None)
    assert costs.decode_step_s == pytest.approx(0.002, rel=1e-6)
    assert costs.decode_per_request_s == pytest.approx(1e-4, rel=1e-6)
    assert costs.batch_overhead_s == pytest.approx(0.15, rel=1e-6)
    assert costs.group_overhead_s == pytest.approx(0.15 / 4, rel=1e-6)
    assert costs.train_step_s + costs.publish_s == pytest.approx(0.2, rel=1e-6)
    assert costs.train_per_token_s == pytest.approx(1.5e-4, rel=1e-6)
    assert costs.sync_latency_s == pytest.approx(0.03)
    assert "R^2 1.00" in sources["decode_step_s"]


def test_a_folder_without_a_run_is_refused(tmp_path):
    with pytest.raises(CalibrationError, match="finished sync run"):
        measure_run(tmp_path)


def test_the_calibration_section_is_rendered_from_its_record(predictions):
    from benchmarks.records import Record
    from benchmarks.sim_calibration import render

    rows = calibration_rows(PROFILE)
    assert [r["variant"] for r in rows] == list(predictions)
    data = {"profile": PROFILE.name, "notes": "fitted here", "rows": rows,
            "costs": PROFILE.costs.model_dump(), "stream_factor": 1.13}  # fmt: skip
    made = Record.measured("simulator-calibration", "t", render, data)
    text = replace(made, commit="abc1234").text()
    assert " at commit abc1234 on " in text.splitlines()[0]
    assert "profile `sim/profiles/cpu2core.json` (fitted here)" in text.splitlines()[0]
    fitted = PROFILE.calibration["stream_factor_fitted_to"]
    row = next(line for line in text.splitlines() if line.startswith(f"| {fitted} |"))
    assert "| yes |" in row
    assert f"{predictions[fitted].predicted_ratio:.2f}" in row
    assert "(isolated engine x 1.13)" in text
