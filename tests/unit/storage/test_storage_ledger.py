import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sluice.storage.ledger import (
    LEDGER_SCHEMA,
    VERSION_KEY,
    Ledger,
    LedgerError,
    LedgerEvent,
    _events_table,
    check_exactly_once,
    check_versions,
    dispatch_accounting,
    latest_events,
)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ev(sample, prompt, event, t, **kw):
    return LedgerEvent(sample, prompt, event, ts=at(t), **kw)


# Two prompts, seven samples. Final states (hand-computed):
#   s1 trained (staleness 1), s2 dropped, s3 dropped, s4 generated, s5 scored,
#   s6 trained (staleness 0), s7 trained (staleness 1).
FIRST = [
    ev("s1", "p1", "generated", 0),
    ev("s2", "p1", "generated", 0),
    ev("s6", "p2", "generated", 0),
    ev("s1", "p1", "scored", 1),
    ev("s3", "p2", "generated", 1),
    ev("s5", "p2", "generated", 1),
    ev("s2", "p1", "scored", 2),
    ev("s3", "p2", "dropped", 2, reason="the run ended"),
]
SECOND = [
    ev("s2", "p1", "dropped", 3, reason="too stale"),
    ev("s4", "p2", "generated", 3),
    ev("s5", "p2", "scored", 4),
    ev("s1", "p1", "trained", 5, version=2, staleness=1),
    ev("s7", "p2", "generated", 5),
    ev("s6", "p2", "trained", 6, version=2, staleness=0),
    ev("s7", "p2", "trained", 7, version=3, staleness=1),
]


@pytest.fixture
def ledger(tmp_path) -> Ledger:
    led = Ledger(f"file://{tmp_path}")
    led.append(FIRST)
    assert led.flush() == len(FIRST)
    led.append(SECOND)
    assert led.flush() == len(SECOND)
    return led


def ledger_files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "ledger").iterdir())


def test_each_flush_writes_one_sequenced_file(ledger, tmp_path):
    names = ledger_files(tmp_path)
    assert [n.split("-")[0] for n in names] == ["000000000001", "000000000002"]
    assert all(n.endswith(".parquet") for n in names)
    assert ledger.watermark() == 2
    assert ledger.flush() == 0  # nothing buffered: no file
    assert ledger.watermark() == 2


def test_nothing_is_durable_before_flush(tmp_path):
    led = Ledger(str(tmp_path))
    led.append([ev("s1", "p1", "generated", 0)])
    assert led.read().num_rows == 0
    assert led.watermark() == 0


def test_read_returns_every_event_in_time_order(ledger):
    table = ledger.read()
    assert table.schema.equals(LEDGER_SCHEMA)
    assert table.num_rows == len(FIRST) + len(SECOND)
    times = table.column("ts").to_pylist()
    assert times == sorted(times)
    # Ties keep append order: s1, s2, s6 were all generated at t=0.
    assert table.column("sample_id").to_pylist()[:3] == ["s1", "s2", "s6"]


def test_latest_events_are_the_last_event_of_each_sample(ledger):
    assert latest_events(ledger.read()) == {
        "s1": "trained",
        "s2": "dropped",
        "s6": "trained",
        "s3": "dropped",
        "s5": "scored",
        "s4": "generated",
        "s7": "trained",
    }


def test_where_tells_where_a_prompt_went(ledger):
    trail = [(e["sample_id"], e["event"], e["reason"]) for e in ledger.where("p1")]
    assert trail == [
        ("s1", "generated", None),
        ("s2", "generated", None),
        ("s1", "scored", None),
        ("s2", "scored", None),
        ("s2", "dropped", "too stale"),
        ("s1", "trained", None),
    ]
    assert ledger.where("p1")[-1]["version"] == 2
    assert ledger.where("nope") == []


def test_summary_counts_final_states_and_staleness(ledger):
    assert ledger.summary() == {
        "events": 15,
        "samples": 7,
        "final": {"dropped": 2, "generated": 1, "scored": 1, "trained": 3},
        "staleness": {0: 1, 1: 2},
    }


def test_a_reopened_ledger_sees_everything_and_continues_the_sequence(ledger, tmp_path):
    again = Ledger(f"file://{tmp_path}")
    assert again.read().equals(ledger.read())
    again.append([ev("s4", "p2", "scored", 8)])
    assert again.flush() == 1
    assert again.watermark() == 3
    assert latest_events(ledger.read())["s4"] == "scored"  # the first sees it too


def test_temp_and_foreign_files_are_ignored(ledger, tmp_path):
    folder = tmp_path / "ledger"
    (folder / "000000000009-abcd1234.parquet.tmp-0f0f0f0f").write_bytes(b"half written")
    (folder / "notes.txt").write_text("hello")
    assert ledger.read().num_rows == 15
    assert ledger.watermark() == 2


