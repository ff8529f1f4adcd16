"""benchmarks/peer_trl.py: the comparison table's ratios, speed-ups and unreached thresholds,
for one round and paired over rounds."""

from __future__ import annotations

from benchmarks.peer_trl import TRL_LABEL, Measured, Plan, section_of, table
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


def _cells(text: str, label: str, table: int) -> list[str]:
    """The cells of ``label``'s row in the ``table``-th table (0: throughput, 1: learning)."""
    rows = [line for line in text.splitlines() if line.startswith(f"| {label} |")]
    return [cell.strip() for cell in rows[table].strip("|").split("|")]


def test_ratios_are_sluice_over_trl_and_the_speed_up_is_trl_time_over_sluice_time():
    results = {
        "Sluice async": _measured("Sluice async", 1.0, {0: 0.2, 10: 0.24, 40: 0.26}, 0.26, 2.0),
        "Sluice sync": _measured("Sluice sync", 2.0, {0: 0.2, 40: 0.22}, 0.22, 1.5),
        TRL_LABEL: _measured(TRL_LABEL, 3.0, {0: 0.2, 20: 0.24, 40: 0.25}, 0.25, 1.0),
    }
    text = table([results], gain=0.03, hf_finals=[0.25], plan=PLAN)
    fast = _cells(text, "Sluice async", 0)
    # 128 samples per 1 s step against per 3 s: 3x; on 2 cores against 1: 1.5x per core.
    assert fast[1:5] == ["128.0", "3.00x", "3200", "3.00x"]
    assert fast[5:7] == ["128.0", "3.00x"]
    assert fast[7:10] == ["2.00", "64.0", "1.50x"]
    # Time to 23%: 10 s against TRL's 60 s, a 6x speed-up.
    assert _cells(text, "Sluice async", 1)[1:5] == ["10 s", "6.00x", "26.0%", "+1.0 pts"]
    slow = _cells(text, "Sluice sync", 1)
    assert slow[1:3] == ["not reached", "-"]
    assert slow[4] == "-3.0 pts"
    assert _cells(text, TRL_LABEL, 0)[1:3] == ["42.7", "1.00x"]
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
    speed = _cells(text, "Sluice async", 0)
    assert speed[2] == "2.50x (2.00-3.00)"  # paired: 3x and 2x, not 128 over TRL's median
    learning = _cells(text, "Sluice async", 1)
    # Sluice reached each round's threshold (10 s, 20 s); TRL only in round 1, so the
    # speed-up has one pair.
    assert learning[1:5] == [
        "15 s (10-20)",
        "6.00x",
        "30.0% (26.0-34.0)",
        "+2.0 pts (+1.0 to +3.0)",
    ]
    assert _cells(text, TRL_LABEL, 1)[1] == "60 s, 1 of 2"
    assert "starting held-out accuracy (20.0%, 30.0%)" in text
    assert "median (min-max) over the 2 rounds" in text


def test_each_config_gets_its_own_section():
    assert section_of("configs/longtail.yaml") == ("peer-trl", "Against TRL")
    assert section_of("configs/default.yaml")[0] == "peer-trl-default"
