"""The staleness benchmark's counts come from the run's ledger: only 'stale:' drops count;
its section is rendered from its record alone."""

from dataclasses import replace
from pathlib import Path

from benchmarks.records import Record
from benchmarks.staleness import ledger_counts, render
from sluice.storage.ledger import Ledger, LedgerEvent


def test_only_stale_drops_count_as_stale(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path.as_uri())
    events = [LedgerEvent(s, "p", "generated", 0) for s in ("a", "b", "c")]
    events += [
        LedgerEvent("a", "p", "trained", 2, staleness=1),
        LedgerEvent("b", "p", "dropped", reason="stale: started at version 0, trainer at 3"),
        LedgerEvent("c", "p", "dropped", reason="the run ended"),
    ]
    ledger.append(events)
    ledger.flush()
    assert ledger_counts(tmp_path) == {"generated": 3, "stale": 1, "trained": 1}


COMMAND = ".venv/bin/python -m benchmarks.staleness --steps 60 --seeds 0 1 2 --write"


def _run(generated: int, stale: int, samples_per_s: float, oldest: float, end: float) -> dict:
    """One run's numbers as ``benchmarks.staleness.measure`` gives them (less its record)."""
    return {
        "samples_per_s": samples_per_s,
        "end_accuracy": end,
        "oldest_token": oldest,
        "generated": generated,
        "stale": stale,
        "trained": 7680,
    }


def _record() -> Record:
    runs = {
        "first_token": [
            _run(8000, 200, 129.4, 1.0, 0.207),
            _run(8000, 120, 125.4, 1.0, 0.195),
            _run(8000, 80, 149.6, 1.0, 0.227),
        ],
        "last_token": [
            _run(7936, 0, 144.0, 2.0, 0.215),
            _run(7936, 0, 122.4, 3.0, 0.211),
            _run(7936, 0, 153.1, 2.0, 0.219),
        ],
    }
    data = {"steps": 60, "seeds": [0, 1, 2], "runs": runs}
    title = "Staleness: long samples kept or dropped"
    record = Record.measured("staleness", title, render, data, ["torch"], command=COMMAND)
    return replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_the_section_names_the_commit_and_command_and_gives_medians_of_the_seeds():
    text = _record().text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{COMMAND}`: `configs/longtail.yaml` with mode=async, max_staleness=1" in first
    assert "60 steps per run, seeds [0, 1, 2]: median (min-max)." in first
    # stale shares 2.5%, 1.5%, 1.0%
    assert (
        "| `first_token` | 8,000 (8,000-8,000) | 1.5% (1.0%-2.5%) | 129.4 (125.4-149.6) "
        "| 1 (1-1) | 20.7% (19.5%-22.7%) |" in text
    )
    assert "| `last_token` | 7,936 (7,936-7,936) | 0.0% (0.0%-0.0%) | 144.0 (122.4-153.1) " in text
