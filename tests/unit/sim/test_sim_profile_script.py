"""benchmarks/sim_profile.py: Sluice's benchmark variants as simulator policies."""

from __future__ import annotations

import json

import pytest

from benchmarks.modes import VARIANTS
from benchmarks.sim_profile import modes_measurement, variants


def test_every_one_worker_benchmark_variant_becomes_a_policy_with_sluices_defaults():
    policies = variants()
    one_worker = [label for label, o in VARIANTS if not any("rollout.workers" in a for a in o)]
    assert list(policies) == one_worker and "async k=2, 2 workers" not in policies
    assert policies["sync"]["mode"] == "sync"
    assert policies["async k=4"] == {
        "mode": "async",
        "max_staleness": 4,
        "long_first": True,
        "balance": True,
        "partial_rollout": True,
    }
    off = policies["async k=2, dispatch off"]
    assert (off["long_first"], off["balance"]) == (False, False)
    assert policies["async k=2, no partial rollout"]["partial_rollout"] is False


def test_the_measurement_gives_each_variants_medians_over_its_rounds(tmp_path):
    def run(samples_per_s, staleness=0.0):
        return {
            "samples_per_s": samples_per_s,
            "step_s": 1.0,
            "trainer_idle": 0.5,
            "staleness": staleness,
        }

    record = {
        "commit": "abc1234",
        "date": "2026-11-26 21:00 UTC",
        "steps": 50,
        "seeds": [0, 1, 2],
        "sync_run": "runs/bench-modes/round-0/bench-sync",
        "results": {
            "sync": [run(100.0), run(120.0), run(90.0)],
            "one_step": [run(150.0), run(240.0), run(90.0)],  # 1.5x, 2x, 1x sync
            "async k=2": [run(150.0, 1.5)],
            "not a variant": [run(1.0)],
        },
    }
    (tmp_path / "modes.json").write_text(json.dumps(record))
    stamp, rows = modes_measurement(tmp_path / "modes.json")
    assert stamp["commit"] == "abc1234" and stamp["sync_run"].endswith("bench-sync")
    # The first round's sync, and each variant at its median ratio paired within a round.
    assert rows["sync"]["samples_per_s"] == 100.0
    assert rows["async k=2"] == {
        "samples_per_s": 150.0,  # ran once, beside the first round's sync
        "step_s": 1.0,
        "trainer_idle": 0.5,
        "mean_staleness": 1.5,
    }
    assert rows["one_step"]["samples_per_s"] == 150.0  # 100 x the median ratio 1.5
    assert rows["one_step"]["step_s"] == 1.0
    assert set(rows) == {"sync", "one_step", "async k=2"}


def test_a_missing_measurement_says_how_to_make_one(tmp_path):
    with pytest.raises(SystemExit, match="make bench-modes"):
        modes_measurement(tmp_path / "modes.json")
