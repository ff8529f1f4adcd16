"""The durable ledger: one event row per sample transition that matters, in Parquet files.

Written by the trajectory store: generated and scored when a sample arrives, dropped (with
the reason) when it is dropped, trained when the lease holding it is acknowledged. Events
are buffered by ``append`` and written by ``flush`` as one small Parquet file under
``<url>/ledger/``, named ``<seq:012d>-<random>.parquet``; on a local disk it is written under a
temporary name and renamed into place, on S3 a single put is atomic. Readers answer
"where did prompt X go", what a restarted store must re-offer, and whether every sample was
trained exactly once. A run resumed from a checkpoint first calls ``roll_back`` with the
checkpoint's watermark: events written after it describe work whose effect on the weights
was lost with the process, so their files move to ``<url>/ledger-rolled-back/<n>/`` (kept
for the record, no longer read as the run's history). One writer per ledger is assumed;
the random suffix keeps file names unique even if two writers race for a sequence number.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sluice.storage import fsio
from sluice.storage.urls import open_url, redact, url_of

EVENTS = ("dispatched", "generated", "scored", "trained", "dropped")
# Events a sample passes through before it ends trained or dropped. `dispatched`: its
# group was handed to a rollout worker (async; written by the dispatcher).
PENDING = ("dispatched", "generated", "scored")
LEDGER_VERSION = 2  # 2: verdict
# Older versions this code reads: their files lack the columns added since (read as null).
READS_VERSIONS = {"1", str(LEDGER_VERSION)}
VERSION_KEY = b"sluice.ledger_version"
LEDGER_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("event", pa.string(), nullable=False),
        pa.field("version", pa.int32()),
        pa.field("reason", pa.string()),
        pa.field("staleness", pa.int32()),
        # A judge model's answer on a `scored` sample (``engines/reward_models``).
        pa.field("verdict", pa.string()),
        pa.field("ts", pa.timestamp("ms", tz="UTC"), nullable=False),
    ],
    metadata={VERSION_KEY: str(LEDGER_VERSION).encode()},
)
SEQ_DIGITS = 12
ROLLED_BACK = "ledger-rolled-back"
_FILE = re.compile(rf"^(\d{{{SEQ_DIGITS}}})-([0-9a-f]+)\.parquet$")


class LedgerError(RuntimeError):
    """A ledger file cannot be read (corrupt, or written with another ledger format)."""


@dataclass(frozen=True)
class LedgerEvent:
    """One transition of one sample; ``ts`` defaults to now (UTC)."""

    sample_id: str
    prompt_id: str
    event: str
    version: int | None = None
    reason: str | None = None
    staleness: int | None = None
    verdict: str | None = None
    ts: datetime = field(default_factory=lambda: datetime.now(UTC))

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"unknown ledger event {self.event!r}; expected one of {EVENTS}")
        if not self.sample_id or not self.prompt_id:
            raise ValueError("a ledger event needs a sample_id and a prompt_id")


def _events_table(events: list[LedgerEvent]) -> pa.Table:
    columns = {name: [getattr(e, name) for e in events] for name in LEDGER_SCHEMA.names}
    return pa.Table.from_pydict(columns, schema=LEDGER_SCHEMA)


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, write_page_checksum=True)
    return bytes(sink.getvalue().to_pybytes())


def _in_order(tables: list[pa.Table]) -> pa.Table:
    """All events sorted by time; ties keep append order (file sequence, then row)."""
    if not tables:
        return LEDGER_SCHEMA.empty_table()
    table = pa.concat_tables(tables)
    order = pa.array(range(table.num_rows), pa.int64())
    indices = pc.sort_indices(
        table.append_column("_order", order), [("ts", "ascending"), ("_order", "ascending")]
    )
    return table.take(indices)


class Ledger:
    """Append-only event log under ``<url>/ledger/``."""

    def __init__(self, url: str) -> None:
        self.url = redact(url)
        self._fs, root = open_url(url)
        self._dir = fsio.join(root, "ledger")
        self._buffer: list[LedgerEvent] = []
        self._lock = threading.Lock()
        self._next_seq = 1  # flush() also looks past the highest file already there

    # -- writing ---------------------------------------------------------------------------

    def append(self, events: list[LedgerEvent]) -> None:
        """Buffer ``events``; nothing is durable until ``flush``."""
        for event in events:
            if not isinstance(event, LedgerEvent):
                raise TypeError(f"expected LedgerEvent, got {type(event).__name__}")
        with self._lock:
            self._buffer.extend(events)

    def buffered(self) -> list[LedgerEvent]:
        """The events appended and not yet flushed, in order."""
        with self._lock:
            return list(self._buffer)

    def flush(self) -> int:
        """Write the buffered events as one Parquet file; returns the number of rows written."""
        with self._lock:
            if not self._buffer:
                return 0
            table = _events_table(self._buffer)
            seq = max(self._next_seq, self.watermark() + 1)
            name = f"{seq:0{SEQ_DIGITS}d}-{fsio.random_suffix()}.parquet"
            fsio.write_bytes(
                self._fs, fsio.join(self._dir, name), _parquet_bytes(table), atomic=True
            )
            self._next_seq = seq + 1
            self._buffer.clear()
            return table.num_rows

    # -- reading ---------------------------------------------------------------------------

    def _files(self) -> list[tuple[int, str]]:
        """``(seq, name)`` of every complete ledger file, in sequence order."""
        found = []
        for name in fsio.list_names(self._fs, self._dir):
            match = _FILE.match(name)
            if match:
                found.append((int(match.group(1)), name))
        return sorted(found)

    def _read_file(self, name: str) -> pa.Table:
        path = fsio.join(self._dir, name)
        where = url_of(self._fs, path)
        try:
            data = fsio.read_bytes(self._fs, path)
            table = pq.read_table(pa.BufferReader(data), page_checksum_verification=True)
        except (pa.ArrowException, OSError) as err:
            raise LedgerError(f"ledger file {where} is corrupt or unreadable: {err}") from err
        version = (table.schema.metadata or {}).get(VERSION_KEY, b"?").decode(errors="replace")
        if version not in READS_VERSIONS:
            raise LedgerError(
                f"ledger file {where} was written with ledger version {version}, "
                f"but this code reads versions {', '.join(sorted(READS_VERSIONS))}"
            )
        for missing in set(LEDGER_SCHEMA.names) - set(table.column_names):
            table = table.append_column(
                LEDGER_SCHEMA.field(missing),
                pa.nulls(table.num_rows, LEDGER_SCHEMA.field(missing).type),
            )
        try:
            return table.select(LEDGER_SCHEMA.names).cast(LEDGER_SCHEMA)
        except (pa.ArrowException, KeyError) as err:
            raise LedgerError(
                f"ledger file {where} does not match the ledger schema: {err}"
            ) from err

    def read(self) -> pa.Table:
        """Every flushed event, oldest first (temporary files are ignored)."""
        return _in_order([self._read_file(name) for _, name in self._files()])

    def watermark(self) -> int:
        """The highest flushed sequence number (0 when nothing was flushed yet)."""
        files = self._files()
        return files[-1][0] if files else 0

    def roll_back(self, watermark: int, step: int) -> tuple[int, str, int]:
        """Move files past ``watermark`` out of the ledger, for a resume from ``step``.

        Each resume gets the next number n and a folder ``ledger-rolled-back/<n>/`` holding
        the moved files and ``RESUMED.json`` (step, watermark, files, time). Returns (n,
        that folder's URL, files moved). Buffered events are discarded: they come after the
        watermark by definition.
        """
        with self._lock:
            self._buffer.clear()
            root = fsio.join(fsio.parent(self._dir), ROLLED_BACK)
            done = [int(n) for n in fsio.list_names(self._fs, root) if n.isdigit()]
            attempt = max(done, default=0) + 1
            target = fsio.join(root, f"{attempt:04d}")
            moved = [name for seq, name in self._files() if seq > watermark]
            record = {
                "resumed_from_step": step,
                "watermark": watermark,
                "files": moved,
                "at": datetime.now(UTC).isoformat(),
            }
            # The record first: a crash half way leaves the number taken and the files named.
            fsio.write_bytes(
                self._fs,
                fsio.join(target, "RESUMED.json"),
                json.dumps(record, indent=1).encode(),
                atomic=True,
            )
            for name in moved:
                self._fs.mv(fsio.join(self._dir, name), fsio.join(target, name))
            self._next_seq = watermark + 1
            return attempt, url_of(self._fs, target), len(moved)

    def where(self, prompt_id: str) -> list[dict[str, Any]]:
        """Every event of one prompt, in time order: where did prompt X go."""
        table = self.read()
        return table.filter(pc.equal(table.column("prompt_id"), prompt_id)).to_pylist()

    def summary(self) -> dict[str, Any]:
        """Counts per final status and the staleness histogram of trained samples."""
        return summarize(self.read())


def latest_events(table: pa.Table) -> dict[str, str]:
    """``{sample_id: latest event}`` of an ordered events table (first appearance order)."""
    latest: dict[str, str] = {}
    for sample, event in zip(
        table.column("sample_id").to_pylist(), table.column("event").to_pylist(), strict=True
    ):
        latest[sample] = event
    return latest


def summarize(table: pa.Table) -> dict[str, Any]:
    """``{"events", "samples", "final": {status: count}, "staleness": {staleness: count}}``.

    The staleness histogram counts samples whose final status is trained, by the staleness
    recorded on their (last) trained event; events without a staleness are not counted.
    """
    latest = latest_events(table)
    staleness: dict[str, int | None] = {}
    for row in table.select(["sample_id", "event", "staleness"]).to_pylist():
        if row["event"] == "trained":
            staleness[row["sample_id"]] = row["staleness"]
    histogram = Counter(
        value
        for sample, value in staleness.items()
        if latest[sample] == "trained" and value is not None
    )
    return {
        "events": table.num_rows,
        "samples": len(latest),
        "final": dict(sorted(Counter(latest.values()).items())),
        "staleness": dict(sorted(histogram.items())),
    }


def check_exactly_once(table: pa.Table, finished: bool = False) -> list[str]:
    """Human-readable violations: trained twice, trained and dropped, dropped without a reason.

    With ``finished`` (the run has ended), a sample still dispatched, generated or scored is
    one too: it was neither trained nor dropped.
    """
    trained: Counter[str] = Counter()
    dropped: set[str] = set()
    problems: list[str] = []
    for row in table.select(["sample_id", "event", "reason"]).to_pylist():
        sample, event = row["sample_id"], row["event"]
        if event == "trained":
            trained[sample] += 1
        elif event == "dropped":
            dropped.add(sample)
            if not (row["reason"] or "").strip():
                problems.append(f"sample {sample} was dropped without a reason")
    for sample, count in trained.items():
        if count > 1:
            problems.append(f"sample {sample} was trained {count} times")
        if sample in dropped:
            problems.append(f"sample {sample} was both trained and dropped")
    if finished:
        problems += [
            f"sample {sample} was never trained or dropped (last event: {event})"
            for sample, event in latest_events(table).items()
            if event in PENDING
        ]
    return problems


def dispatch_accounting(table: pa.Table) -> dict[str, int]:
    """Of the samples the dispatcher handed out: how many, and how many ended trained,
    ended dropped, or have not ended (still in flight, or the run stopped)."""
    dispatched = set(
        table.filter(pc.equal(table.column("event"), "dispatched")).column("sample_id").to_pylist()
    )
    ends = Counter(
        "open" if event in PENDING else event
        for sample, event in latest_events(table).items()
        if sample in dispatched
    )
    return {
        "dispatched": len(dispatched),
        **{k: ends.get(k, 0) for k in ("trained", "dropped", "open")},
    }


def check_versions(table: pa.Table) -> list[str]:
    """Violations of "the trained versions form a gap-free sequence 1..last"."""
    trained = table.filter(pc.equal(table.column("event"), "trained"))
    versions = set(trained.column("version").to_pylist())
    if not versions:
        return []
    missing = sorted(set(range(1, max(versions) + 1)) - versions)
    return [f"no sample was trained at version {v}" for v in missing]
