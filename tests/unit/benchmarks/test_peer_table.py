"""benchmarks/peer_trl.py: the comparison table's ratios, speed-ups and unreached thresholds,
for one round and paired over rounds."""

from __future__ import annotations

from benchmarks.peer_trl import (
    TRL_LABEL,
    TRL_MICRO_LABEL,
    Measured,
    Plan,
    run_order,
    section_of,
    table,
)
from benchmarks.series import Series

PLAN = Plan(steps=40, every=10, prompts=1024, seed=0)


def _measured(
    label: str, step_s: float, evals: dict[int, float], final: float, cores: float
) -> Measured:
    steps = 40
    series = Series(
        label, [step_s] * steps, [128.0] * steps, [3200.0] * steps, {}, evals, staleness={0: 1}
    )
    return Measured(series, final, wall_s=100.0, load=(1.0, 2.0), cores=cores)


def _tables(text: str) -> list[list[list[str]]]:
    """The markdown tables in ``text``, each as its rows of cells (header included)."""
    tables: list[list[list[str]]] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("|"):
            if not inside:
                tables.append([])
            tables[-1].append([cell.strip() for cell in line.strip("|").split("|")])
        inside = line.startswith("|")
    return tables


def _cells(text: str, label: str, table: int, over: str | None = None) -> list[str]:
    """The cells of ``label``'s row in the ``table``-th table (0: the headline ratios, the
    row of ratios over ``over``; 1: throughput; 2: learning)."""
    rows = _tables(text)[table]
    return next(r for r in rows if r[0] == label and (over is None or r[1] == over))


def test_ratios_are_sluice_over_trl_and_the_speed_up_is_trl_time_over_sluice_time():
    results = {
        "Sluice async": _measured("Sluice async", 1.0, {0: 0.2, 10: 0.24, 40: 0.26}, 0.26, 2.0),
        "Sluice sync": _measured("Sluice sync", 2.0, {0: 0.2, 40: 0.22}, 0.22, 1.5),
        TRL_LABEL: _measured(TRL_LABEL, 3.0, {0: 0.2, 20: 0.24, 40: 0.25}, 0.25, 1.0),
    }
    text = table([results], gain=0.03, hf_finals=[0.25], plan=PLAN)
    fast = _cells(text, "Sluice async", 1)
    # 128 samples per 1 s step against per 3 s: 3x; on 2 cores against 1: 1.5x per core.
    assert fast[1:5] == ["128.0", "3.00x", "3200", "3.00x"]
    assert fast[5:7] == ["128.0", "3.00x"]
    assert fast[7:10] == ["2.00", "64.0", "1.50x"]
    # Time to 23%: 10 s against TRL's 60 s, a 6x speed-up.
    assert _cells(text, "Sluice async", 2)[1:5] == ["10 s", "6.00x", "26.0%", "+1.0 pts"]
    slow = _cells(text, "Sluice sync", 2)
    assert slow[1:3] == ["not reached", "-"]
    assert slow[4] == "-3.0 pts"
    assert _cells(text, TRL_LABEL, 1)[1:3] == ["42.7", "1.00x"]
    assert "time to start + 3 pts" in text
    # The threshold's gain over one evaluation's standard error at the start, 20% of 1,024.
    assert "+ 3 points, 2.4 standard errors of one evaluation of 1024 prompts (1.2 points" in text
    assert "median (min-max)" not in text  # one round: plain values


