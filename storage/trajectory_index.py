"""The trajectory store's bookkeeping: per-sample state, whole-group readiness and leases.

Pure logic, no Ray: the store actor (``storage.trajectory_store``) owns one index and
calls it from its event loop; unit tests drive it directly with a fake clock. The index
never sees sample data, only where each row lives (an opaque block handle and a row
number), its status and its scalar columns (reward, advantage).

Life of a sample: producers add it scored (reward and advantage known); its group becomes
ready once every sample of the group has arrived; it is leased to a consumer, and
``trained`` when the consumer acknowledges the lease. A lease that is not acknowledged in
time goes back to the ready pool. Samples too stale to use, and whatever is left when the
run ends, are ``dropped`` with the reason. A verifier error does not stop a sample: it
trains with its reward, the error kept as its ``reason``. Every transition that matters
goes to the ledger, including ``generated`` and ``scored`` when a sample is added.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.rl.staleness import StaleBy, group_version, too_stale
from sluice.storage.ledger import LedgerEvent

TERMINAL = frozenset({"trained", "dropped"})


class EventSink(Protocol):
    def append(self, events: list[LedgerEvent]) -> None: ...


class LeaseError(RuntimeError):
    """A lease is unknown, already acknowledged, or expired and handed to someone else."""


@dataclass
class SampleMeta:
    """What the index keeps per sample; ``version`` is the oldest policy version of its
    tokens, ``last_version`` the newest (``None``: the same, one version wrote them all)."""

    sample_id: str
    prompt_id: str
    group_id: str
    version: int
    reward: float | None = None
    advantage: float | None = None
    reason: str | None = None  # a verifier error: the sample still trains, with its reward
    verdict: str | None = None  # a judge model's answer, for the ledger
    last_version: int | None = None

    @property
    def span(self) -> tuple[int, int]:
        """The versions of its first and last token."""
        return self.version, self.version if self.last_version is None else self.last_version

    @property
    def is_scored(self) -> bool:
        return self.reward is not None and self.advantage is not None


@dataclass
class _Entry:
    meta: SampleMeta
    block: int
    row: int
    status: str


@dataclass
class _Group:
    size: int
    samples: list[str] = field(default_factory=list)
    version: int | None = None  # the staleness rule's date, once it is asked for (complete)


@dataclass(frozen=True)
class LeaseGrant:
    """Where a leased batch lives: row runs of object-store blocks, plus the scalar columns.

    ``runs`` holds ``(block index in blocks, first row, row count)``; rows of one group are
    contiguous in their block, so a consumer slices (no copy) instead of gathering.
    """

    lease_id: str
    blocks: list[Any]
    runs: list[tuple[int, int, int]]
    sample_ids: list[str]
    rewards: list[float]
    advantages: list[float]
    staleness: list[int]  # versions behind, by the run's rule (rl/staleness.py)
    current_version: int
    first_token_lag: list[int]  # versions behind, by each sample's first token


@dataclass
class _Lease:
    groups: list[str]
    deadline: float
    current_version: int


class TrajectoryIndex:
    """Per-sample metadata and the ready pool of one trajectory store."""

    def __init__(
        self,
        ledger: EventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        stale_by: StaleBy = "last_token",
        drop_uniform: bool = False,
    ) -> None:
        self._ledger = ledger
        self._stale_by = stale_by
        # Dynamic sampling (DAPO): a group whose rewards are all equal is dropped as it
        # completes, so the batch fills with groups that carry a learning signal.
        self._drop_uniform = drop_uniform
        self._clock = clock
        self._entries: dict[str, _Entry] = {}  # live (non-terminal) samples only
        self._seen: set[str] = set()  # every sample id ever added, to refuse duplicates
        self._groups: dict[str, _Group] = {}
        self._ready: OrderedDict[str, None] = OrderedDict()  # complete groups, oldest first
        self._leases: dict[str, _Lease] = {}
        self._blocks: dict[int, Any] = {}
        self._live_rows: dict[int, int] = {}
        self._next_block = 0
        self.counts = {"trained": 0, "dropped": 0, "expired_leases": 0}

    def has_seen(self, sample_id: str) -> bool:
        """Whether the sample's rows ever reached the store."""
        return sample_id in self._seen

    # -- producers -------------------------------------------------------------------------

    def add(
        self,
        block: Any,
        metas: list[SampleMeta],
        group_size: int | None = None,
        record: bool = True,
    ) -> None:
        """Register the rows of one stored block (row i is ``metas[i]``), all of them scored.

        ``group_size`` is how many samples each group will have; ``None`` means the groups in
        this block are complete. A group becomes ready once all its samples have arrived.
        ``record=False`` re-registers samples the ledger already knows (a restart). Raises
        ``ValueError`` and changes nothing on bad input.
        """
        self._check_new(metas, group_size)
        block_id = self._next_block
        self._next_block += 1
        self._blocks[block_id] = block
        self._live_rows[block_id] = len(metas)
        sizes = _group_sizes(metas) if group_size is None else {}
        for row, meta in enumerate(metas):
            self._seen.add(meta.sample_id)
            self._entries[meta.sample_id] = _Entry(meta, block_id, row, "scored")
            group = self._groups.setdefault(
                meta.group_id, _Group(group_size or sizes[meta.group_id])
            )
            group.samples.append(meta.sample_id)
        if record:
            self._log(
                [LedgerEvent(m.sample_id, m.prompt_id, "generated", m.version) for m in metas]
                + [
                    LedgerEvent(
                        m.sample_id, m.prompt_id, "scored", reason=m.reason, verdict=m.verdict
                    )
                    for m in metas
                ]
            )
        for group_id in dict.fromkeys(m.group_id for m in metas):
            self._maybe_ready(group_id)

    def _check_new(self, metas: list[SampleMeta], group_size: int | None) -> None:
        if not metas:
            raise ValueError("a block needs at least one row")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        unscored = next((m.sample_id for m in metas if not m.is_scored), None)
        if unscored is not None:
            raise ValueError(f"sample {unscored!r} needs both a reward and an advantage")
        ids = [m.sample_id for m in metas]
        dup = next((s for s in ids if s in self._seen), None) or _first_duplicate(ids)
        if dup is not None:
            raise ValueError(
                f"sample id {dup!r} is already in the store; sample ids must be unique"
            )
        for meta in metas:
            group = self._groups.get(meta.group_id)
            if group is not None and meta.group_id in self._ready:
                raise ValueError(f"group {meta.group_id!r} is already complete")
            if group is not None and group_size is not None and group.size != group_size:
                raise ValueError(
                    f"group {meta.group_id!r} was declared with size {group.size}, now {group_size}"
                )

    def _maybe_ready(self, group_id: str) -> None:
        group = self._groups[group_id]
        live = [self._entries[s] for s in group.samples if s in self._entries]
        arrived = len(group.samples)
        if arrived >= group.size and live and all(e.status == "scored" for e in live):
            if self._drop_uniform and (reason := _uniform(live)):
                self._finish([e.meta.sample_id for e in live], "dropped", reason=reason)
                return
            self._ready[group_id] = None

    # -- consumers -------------------------------------------------------------------------

    def take(
        self, count: int, current_version: int, max_staleness: int, lease_s: float
    ) -> LeaseGrant | None:
        """Lease whole ready groups, oldest first, until at least ``count`` samples.

        Groups staler than ``max_staleness`` are dropped first (with the reason in the
        ledger). Returns ``None``, leasing nothing, when fewer than ``count`` are ready.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.expire()
        self._drop_stale(current_version, max_staleness)
        chosen, total = [], 0
        for group_id in self._ready:
            if total >= count:
                break
            chosen.append(group_id)
            total += len(self._live(group_id))
        if total < count:
            return None
        for group_id in chosen:
            del self._ready[group_id]
            for entry in self._live(group_id):
                entry.status = "leased"
        lease_id = uuid.uuid4().hex
        self._leases[lease_id] = _Lease(chosen, self._clock() + lease_s, current_version)
        return self._grant(lease_id, chosen, current_version)

    def _version(self, group_id: str) -> int:
        """The version the staleness rule dates the group at (asked only of complete groups,
        whose samples do not change: computed once, each lease checks every ready group)."""
        group = self._groups[group_id]
        if group.version is None:
            spans = (e.meta.span for e in self._live(group_id))
            group.version = group_version(spans, self._stale_by)
        return group.version

    def _live(self, group_id: str) -> list[_Entry]:
        return [self._entries[s] for s in self._groups[group_id].samples if s in self._entries]

    def _grant(self, lease_id: str, groups: list[str], current_version: int) -> LeaseGrant:
        entries = [e for g in groups for e in self._live(g)]
        block_index: dict[int, int] = {}
        runs: list[list[int]] = []
        for e in entries:
            index = block_index.setdefault(e.block, len(block_index))
            last = runs[-1] if runs else None
            if last and last[0] == index and last[1] + last[2] == e.row:
                last[2] += 1
            else:
                runs.append([index, e.row, 1])
        return LeaseGrant(
            lease_id=lease_id,
            blocks=[self._blocks[b] for b in block_index],
            runs=[(b, start, n) for b, start, n in runs],
            sample_ids=[e.meta.sample_id for e in entries],
            rewards=[float(e.meta.reward or 0.0) for e in entries],
            advantages=[float(e.meta.advantage or 0.0) for e in entries],
            staleness=[current_version - self._version(e.meta.group_id) for e in entries],
            current_version=current_version,
            first_token_lag=[current_version - e.meta.version for e in entries],
        )

    def _drop_stale(self, current_version: int, max_staleness: int) -> None:
        for group_id in list(self._ready):
            live = self._live(group_id)
            version = self._version(group_id)
            if too_stale(current_version, version, max_staleness):
                del self._ready[group_id]
                reason = (
                    f"stale: {'finished' if self._stale_by == 'last_token' else 'started'} "
                    f"at version {version}, trainer at {current_version}, "
                    f"max_staleness {max_staleness}"
                )
                self._finish([e.meta.sample_id for e in live], "dropped", reason=reason)

    def ack(self, lease_id: str, version: int) -> int:
        """The consumer trained on the lease; its samples count as trained at ``version``."""
        self.expire()
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseError(
                f"lease {lease_id} is unknown, already acknowledged or expired (its samples "
                "went back to the ready pool); raise the lease timeout if training is slow"
            )
        ids = [e.meta.sample_id for g in lease.groups for e in self._live(g)]
        staleness = {
            s: lease.current_version - self._version(self._entries[s].meta.group_id) for s in ids
        }
        self._finish(ids, "trained", version=version, staleness=staleness)
        return len(ids)

    def has_lease(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def ack_samples(self, sample_ids: list[str], version: int, current_version: int) -> int:
        """A consumer trained on ``sample_ids`` under a lease this index never granted (the
        store restarted in place while it trained, and re-offered them): they count as
        trained at ``version``. Samples not in the ready pool (trained before the restart,
        or leased again) are passed over; returns how many were ready."""
        held = [
            s
            for s in sample_ids
            if s in self._entries and self._entries[s].meta.group_id in self._ready
        ]
        staleness = {
            s: current_version - self._version(self._entries[s].meta.group_id) for s in held
        }
        for s in held:
            self._ready.pop(self._entries[s].meta.group_id, None)
        self._finish(held, "trained", version=version, staleness=staleness)
        return len(held)

    def expire(self) -> int:
        """Return the groups of leases past their deadline to the front of the ready pool."""
        now = self._clock()
        late = [k for k, lease in self._leases.items() if lease.deadline <= now]
        for lease_id in late:
            lease = self._leases.pop(lease_id)
            for group_id in reversed(lease.groups):
                for entry in self._live(group_id):
                    entry.status = "scored"
                self._ready[group_id] = None
                self._ready.move_to_end(group_id, last=False)
        self.counts["expired_leases"] += len(late)
        return len(late)

    def drop_all(self, reason: str) -> int:
        """Drop every sample not yet trained (the run is over); returns how many."""
        self._ready.clear()
        self._leases.clear()
        ids = list(self._entries)
        if ids:
            self._finish(ids, "dropped", reason=reason)
        return len(ids)

    # -- shared ----------------------------------------------------------------------------

    def _finish(
        self,
        ids: list[str],
        status: str,
        *,
        version: int | None = None,
        reason: str | None = None,
        staleness: dict[str, int] | None = None,
    ) -> None:
        events = []
        for sample_id in ids:
            entry = self._entries.pop(sample_id)
            events.append(
                LedgerEvent(
                    sample_id,
                    entry.meta.prompt_id,
                    status,
                    version,
                    reason=reason,
                    staleness=(staleness or {}).get(sample_id),
                )
            )
            self._live_rows[entry.block] -= 1
            if self._live_rows[entry.block] == 0:  # every row is done: free the block
                del self._live_rows[entry.block], self._blocks[entry.block]
            group = self._groups[entry.meta.group_id]
            done = not any(s in self._entries for s in group.samples)
            if done and len(group.samples) >= group.size:
                del self._groups[entry.meta.group_id]
                self._ready.pop(entry.meta.group_id, None)
        self.counts[status] += len(ids)
        self._log(events)

    def _log(self, events: list[LedgerEvent]) -> None:
        if self._ledger is not None and events:
            self._ledger.append(events)

    def held(self) -> int:
        """Samples in the store that are not trained or dropped yet."""
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        ready = sum(len(self._live(g)) for g in self._ready)
        leased = sum(len(self._live(g)) for lease in self._leases.values() for g in lease.groups)
        return {
            "held": self.held(),
            "ready": ready,
            "leased": leased,
            "leases": len(self._leases),
            "blocks": len(self._blocks),
            **self.counts,
        }


def _uniform(live: list[_Entry]) -> str | None:
    """Why a complete group teaches nothing (its samples whose reward did not fail all
    scored the same), or None. DAPO: Yu et al., arXiv 2503.14476, §3.2, eq. 11."""
    rewards = {e.meta.reward for e in live if e.meta.reason is None}
    if len(rewards) > 1:
        return None
    if not rewards:
        return f"dynamic sampling: every reward of the group's {len(live)} samples failed"
    return f"dynamic sampling: all {len(live)} rewards equal ({rewards.pop():g})"


def _group_sizes(metas: list[SampleMeta]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for meta in metas:
        sizes[meta.group_id] = sizes.get(meta.group_id, 0) + 1
    return sizes


def _first_duplicate(ids: list[str]) -> str | None:
    seen: set[str] = set()
    for sample_id in ids:
        if sample_id in seen:
            return sample_id
        seen.add(sample_id)
    return None
