"""The trajectory store (AsyncFlow's TransferQueue idea): Arrow rows in Ray's object store.

Components:
- ``TrajectoryStore``, a Ray actor, is the controller. It keeps per-sample metadata in a
  ``storage.trajectory_index.TrajectoryIndex`` and object references to the data, never
  the data itself. It applies backpressure (``put`` waits while the store is full), hands
  out leases on whole ready groups, takes expired leases back, drops samples that grew too
  stale, and appends every transition to the durable ledger (flushed at every ack).
- ``StoreClient`` runs in producers (rollout workers) and consumers (the trainer). A
  producer validates a RecordBatch against the trajectory schema, puts it in the object
  store (as one Arrow IPC buffer, ``storage.block_builder.encode_block``) and registers it
  (the controller keeps its own copy, so a producer that dies takes nothing with it), then
  writes it to ``<url>/trajectories/`` as Parquet so a restarted store can re-offer it. A
  consumer leases rows and reads them zero-copy out of the object store as an Arrow table.

Restart: a store created with ``restore=True`` reads the ledger and the trajectory files and
re-offers every stored sample that was not trained or dropped; a sample the ledger
knows but whose rows are gone is dropped with that reason, never silently lost. Rows the
ledger does not know (written just before a crash) are re-offered too, unless the run
resumes from a checkpoint (``restore="checkpoint"``, after ``Ledger.roll_back``): then they
came from prompts the resumed run draws again, and are dropped with that reason.

Restart in place: the session creates the store with ``store.max_restarts``, and Ray
restarts a store whose process died, retrying the calls that were on their way to it. The
new process restores as above, except that the samples the ledger knows and the files lack
are awaited, not dropped: the rollout workers are alive, still generating them or holding
their rows in a write buffer. Each put's answer names the store's incarnation; a producer
that sees a new one sends the rows the old one had taken and storage lacks again
(``StoreClient``). What is still awaited when the run ends is dropped with the reason. A
batch the trainer was reading when the store died is leased again (its rows lived in the
dead process's objects); one it had read and trained is acknowledged by its sample ids.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
from ray import ObjectRef

from sluice.rl.staleness import StaleBy
from sluice.storage import fsio
from sluice.storage.block_builder import decode_block, encode_block
from sluice.storage.faults import fault_point
from sluice.storage.ledger import Ledger, LedgerEvent, latest_events
from sluice.storage.schema import SchemaError, check_version, validate_batch
from sluice.storage.trajectory_index import (
    TERMINAL,
    LeaseError,
    LeaseGrant,
    SampleMeta,
    TrajectoryIndex,
)
from sluice.storage.urls import Credentials, open_url, url_of

log = logging.getLogger(__name__)

# How often the controller looks for leases whose consumer stopped answering.
EXPIRY_TICK_S = 0.5
# A waiting producer or consumer logs a progress line this often.
PROGRESS_EVERY_S = 10.0
TRAJECTORIES = "trajectories"

__all__ = ["Lease", "LeaseError", "StoreClient", "TrajectoryStore", "create_store"]


def _metas(batch: pa.RecordBatch) -> list[SampleMeta]:
    """Index metadata of each row (validated: each has response tokens), with the oldest and
    the newest policy version of its tokens."""
    status = batch.column("status")
    bad = pc.index(pc.equal(status, "scored"), False).as_py()
    if bad >= 0:
        raise SchemaError(
            f"row {bad} has status {status[bad].as_py()!r}; producers add rows as 'scored', "
            "with their reward and advantage"
        )
    unscored = pc.or_(pc.is_null(batch.column("reward")), pc.is_null(batch.column("advantage")))
    bad = pc.index(unscored, True).as_py()
    if bad >= 0:
        raise SchemaError(
            f"row {bad} (sample_id={batch.column('sample_id')[bad].as_py()!r}) is 'scored' "
            "but lacks its reward or advantage"
        )
    # Each row's oldest and newest token version, vectorised (a Python loop over tokens
    # cost more than the rest of a put for long responses).
    versions = batch.column("token_versions")
    lengths = pc.list_value_length(versions).to_numpy()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    flat = pc.list_flatten(versions).to_numpy()
    minimum = np.minimum.reduceat(flat, starts).tolist()
    maximum = np.maximum.reduceat(flat, starts).tolist()
    return [
        SampleMeta(
            sample_id=row["sample_id"],
            prompt_id=row["prompt_id"],
            group_id=row["group_id"],
            version=int(minimum[i]),
            last_version=int(maximum[i]),
            reward=row["reward"],
            advantage=row["advantage"],
            reason=row["reason"],
            verdict=row["verdict"],
        )
        for i, row in enumerate(
            batch.select(
                ["sample_id", "prompt_id", "group_id", "reward", "advantage", "reason", "verdict"]
            ).to_pylist()
        )
    ]


@dataclass(frozen=True)
class DispatchRecovery:
    """What a dispatcher restarted in place rebuilds from, kept by the trajectory store:
    its last journal (``GroupDispatcher.journal``), the groups it dispatched after that
    journal (group id: prompt id, in order), and every group dispatched whose samples were
    neither generated nor ended (in flight on a rollout worker, or lost with one)."""

    state: dict[str, Any]
    since: dict[str, str]
    open: dict[str, str]


@ray.remote(num_cpus=0)
class TrajectoryStore:
    """The controller actor; see the module docstring. All methods run on one event loop."""

    def __init__(
        self,
        url: str | None,
        capacity: int,
        lease_s: float = 300.0,
        restore: bool | str = False,
        credentials: Credentials | None = None,
        stale_by: StaleBy = "last_token",
        carried: dict[str, str] | None = None,
        drop_uniform: bool = False,
    ) -> None:
        if credentials:
            credentials.apply()  # the ledger under an s3:// url needs them
        if capacity < 1:
            raise ValueError(f"store capacity must be >= 1 sample, got {capacity}")
        self._ledger = Ledger(url) if url else None
        self._index = TrajectoryIndex(self._ledger, stale_by=stale_by, drop_uniform=drop_uniform)
        self._capacity = capacity
        self._draining = False
        # Samples that ended before their rows came (dropped; after a restart in place,
        # every sample the ledger shows ended): rows that come for them are refused.
        self._gone: set[str] = set()
        self._lease_s = lease_s
        self._changed: asyncio.Condition | None = None
        self._ticker: asyncio.Task[None] | None = None
        # Which process of the store this is: a put's answer, newer after each restart.
        self.incarnation = time.time_ns()
        # Restarted in place: samples the ledger knows whose rows it awaits from the
        # producers ({sample id: prompt id}).
        self._restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._awaiting: dict[str, str] = {}
        self.restored = ""  # what a restart in place rebuilt, for the driver to log
        # The dispatcher's last journal and the groups it dispatched since (group id:
        # prompt id): what it rebuilds from if Ray restarts it (``recovery``).
        self._journal: dict[str, Any] | None = None
        self._since: dict[str, str] = {}
        # A resume from a checkpoint that kept groups in flight: the reason each kept
        # sample's id ends with, and those that ended so (no rows of theirs were stored).
        self._carried = carried or {}
        self.carried_on: list[str] = []
        if restore or self._restarted:
            if not url:
                raise ValueError("restoring a trajectory store needs its storage url")
            self._restore(url, adopt_unknown=self._restarted or restore != "checkpoint")

    # -- restart ---------------------------------------------------------------------------

    def _restore(self, url: str, adopt_unknown: bool) -> None:
        assert self._ledger is not None
        events = self._ledger.read()
        latest = latest_events(events)
        pending = _pending_rows(url, latest)
        found: set[str] = set()
        if pending is not None:
            in_ledger = pc.is_in(pending.column("sample_id"), pa.array(list(latest), pa.string()))
            known, fresh = pending.filter(in_ledger), pending.filter(pc.invert(in_ledger))
            if not adopt_unknown:
                self._ledger.append(
                    [
                        LedgerEvent(
                            s,
                            p,
                            "dropped",
                            reason="generated after the checkpoint the run resumed from",
                        )
                        for s, p in zip(
                            fresh.column("sample_id").to_pylist(),
                            fresh.column("prompt_id").to_pylist(),
                            strict=True,
                        )
                    ]
                )
                fresh = fresh.slice(0, 0)
            # The ledger already has the generated/scored events of the rows it knows.
            for table, record in ((known, False), (fresh, True)):
                if table.num_rows:
                    batch = table.combine_chunks().to_batches()[0]
                    self._index.add(ray.put(encode_block(batch)), _metas(batch), record=record)
                    found.update(table.column("sample_id").to_pylist())
        lost = {s for s, event in latest.items() if event not in TERMINAL and s not in found}
        ids, prompts = (
            events.column("sample_id").to_pylist(),
            events.column("prompt_id").to_pylist(),
        )
        prompt_of = dict(zip(ids, prompts, strict=True))
        if self._restarted:
            self._awaiting = {s: prompt_of[s] for s in lost}
            self._gone = {s for s, event in latest.items() if event in TERMINAL}
            self.restored = (
                f"the trajectory store restarted in place: {len(found)} samples re-offered "
                f"from storage, {len(lost)} awaited from the rollout workers"
            )
            log.warning(self.restored)
            return
        self.carried_on = sorted(s for s in lost if s in self._carried)
        self._ledger.append(
            [
                LedgerEvent(
                    s,
                    prompt_of[s],
                    "dropped",
                    reason=self._carried.get(s)
                    or (
                        "dispatched, not generated before the restart"
                        if latest[s] == "dispatched"
                        else "its rows were lost in a restart"
                    ),
                )
                for s in sorted(lost)
            ]
        )
        self._ledger.flush()
        log.info("trajectory store restored: %d samples re-offered, %d lost", len(found), len(lost))

    # -- event loop plumbing ---------------------------------------------------------------

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        return self._changed

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            if self._index.expire():
                await self._notify()

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    # -- producers -------------------------------------------------------------------------

    async def put(
        self, blocks: list[Any], metas: list[SampleMeta], group_size: int | None, wait_s: float
    ) -> int:
        """Register one block; waits up to ``wait_s`` for room. Answers the store's
        ``incarnation`` once it has the block, 0 if it is still full.

        ``blocks[0]`` is the producer's object; the store re-puts it so that it owns the
        copy it hands out (Ray 2.56 removed ``ray.put(_owner=...)``), and a producer that
        dies afterwards takes nothing with it. Reading the producer's object is zero-copy;
        the re-put is one memory copy, in this actor, never in the driver.
        """
        fault_point("store.put")  # tests: the store dying as it takes a block
        if len(metas) > self._capacity:
            raise ValueError(
                f"a block of {len(metas)} samples can never fit a store of capacity "
                f"{self._capacity}; raise the capacity or put smaller blocks"
            )
        changed = self._condition()
        async with changed:
            try:
                await asyncio.wait_for(
                    changed.wait_for(
                        lambda: self._draining or self._index.held() + len(metas) <= self._capacity
                    ),
                    timeout=wait_s,
                )
            except TimeoutError:
                return 0
            block = await blocks[0]
            late = [m.sample_id for m in metas if m.sample_id in self._gone]
            if late:
                self._refuse_late(metas, late)
                return self.incarnation  # taken, as far as the producer goes
            self._index.add(ray.put(block), metas, group_size)
            self._arrived(m.sample_id for m in metas)
            changed.notify_all()
        return self.incarnation

    def _arrived(self, sample_ids: Iterable[str]) -> None:
        """Samples awaited since a restart that came (rows) or ended (dropped)."""
        if self._awaiting:
            for sample_id in sample_ids:
                self._awaiting.pop(sample_id, None)

    async def missing(self, sample_ids: list[str]) -> list[str]:
        """Of ``sample_ids``, those whose rows this store never had and that did not end: a
        producer sends them again after a restart (``StoreClient``)."""
        seen = self._index.has_seen
        return [s for s in sample_ids if not seen(s) and s not in self._gone]

    async def restart(self) -> tuple[int, str]:
        """The store's incarnation (see ``put``), and what its restart in place rebuilt
        ("" if none)."""
        return self.incarnation, self.restored

    def _refuse_late(self, metas: list[SampleMeta], late: list[str]) -> None:
        """Rows of samples already recorded dropped (their worker was declared dead while
        the put was on its way) stay out: each sample ends once. Any other sample of the
        block is dropped with them, naming why."""
        log.warning("%d rows arrived after their samples were dropped; not stored", len(metas))
        others = [m for m in metas if m.sample_id not in self._gone]
        if others and self._ledger is not None:
            reason = f"came in one block with {late[0]}, dropped before the block arrived"
            self._ledger.append(
                [LedgerEvent(m.sample_id, m.prompt_id, "dropped", reason=reason) for m in others]
            )
        self._gone.update(m.sample_id for m in others)

    async def drain(self, draining: bool) -> None:
        """While draining (the trainer does not consume: held-out evaluation, the end of
        the run), puts never wait for room: rollout workers finishing what they hold must
        not block on a full store. What they hold is bounded by their running batches."""
        self._draining = draining
        await self._notify()

    async def record(self, events: list[LedgerEvent]) -> None:
        """Ledger events of samples not in the store yet (``dispatched``, or ``dropped``
        before they were generated); written with the next flush. A ``dropped`` event of a
        sample whose rows reached the store, or that ended already (before a restart in
        place, too), is left out: the store ends that sample (a worker can die after its
        put and before it reported the group done). Rows that come after their samples'
        ``dropped`` are refused (``put``)."""
        for e in events:
            if e.event == "dispatched":
                self._since.setdefault(e.sample_id.rpartition("/")[0], e.prompt_id)
        seen, gone = self._index.has_seen, self._gone
        events = [
            e
            for e in events
            if e.event != "dropped" or not (seen(e.sample_id) or e.sample_id in gone)
        ]
        self._gone.update(e.sample_id for e in events if e.event == "dropped")
        self._arrived(e.sample_id for e in events if e.event == "dropped")
        if self._ledger is not None:
            self._ledger.append(events)

    async def journal(self, state: dict[str, Any]) -> None:
        """Keep the dispatcher's state (``GroupDispatcher.journal``); sent in order with its
        ``record`` calls, so the groups recorded after it are the ones handed out since."""
        self._journal, self._since = state, {}

    async def recovery(self) -> DispatchRecovery | None:
        """What a dispatcher restarted in place rebuilds from (``GroupDispatcher.recover``):
        its last journal, the groups dispatched since, and the groups dispatched whose
        samples were neither generated nor ended (read from the ledger and its buffer)."""
        if self._journal is None:
            return None
        open_groups: dict[str, str] = {}
        if self._ledger is not None:
            events = self._ledger.read()
            latest = latest_events(events)
            prompts = dict(
                zip(
                    events.column("sample_id").to_pylist(),
                    events.column("prompt_id").to_pylist(),
                    strict=True,
                )
            )
            for e in self._ledger.buffered():
                latest[e.sample_id], prompts[e.sample_id] = e.event, e.prompt_id
            for sample_id, event in latest.items():
                if event == "dispatched" and not self._index.has_seen(sample_id):
                    open_groups.setdefault(sample_id.rpartition("/")[0], prompts[sample_id])
        return DispatchRecovery(self._journal, dict(self._since), open_groups)

    # -- consumers -------------------------------------------------------------------------

    async def lease(
        self,
        count: int,
        current_version: int,
        max_staleness: int,
        wait_s: float,
        lease_s: float | None = None,
    ) -> LeaseGrant | None:
        """Whole ready groups totalling at least ``count`` samples, or None after ``wait_s``.

        The lease lasts ``lease_s`` (the store's default when None) unless acknowledged.
        """
        changed = self._condition()
        grant: LeaseGrant | None = None

        def ready() -> bool:
            nonlocal grant
            grant = self._index.take(
                count, current_version, max_staleness, lease_s or self._lease_s
            )
            return grant is not None

        async with changed:
            try:
                await asyncio.wait_for(changed.wait_for(ready), timeout=wait_s)
            except TimeoutError:
                return None
            changed.notify_all()  # stale groups may have been dropped: room for producers
        return grant

    async def ack(
        self,
        lease_id: str,
        version: int,
        sample_ids: list[str] | None = None,
        current_version: int = 0,
    ) -> int:
        """Mark a lease trained at ``version``; the ledger is flushed before this returns.

        A store restarted in place does not know the leases of the process before it, and
        re-offered their samples: those are acknowledged by ``sample_ids`` (the lease's,
        granted at ``current_version``)."""
        if self._restarted and sample_ids is not None and not self._index.has_lease(lease_id):
            trained = self._index.ack_samples(sample_ids, version, current_version)
        else:
            trained = self._index.ack(lease_id, version)
        if self._ledger is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._ledger.flush)
        await self._notify()  # room for waiting producers
        return trained

    async def close(self, reason: str) -> int:
        """Drop what is left with ``reason`` (recorded in the ledger, which is flushed), and
        what a restart awaited and never came."""
        dropped = self._index.drop_all(reason)
        if self._awaiting and self._ledger is not None:
            why = (
                "its rows were lost: the trajectory store restarted before they reached "
                "storage, and no rollout worker sent them again"
            )
            self._ledger.append(
                [LedgerEvent(s, p, "dropped", reason=why) for s, p in self._awaiting.items()]
            )
            dropped += len(self._awaiting)
            self._awaiting = {}
        await self.flush()
        await self._notify()
        return dropped

    async def flush(self) -> int:
        """Write buffered ledger events; returns the ledger watermark (0 without a ledger)."""
        if self._ledger is None:
            return 0
        self._ledger.flush()
        return self._ledger.watermark()

    async def carried(self) -> list[str]:
        """The kept samples (``carried``) whose old ids the restore ended: none of their
        rows were stored, so the resumed run continues them."""
        return self.carried_on

    async def stats(self) -> dict[str, int]:
        return {**self._index.stats(), "capacity": self._capacity}


def check_trajectory_versions(url: str) -> None:
    """Refuse a run whose trajectory files were written with another schema version, from
    their footers alone and before anything starts: ``SchemaError`` naming the file and
    both versions (no retry reads it, and a restored store would meet it only after Ray
    and the pools started). An unreadable file is left to the store, which records its
    samples as dropped."""
    fs, root = open_url(url)
    folder = fsio.join(root, TRAJECTORIES)
    for name in fsio.list_names(fs, folder):
        if not name.endswith(".parquet"):
            continue
        path = fsio.join(folder, name)
        try:
            with fs.open(path, "rb") as file:
                schema = pq.read_schema(file)
        except (pa.ArrowException, OSError):
            continue
        try:
            check_version(schema)
        except SchemaError as error:
            raise SchemaError(f"{url_of(fs, path)}: {error}") from None


def _pending_rows(url: str, latest: dict[str, str]) -> pa.Table | None:
    """Stored rows not yet trained or dropped, groups contiguous, first copy wins."""
    fs, root = open_url(url)
    folder = fsio.join(root, TRAJECTORIES)
    tables = []
    for name in sorted(fsio.list_names(fs, folder)):
        if name.endswith(".parquet"):
            path = fsio.join(folder, name)
            try:
                table = pq.read_table(pa.BufferReader(fsio.read_bytes(fs, path)))
            except (pa.ArrowException, OSError) as err:
                # Its samples are not found below: the ledger records them as dropped.
                log.warning(
                    "trajectory file %s is unreadable (%s); its samples that were not "
                    "trained are recorded as dropped",
                    url_of(fs, path),
                    str(err).splitlines()[0] if str(err) else type(err).__name__,
                )
                continue
            check_version(table.schema)
            tables.append(table)
    if not tables:
        return None
    table = pa.concat_tables(tables)
    ids = table.column("sample_id").to_pylist()
    groups = table.column("group_id").to_pylist()
    seen: set[str] = set()
    keep = []
    for i, sample_id in enumerate(ids):
        if latest.get(sample_id) not in TERMINAL and sample_id not in seen:
            seen.add(sample_id)
            keep.append(i)
    first = {g: n for n, g in reversed(list(enumerate(groups)))}
    keep.sort(key=lambda i: first[groups[i]])  # stable: rows keep their order within a group
    return table.take(pa.array(keep, pa.int64()))  # typed: an empty list infers null


def create_store(
    url: str | None,
    capacity: int,
    lease_s: float = 300.0,
    restore: bool | str = False,
    scheduling_strategy: Any = None,
    stale_by: StaleBy = "last_token",
    max_restarts: int = 0,
    carried: dict[str, str] | None = None,
    drop_uniform: bool = False,
) -> Any:
    """Start the controller actor (no CPU slot: it only does bookkeeping).

    ``restore``: False (a new run), True (a restarted store) or "checkpoint" (a run resumed
    from a checkpoint, its ledger rolled back to the checkpoint's watermark).
    ``scheduling_strategy``: where Ray places it (the flow pins it to its own node).
    ``stale_by``: which token's version the staleness bound counts (``rl/staleness.py``).
    ``max_restarts``: times Ray restarts it in place after its process dies (with ``url``;
    see the module docstring), retrying the calls on their way to it.
    ``carried``: with ``restore="checkpoint"``, the samples the checkpoint kept in flight
    (``engines/rollout/in_flight.py``) and the reason their old ids end with.
    ``drop_uniform``: dynamic sampling; a group whose rewards are all equal is dropped as it
    completes, with the reason (``trajectory_index._uniform``).

    It gets this process's storage credentials, since it writes the ledger under ``url``.
    """
    restarts = max_restarts if url else 0  # nothing to restore from without storage
    return TrajectoryStore.options(  # type: ignore[attr-defined]
        scheduling_strategy=scheduling_strategy,
        max_restarts=restarts,
        max_task_retries=-1 if restarts else 0,
    ).remote(url, capacity, lease_s, restore, Credentials.here(), stale_by, carried, drop_uniform)


@dataclass(frozen=True)
class Lease:
    """Leased rows: ``table`` references the object store (no copy) until it is dropped."""

    lease_id: str
    table: pa.Table
    sample_ids: list[str]
    staleness: list[int]
    current_version: int


class _Put:
    """A block on its way into the store: the controller's answer is ``pending``, and once
    settled ``taken_by`` is the incarnation of the store that took it."""

    def __init__(
        self,
        batch: pa.RecordBatch,
        ref: Any,
        metas: list[SampleMeta],
        group_size: int | None,
        submit: Any,
    ) -> None:
        self.batch, self.ref, self.metas, self.group_size = batch, ref, metas, group_size
        self.pending = submit(self)
        self.taken_by = 0


class StoreClient:
    """Producer and consumer calls on one store; picklable, so actors can hold one.

    A producer's rows are written to ``<url>/trajectories/`` once the store has taken them,
    in one Parquet file per ``persist_rows`` rows (0: one file per put). Rows still in a
    producer's buffer when everything crashes are recorded as lost by a restored store;
    when the store alone restarted, the producer sends them to the new one (``_resend``).
    """

    def __init__(
        self, handle: Any, url: str | None = None, persist_rows: int = 0, pipeline: int = 0
    ) -> None:
        self.handle = handle
        self.url = url
        self.persist_rows = persist_rows
        self.pipeline = pipeline
        self._unwritten: list[_Put] = []  # settled, not in storage yet
        self._incarnation = 0  # the newest store incarnation that took a put
        self._in_flight: list[_Put] = []
        self._recording: ray.ObjectRef | None = None  # ledger events sent, not yet taken
        self.puts = 0  # puts made; put number n is in the store once ``settled >= n``
        self.settled = 0

    def __getstate__(self) -> dict[str, Any]:
        return {
            "handle": self.handle,
            "url": self.url,
            "persist_rows": self.persist_rows,
            "pipeline": self.pipeline,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    # -- producers -------------------------------------------------------------------------

    def put(self, batch: pa.RecordBatch, group_size: int | None = None) -> int:
        """Validate and register ``batch``, then persist it; blocks while the store is full.
        Returns the put's number: the store holds the rows once ``settled`` reaches it.

        Raises ``SchemaError`` naming the row and column on malformed data, and
        ``ValueError`` when the store refuses the rows; then nothing is stored or written.
        With ``pipeline`` > 0, up to that many puts stay in flight while the producer goes
        on (the controller's work overlaps the next block's); a refusal is then raised by
        a later ``put`` or by ``flush``, and blocks in flight together may be registered in
        any order (the controller runs its calls concurrently).
        """
        validate_batch(batch)
        metas = _metas(batch)
        self._in_flight.append(
            _Put(batch, ray.put(encode_block(batch)), metas, group_size, self._submit)
        )
        self.puts += 1
        while len(self._in_flight) > self.pipeline:
            self._settle(self._in_flight.pop(0))
        return self.puts

    def settle_answered(self) -> None:
        """Settle, without waiting, the puts in flight the store has already taken."""
        while self._in_flight and ray.wait([self._in_flight[0].pending], timeout=0)[0]:
            if not ray.get(self._in_flight[0].pending):
                return  # the store was full: the next put or ``flush`` asks again
            self._settle(self._in_flight.pop(0))

    def _submit(self, put: _Put) -> Any:
        return self.handle.put.remote([put.ref], put.metas, put.group_size, PROGRESS_EVERY_S)

    def _settle(self, put: _Put) -> None:
        """Wait until the store took ``put`` (logging while it is full), then persist it."""
        self._taken(put)
        self.settled += 1
        if self.url:
            self._unwritten.append(put)
            self._resend(put.taken_by)
            if sum(p.batch.num_rows for p in self._unwritten) >= self.persist_rows:
                self._write()

    def _taken(self, put: _Put) -> None:
        """Wait until the store took ``put``, logging while it is full."""
        started = time.monotonic()
        while not (taken_by := int(ray.get(put.pending))):
            stats = ray.get(self.handle.stats.remote())
            log.info(
                "trajectory store full (%d/%d samples held) for %.0f s; waiting for the "
                "trainer to consume",
                stats["held"],
                stats["capacity"],
                time.monotonic() - started,
            )
            put.pending = self._submit(put)
        put.taken_by = taken_by
        put.ref = None  # the store has its own copy: the producer's can go

    def _resend(self, incarnation: int) -> None:
        """The store restarted in place (``incarnation`` is newer than the one that took
        some unwritten rows): it lost them with its old process, so send them again, less
        what it had already written off or got back otherwise (``TrajectoryStore.missing``)."""
        if incarnation > self._incarnation:
            old, self._incarnation = self._incarnation, incarnation
            if old:  # not the first answer this producer got
                log.warning("the trajectory store restarted; sending its unwritten rows again")
        while stale := [p for p in self._unwritten if p.taken_by < self._incarnation]:
            ids = [m.sample_id for p in stale for m in p.metas]
            wanted = set(ray.get(self.handle.missing.remote(ids)))
            for put in stale:
                keep = [i for i, m in enumerate(put.metas) if m.sample_id in wanted]
                put.taken_by = self._incarnation
                if not keep:
                    continue
                batch = put.batch.take(pa.array(keep, pa.int64()))
                again = _Put(
                    batch,
                    ray.put(encode_block(batch)),
                    [put.metas[i] for i in keep],
                    put.group_size,
                    self._submit,
                )
                self._taken(again)
                self._incarnation = max(self._incarnation, again.taken_by)

    def flush(self) -> None:
        """Wait for every put in flight, then write the buffered rows to storage."""
        while self._in_flight:
            self._settle(self._in_flight.pop(0))
        if self._unwritten:  # a store restarted since the last put lacks these rows
            self._resend(int(ray.get(self.handle.restart.remote())[0]))
        self._write()

    def write_settled(self) -> None:
        """Write the rows of the puts the store has taken (``settle_answered``) now, not
        once ``persist_rows`` of them are buffered; waits for nothing else."""
        self.settle_answered()
        self._write()

    def _write(self) -> None:
        """The buffered rows as one Parquet file under ``<url>/trajectories/``."""
        if not self._unwritten or not self.url:
            return
        fs, root = open_url(self.url)
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_batches([p.batch for p in self._unwritten]), sink)
        name = f"{time.time_ns():020d}-{fsio.random_suffix()}.parquet"
        fsio.write_bytes(
            fs, fsio.join(root, TRAJECTORIES, name), sink.getvalue().to_pybytes(), atomic=True
        )
        self._unwritten.clear()

    # -- consumers -------------------------------------------------------------------------

    def lease(
        self,
        count: int,
        current_version: int,
        max_staleness: int,
        fields: list[str] | None = None,
        timeout_s: float = 600.0,
        lease_s: float | None = None,
    ) -> Lease:
        """Wait for ``count`` ready samples (whole groups) and read them as one table.

        Unless acknowledged within ``lease_s`` (the store's default when None), the rows
        go back to the ready pool for another consumer.
        """
        started = time.monotonic()
        while True:
            left = timeout_s - (time.monotonic() - started)
            if left <= 0:
                stats = ray.get(self.handle.stats.remote())
                raise TimeoutError(
                    f"no {count} ready samples within {timeout_s:.0f} s (store: {stats}); "
                    "are the rollout workers alive?"
                )
            grant = ray.get(
                self.handle.lease.remote(
                    count, current_version, max_staleness, min(left, PROGRESS_EVERY_S), lease_s
                )
            )
            if grant is not None:
                return Lease(
                    grant.lease_id,
                    materialize(grant, fields),
                    grant.sample_ids,
                    grant.staleness,
                    grant.current_version,
                )
            log.info(
                "waiting for %d ready samples for %.0f s (store: %s)",
                count,
                time.monotonic() - started,
                ray.get(self.handle.stats.remote()),
            )

    def request(
        self,
        count: int,
        current_version: int,
        max_staleness: int,
        wait_s: float,
        lease_s: float | None = None,
    ) -> ObjectRef[LeaseGrant | None]:
        """Ask for ``count`` ready samples (whole groups, none staler than the bound); the
        answer is a ref to where they live, or to None after ``wait_s``. The flow asks, so
        it can restart dead rollout workers while it waits; the trainer reads the rows."""
        return self.handle.lease.remote(count, current_version, max_staleness, wait_s, lease_s)

    def ack(self, lease: Lease | LeaseGrant, version: int) -> int:
        """Mark a lease trained at ``version``; the ledger is flushed before this returns."""
        ask = self.handle.ack.remote(
            lease.lease_id, version, lease.sample_ids, lease.current_version
        )
        return int(ray.get(ask))

    def stats(self) -> dict[str, int]:
        return dict(ray.get(self.handle.stats.remote()))

    def drain(self, draining: bool) -> None:
        """Puts stop (or start again) waiting for room; see ``TrajectoryStore.drain``."""
        ray.get(self.handle.drain.remote(draining))

    def record(self, events: list[LedgerEvent], wait: bool = True) -> None:
        """Send ledger events of samples the store does not hold; returns once the store has
        them, or with ``wait=False`` once they are sent. One call is in flight at a time:
        each first waits until the store has the one before (``settle_records`` waits for
        the last), because Ray runs an async actor's calls out of order and a ``dropped``
        taken before its ``dispatched`` would be misread."""
        self.settle_records()
        sent = self.handle.record.remote(events)
        if wait:
            ray.get(sent)
        else:
            self._recording = sent

    def settle_records(self) -> None:
        """Wait until the store has the events ``record`` sent without waiting."""
        if self._recording is not None:
            sent, self._recording = self._recording, None
            ray.get(sent)

    def journal(self, state: dict[str, Any]) -> None:
        """Send the dispatcher's state, in order with ``record``'s events, without waiting."""
        self.settle_records()
        self._recording = self.handle.journal.remote(state)

    def recovery(self) -> DispatchRecovery | None:
        """What a restarted dispatcher rebuilds from (``TrajectoryStore.recovery``)."""
        self.settle_records()
        found: DispatchRecovery | None = ray.get(self.handle.recovery.remote())
        return found


def materialize(grant: LeaseGrant, fields: list[str] | None = None) -> pa.Table:
    """The leased rows as a table of zero-copy slices, with the controller's scalar columns."""
    blocks = [decode_block(buffer) for buffer in ray.get(grant.blocks)]
    table = pa.Table.from_batches(
        [blocks[b].slice(start, length) for b, start, length in grant.runs]
    )
    for name, values in (("reward", grant.rewards), ("advantage", grant.advantages)):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(values, pa.float32()))
    return table.select(fields) if fields else table