def test_rounds_pair_each_sluice_run_with_its_own_rounds_trl_run():
    # Round 1: Sluice 3x TRL's rate, reaches start + 3 points at 10 s against TRL's 60 s.
    # Round 2: another start (30%); Sluice 2x TRL (1 s against 2 s steps) and only Sluice
    # reaches 33%.
    rounds = [
        {
            "Sluice async": _measured("Sluice async", 1.0, {0: 0.2, 10: 0.24}, 0.26, 2.0),
            TRL_LABEL: _measured(TRL_LABEL, 3.0, {0: 0.2, 20: 0.24}, 0.25, 1.0),
        },
        {
            "Sluice async": _measured("Sluice async", 1.0, {0: 0.3, 20: 0.34}, 0.34, 2.0),
            TRL_LABEL: _measured(TRL_LABEL, 2.0, {0: 0.3, 20: 0.31}, 0.31, 1.0),
        },
    ]
    text = table(rounds, gain=0.03, hf_finals=[0.25, 0.31], plan=PLAN)
    speed = _cells(text, "Sluice async", 1)
    assert speed[2] == "2.50x (2.00-3.00)"  # paired: 3x and 2x, not 128 over TRL's median
    learning = _cells(text, "Sluice async", 2)
    # Sluice reached each round's threshold (10 s, 20 s); TRL only in round 1, so the
    # speed-up has one pair.
    assert learning[1:5] == [
        "15 s (10-20)",
        "6.00x",
        "30.0% (26.0-34.0)",
        "+2.0 pts (+1.0 to +3.0)",
    ]
    assert _cells(text, TRL_LABEL, 2)[1] == "60 s, 1 of 2"
    assert "starting held-out accuracy (20.0%, 30.0%)" in text
    assert "median (min-max) over the 2 rounds" in text


def test_each_config_gets_its_own_section():
    assert section_of("configs/longtail.yaml") == ("peer-trl", "Against TRL")
    assert section_of("configs/default.yaml")[0] == "peer-trl-default"


def test_the_headline_pairs_each_sluice_run_with_each_trl_run_with_a_bootstrap_interval():
    # Sluice's 1 s steps against TRL's 3 s (round 1) and 2 s (round 2), TRL in
    # micro-batches 4 s in both; in round 1 Sluice's step after the step-20 evaluation
    # took 0.25 s.
    fast = _measured("Sluice async", 1.0, {0: 0.2, 20: 0.24, 40: 0.25}, 0.25, 2.0)
    fast.series.step_s[20] = 0.25
    rounds = [
        {
            "Sluice async": fast,
            TRL_LABEL: _measured(TRL_LABEL, 3.0, {0: 0.2, 20: 0.24, 40: 0.25}, 0.25, 1.0),
            TRL_MICRO_LABEL: _measured(TRL_MICRO_LABEL, 4.0, {0: 0.2, 40: 0.25}, 0.25, 1.0),
        },
        {
            "Sluice async": _measured("Sluice async", 1.0, {0: 0.3, 40: 0.34}, 0.34, 2.0),
            TRL_LABEL: _measured(TRL_LABEL, 2.0, {0: 0.3, 40: 0.31}, 0.31, 1.0),
            TRL_MICRO_LABEL: _measured(TRL_MICRO_LABEL, 4.0, {0: 0.3, 40: 0.31}, 0.31, 1.0),
        },
    ]
    text = table(rounds, gain=0.03, hf_finals=[0.25, 0.31], plan=PLAN)
    # Every step: 40 x 128 samples in 39.25 s against 120 s (3.057x), and 2x: geometric
    # mean 2.47x; resampling two rounds gives only both-first, mixed, both-second.
    first = 120.0 / 39.25
    mean = (first * 2.0) ** 0.5
    over_trl = _cells(text, "Sluice async", 0, over=TRL_LABEL)
    assert over_trl[2] == f"{mean:.2f}x [2.00-{first:.2f}]"
    # Without the step after each evaluation (step 21 of round 1 for both systems): 3x, 2x.
    assert over_trl[3] == f"{6**0.5:.2f}x [2.00-3.00]"
    over_micro = _cells(text, "Sluice async", 0, over=TRL_MICRO_LABEL)
    assert over_micro[3] == "4.00x [4.00-4.00]"
    assert [row[0] for row in _tables(text)[0][2:]] == ["Sluice async", "Sluice async"]
    assert "95% bootstrap interval (10,000 resamples of the rounds)" in text


def test_the_system_that_runs_first_alternates_round_by_round():
    sluice, trl = ["Sluice async k=2"], [TRL_LABEL, TRL_MICRO_LABEL]
    assert run_order(0, sluice, trl) == [*sluice, *trl]
    assert run_order(1, sluice, trl) == [*trl, *sluice]
    assert run_order(2, sluice, trl) == run_order(0, sluice, trl)
