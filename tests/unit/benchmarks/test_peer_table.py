"""benchmarks/peer_trl.py: the comparison table's ratios, speed-ups and unreached thresholds."""

from __future__ import annotations

from sluice.benchmarks.peer_trl import TRL_LABEL, Measured, table
from sluice.benchmarks.series import Series


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
    text = table(results, threshold=0.23, hf_final=0.25, every=10, prompts=1024)
    fast = _cells(text, "Sluice async", 0)
    # 128 samples per 1 s step against per 3 s: 3x; on 2 cores against 1: 1.5x per core.
    assert fast[1:5] == ["128.0", "3.00x", "3200", "3.00x"]
    assert fast[5:7] == ["128.0 (128-128)", "3.00x"]
    assert fast[7:10] == ["2.00", "64.0", "1.50x"]
    # Time to 23%: 10 s against TRL's 60 s, a 6x speed-up.
    assert _cells(text, "Sluice async", 1)[1:5] == ["10 s", "6.00x", "26.0%", "+1.0 pts"]
    slow = _cells(text, "Sluice sync", 1)
    assert slow[1:3] == ["not reached", "-"]
    assert slow[4] == "-3.0 pts"
    assert _cells(text, TRL_LABEL, 0)[1:3] == ["42.7", "1.00x"]
    assert "time to 23.0%" in text
    # The threshold's gain over one evaluation's standard error at the start, 20% of 1,024.
    assert "3 points, 2.4 standard errors of one evaluation of 1024 prompts (1.2 points)" in text
