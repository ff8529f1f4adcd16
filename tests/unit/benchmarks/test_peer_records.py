"""benchmarks/peer_trl.py's round records: a finished round read back is the round that was
measured, and a record is reused only for the commit, plan and systems it measured."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.peer_trl import (
    TRL_LABEL,
    Kept,
    Measured,
    Plan,
    kept_round,
    load_round,
    save_round,
    table,
)
from benchmarks.series import Phase, Series

PLAN = Plan(steps=3, every=2, prompts=256, seed=1)


def _round() -> dict[str, Measured]:
    sluice = Series(
        "Sluice async",
        [1.0, 1.5, 2.0],
        [64.0, 64.0, 64.0],
        [900.0, 950.0, 1000.0],
        {1: 0.1, 2: 0.2},
        {0: 0.25, 2: 0.5},
        phases=[Phase("trainer", "step", [(0.0, 0.5), (0.1, 0.4), (0.2, 0.6)])],
        staleness={0: 64, 1: 128},
        loop=(1000.0, 1010.0),
    )
    trl = Series(TRL_LABEL, [3.0, 3.0, 3.0], [64.0] * 3, [800.0] * 3, {}, {0: 0.25, 2: 0.3})
    return {
        "Sluice async": Measured(sluice, 0.5, 40.0, (1.0, 1.5), 1.8),
        TRL_LABEL: Measured(trl, 0.3, 60.0, (1.5, 2.0), 2.0),
    }


def test_a_kept_round_reads_back_as_it_was_measured(tmp_path):
    kept = Kept(
        "abc1234",
        PLAN,
        ["async"],
        _round(),
        0.31,
        2,
        {1: 1.1, 2: None},
        "2026-11-29 01:30",
        [TRL_LABEL, "Sluice async"],  # seed 1: TRL ran first
        "`.venv/bin/python -m benchmarks.peer_trl --rounds 2`",
    )
    path = tmp_path / "round-1-3steps.json"
    save_round(path, kept)
    back = load_round(path)
    assert back == kept
    assert table([back.round], 0.03, [0.31], PLAN) == table([kept.round], 0.03, [0.31], PLAN)


def test_a_record_is_reused_only_for_its_commit_plan_and_systems(tmp_path):
    kept = Kept("abc1234", PLAN, ["async"], _round(), 0.31, 2, {}, "2026-11-29 01:30")
    path = tmp_path / "round.json"
    assert kept_round(path, "abc1234", PLAN, ["async"]) is None  # nothing kept yet
    save_round(path, kept)
    assert kept_round(path, "abc1234", PLAN, ["async"]) == kept
    assert kept_round(path, "def5678", PLAN, ["async"]) is None
    assert kept_round(path, "abc1234", replace(PLAN, prompts=1024), ["async"]) is None
    assert kept_round(path, "abc1234", PLAN, ["sync", "async"]) is None
