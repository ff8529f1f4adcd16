"""The staleness benchmark's counts come from the run's ledger: only 'stale:' drops count."""

from pathlib import Path

from benchmarks.staleness import ledger_counts
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
