"""benchmarks/peer_trl.py's round records: a finished round read back is the round that was
measured, and a record is reused only for the plan and systems it measured, with the code
it ran."""

from __future__ import annotations

from dataclasses import replace

from benchmarks import peer_trl
from benchmarks.peer_trl import (
    TRL_LABEL,
    Kept,
    Measured,
    Plan,
    kept_round,
    load_round,
    render,
    save_round,
    table,
)
from benchmarks.records import Record
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
        "Intel Xeon (AVX512)",
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


def test_a_round_kept_at_an_earlier_commit_is_reused_while_its_code_is_the_same(
    tmp_path, monkeypatch
):
    changes = {("abc1234", "def5678"): [], ("abc1234", "0123456"): ["storage/store.py"]}
    seen = []

    def code_changes(since, until, runs_with):
        seen.append(runs_with)
        return changes[since, until]

    monkeypatch.setattr(peer_trl, "code_changes", code_changes)
    kept = Kept("abc1234", PLAN, ["async"], _round(), 0.31, 2, {}, "2026-11-29 01:30")
    path = tmp_path / "round.json"
    save_round(path, kept)
    assert kept_round(path, "def5678", PLAN, ["async"]) == kept
    assert kept_round(path, "0123456", PLAN, ["async"]) is None
    assert seen == [peer_trl.RUNS_WITH] * 2
    assert "benchmarks/trl_grpo.py" in peer_trl.RUNS_WITH


def test_the_section_names_the_commits_and_cpus_of_rounds_that_differ_in_them():
    same = peer_trl._sittings([("abc1234", "Xeon (AVX512)")] * 2)
    assert same == ""
    line = peer_trl._sittings(
        [("abc1234", "Xeon (AVX512)"), ("abc1234", "EPYC (AVX2)"), ("def5678", "EPYC (AVX2)")]
    )
    assert line == (
        "; rounds by commit: abc1234 (round(s) 1, 2); def5678 (round(s) 3)"
        "; rounds by CPU: Xeon (AVX512) (round(s) 1); EPYC (AVX2) (round(s) 2, 3)"
        "; between those commits nothing the runs run changed "
        "(`benchmarks.report.code_changes`, `peer_trl.RUNS_WITH`)"
    )


def test_the_section_is_rendered_from_a_record_of_the_kept_rounds(tmp_path):
    command = "`.venv/bin/python -m benchmarks.peer_trl --rounds 2`"
    paths = []
    for seed in (0, 1):
        kept = Kept(
            "abc1234", replace(PLAN, seed=seed), ["async"], _round(), 0.31, 2, {1: 1.1},
            f"2026-11-29 0{seed}:30", [], command,
        )  # fmt: skip
        paths.append(tmp_path / f"round-{seed}.json")
        save_round(paths[-1], kept)
    data = {
        "config": "configs/longtail.yaml",
        "workload": {"prompts_per_step": 16, "samples_per_prompt": 8, "threads_per_worker": 1,
                     "train_threads": 1, "micro_batch_tokens": 4096},
        "gain": 0.03,
        "micro": False,
        "rounds": [str(p) for p in paths],
        "plots": ["benchmarks/plots/peer-trl-curves.png"],
    }  # fmt: skip
    made = Record.measured("peer-trl", "Against TRL", render, data, ["trl"], commit="abc1234")
    text = made.text()
    first = text.splitlines()[0]
    assert first.startswith(f"Measured {made.date.split()[0]} at commit abc1234 on ")
    assert "rounds finished 2026-11-29 00:30, 2026-11-29 01:30 UTC" in first
    assert "16 prompts x 8 completions each" in first and "2 round(s)" in first
    assert "Sluice's first in every round (kept before the order alternated)" in first
    assert text.splitlines()[1] == f"Command: {command}."
    rounds = [load_round(p).round for p in paths]
    assert table(rounds, 0.03, [0.31, 0.31], PLAN) in text
    assert text.endswith("![peer-trl-curves](benchmarks/plots/peer-trl-curves.png)")