def test_a_truncated_file_raises_naming_the_file(ledger, tmp_path):
    victim = tmp_path / "ledger" / ledger_files(tmp_path)[1]
    victim.write_bytes(victim.read_bytes()[:-20])
    with pytest.raises(LedgerError, match=re.escape(victim.name)):
        ledger.read()


def test_a_garbage_file_raises_naming_the_file(ledger, tmp_path):
    (tmp_path / "ledger" / "000000000003-deadbeef.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(LedgerError, match=r"000000000003-deadbeef\.parquet"):
        ledger.read()


def test_unknown_events_are_refused():
    with pytest.raises(ValueError, match="unknown ledger event 'lost'"):
        LedgerEvent("s1", "p1", "lost")


def test_exactly_once_holds_for_a_clean_ledger(ledger):
    assert check_exactly_once(ledger.read()) == []


def test_exactly_once_reports_each_violation():
    events = [
        ev("a", "p", "trained", 1),
        ev("a", "p", "trained", 2),
        ev("b", "p", "trained", 1),
        ev("b", "p", "dropped", 2, reason="late"),
        ev("c", "p", "dropped", 1),
        ev("d", "p", "dropped", 1, reason="  "),
        ev("e", "p", "trained", 1),
    ]
    columns = {n: [getattr(e, n) for e in events] for n in LEDGER_SCHEMA.names}
    table = pa.Table.from_pydict(columns, schema=LEDGER_SCHEMA)
    assert sorted(check_exactly_once(table)) == [
        "sample a was trained 2 times",
        "sample b was both trained and dropped",
        "sample c was dropped without a reason",
        "sample d was dropped without a reason",
    ]


def test_a_file_from_another_ledger_version_is_refused(ledger, tmp_path):
    table = ledger.read().replace_schema_metadata({VERSION_KEY: b"9"})
    pq.write_table(table, tmp_path / "ledger" / "000000000005-00ff00ff.parquet")
    with pytest.raises(LedgerError, match="ledger version 9, but this code reads versions 1, 2"):
        ledger.read()


def test_a_version_1_file_reads_with_no_verdicts(ledger, tmp_path):
    """Ledgers written before verdicts (version 1) still read: their verdicts are null."""
    before = ledger.read()
    table = before.drop_columns(["verdict"]).replace_schema_metadata({VERSION_KEY: b"1"})
    pq.write_table(table, tmp_path / "ledger" / "000000000005-00ff00ff.parquet")
    both = ledger.read()
    assert both.num_rows == 2 * before.num_rows
    assert both.column("verdict").null_count == both.num_rows


def test_a_verdict_is_kept(tmp_path):
    ledger = Ledger(f"file://{tmp_path}")
    ledger.append([LedgerEvent("g/0", "p", "scored", verdict="Yes, 5 is right.")])
    ledger.flush()
    assert ledger.read().column("verdict").to_pylist() == ["Yes, 5 is right."]


def test_a_finished_run_has_no_sample_left_pending():
    events = [
        ev("a", "p", "generated", 0),
        ev("b", "p", "generated", 0),
        ev("a", "p", "trained", 1, version=1, staleness=0),
    ]
    table = _events_table(events)
    assert check_exactly_once(table) == []  # a run in progress: b may still be trained
    assert check_exactly_once(table, finished=True) == [
        "sample b was never trained or dropped (last event: generated)"
    ]


@pytest.mark.parametrize(
    ("versions", "problems"),
    [([1, 2, 3], []), ([1, 3], ["no sample was trained at version 2"]), ([], [])],
    ids=["gap-free", "gap", "nothing-trained"],
)
def test_trained_versions_must_have_no_gap(versions, problems):
    events = [ev(f"s{v}", "p", "trained", v, version=v, staleness=0) for v in versions]
    assert check_versions(_events_table(events)) == problems


def test_dispatch_accounting_counts_how_each_dispatched_sample_ended(tmp_path):
    book = Ledger(f"file://{tmp_path}")
    book.append(
        [LedgerEvent(f"g{i}/0", f"p{i}", "dispatched") for i in range(4)]
        + [LedgerEvent("g0/0", "p0", "generated"), LedgerEvent("g0/0", "p0", "trained", 1)]
        + [LedgerEvent("g1/0", "p1", "dropped", reason="worker died")]
        + [LedgerEvent("g2/0", "p2", "generated")]
        + [LedgerEvent("batch/0", "p9", "generated")]  # a batch-mode sample: not dispatched
    )
    book.flush()
    assert dispatch_accounting(book.read()) == {
        "dispatched": 4,
        "trained": 1,
        "dropped": 1,
        "open": 2,
    }
