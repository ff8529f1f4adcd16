"""Versioned parameter service: the trainer publishes weights, rollout workers pull them.

Components, after Laminar's relays. The trainer calls :meth:`ParameterService.publish`
with ``(version, state dict)``; publish only records the tensors and returns. Two threads
of the service, in the trainer's process, do the rest in order: the snapshot thread copies
every tensor once, with torch, into a staging buffer (a flat byte buffer per bucket of
safetensors-format parts, allocated on the first publish and reused after), then the
hand-over thread puts the buckets into the Ray object store (a second copy) and offers them
to relay 0, then waits until relay 0 has taken the version.

**The trainer must not change the published tensors until**
:meth:`ParameterService.wait_snapshot` **returns.** Its weights change only in the
optimizer step, and a forward and a backward pass (which only read them) lie between a
publish and that step, so the copy normally finishes long before the trainer calls
``wait_snapshot`` right before ``optimizer.step()`` (and before loading a checkpoint).
A publish first waits for the previous version's snapshot.

There are ``MAX_IN_FLIGHT`` staging buffers, so a version can be snapshotted while the
previous one is still being handed over; past that a publish waits for the oldest.
:meth:`ParameterService.flush` waits until relay 0 has taken every published version (the
trainer calls it before a checkpoint and at shutdown).

A ``Relay`` actor holds the newest version it has taken and nothing older: it fetches an
offered version to its own node and re-puts it as objects it owns, so the version outlives
the trainer process, then drops its references to the previous version so Ray frees it.
Relays form a chain (relay 0 forwards every version it takes to relay 1, and so on)
spread over the nodes, so a far node pulls from a relay next to it. Rollout workers ask
when they choose ("anything newer than version 6?": :meth:`ParameterService.ask`, then
:meth:`ParameterService.collect`, or :meth:`ParameterService.pull_blobs` for both); the
trainer never waits for them. ``ParameterService`` is a picklable handle on the relays,
handed to the trainer and the rollout workers by whoever creates it; the staging buffers
and the threads stay in the process that publishes.

Every wait on Ray has a timeout, and Ray's timeout, dead-actor and lost-object errors come
back as :class:`ParameterError` naming the version, the relay and the timeout. A failed
snapshot or hand-over is raised once: from the trainer's next ``publish`` or ``flush``,
whichever comes first, oldest version first, or, for a failed snapshot, from
``wait_snapshot`` if that comes first (it raises only the newest version's snapshot).

Ray 2.56 removed ``ray.put(..., _owner=)``, so the trainer cannot create objects on a
relay's behalf: until relay 0 has taken a version (the hand-over's put, then one more copy
by the relay) the version lives only in the trainer's process, and a trainer that dies in
that window loses that one version; the relay keeps serving the previous one.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayError
from safetensors.torch import load as load_safetensors

logger = logging.getLogger(__name__)

# The version a relay reports before it has taken any.
EMPTY = -1
# Big enough that the per-object cost of the object store is noise, small enough that a
# bucket moves between nodes while the next one is being copied.
DEFAULT_BUCKET_BYTES = 64 << 20
# How long a relay waits for an offered version's buckets before giving up on it, and how
# long a hand-over waits for relay 0 to take a version.
FETCH_TIMEOUT_S = 120.0
# Versions a publisher may have published that relay 0 has not taken yet: one staging
# buffer (a full copy of the weights in the trainer's memory) each. Two let a version be
# snapshotted while the previous one is being handed over; past that a publish waits.
MAX_IN_FLIGHT = 2
# How long a publish waits for the previous version's snapshot (normally finished long
# before: a forward and a backward pass run in between), and wait_snapshot's default.
SNAPSHOT_TIMEOUT_S = 60.0
# A hand-over gives up on relay 0 by itself after fetch_timeout; a publish waiting for
# the oldest one allows this much more for its puts into the object store.
PUT_SLACK_S = 60.0
# How long create() waits for the relay actors to start.
START_TIMEOUT_S = 120.0
# Offers run in their own threads so that a slow fetch never delays `latest`; two let a
# newer version be fetched while an older, slow one is still arriving.
_RELAY_OPTIONS: dict[str, Any] = {"num_cpus": 0, "concurrency_groups": {"fetch": 2}}

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec).
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

# One bucket as it travels: a safetensors header, then the raw bytes of its tensors in
# the header's order (one array). Joined, the parts are a safetensors file.
Parts = list[Any]


class ParameterError(RuntimeError):
    """A publish or pull failed; the message names the version, the relay and the timeout."""


# -- buckets -------------------------------------------------------------------------------


def _header(entries: list[tuple[str, str, list[int], int]]) -> bytes:
    """The safetensors header (length, then JSON) for tensors laid out in this order."""
    table: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, dtype, shape, size in entries:
        table[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data starts 8-byte aligned, as safetensors writes
    return struct.pack("<Q", len(text)) + text


def _layout_key(state: Mapping[str, torch.Tensor]) -> tuple[tuple[str, torch.dtype, Any], ...]:
    """What a staging buffer's layout depends on: the names, dtypes and shapes."""
    return tuple((name, state[name].dtype, tuple(state[name].shape)) for name in sorted(state))


class _Snapshot:
    """A state dict's bytes in buckets: one flat uint8 buffer per bucket, filled in place.

    Buckets hold at most ~bucket_bytes of tensor data, names in sorted order (a tensor
    larger than ``bucket_bytes`` gets a bucket of its own); within a bucket the widest
    dtypes come first, which keeps every tensor aligned to its element size. ``views``
    are typed windows on the buffers, one per tensor, so a snapshot is one ``copy_`` per
    tensor: it reads any device and layout, and releases the GIL.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], bucket_bytes: int) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        for name, tensor in state.items():
            if tensor.dtype not in _DTYPES:
                raise ParameterError(
                    f"tensor {name!r} has dtype {tensor.dtype}, which safetensors lacks"
                )
        self.key = _layout_key(state)
        self.headers: list[bytes] = []
        self.buffers: list[torch.Tensor] = []
        self.views: dict[str, torch.Tensor] = {}
        for names in self._groups(state, bucket_bytes):
            names.sort(key=lambda n: (-state[n].element_size(), n))
            sizes = [state[n].nbytes for n in names]
            buffer = torch.empty(sum(sizes), dtype=torch.uint8)
            offset = 0
            for name, size in zip(names, sizes, strict=True):
                window = buffer[offset : offset + size].view(state[name].dtype)
                self.views[name] = window.view(state[name].shape)
                offset += size
            entries = [
                (n, _DTYPES[state[n].dtype], list(state[n].shape), size)
                for n, size in zip(names, sizes, strict=True)
            ]
            self.headers.append(_header(entries))
            self.buffers.append(buffer)

    @staticmethod
    def _groups(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
        groups: list[list[str]] = []
        filled = 0
        for name in sorted(state):
            size = state[name].nbytes
            if not groups or (filled + size > bucket_bytes and filled > 0):
                groups.append([])
                filled = 0
            groups[-1].append(name)
            filled += size
        return groups

    def fill(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` (of this snapshot's layout) into the buffers."""
        with torch.no_grad():
            for name, view in self.views.items():
                view.copy_(state[name])

    def parts(self) -> list[Parts]:
        """The buckets as they travel; the arrays are views of the buffers, not copies."""
        return [[h, b.numpy()] for h, b in zip(self.headers, self.buffers, strict=True)]


def from_buckets(blobs: Iterable[bytes]) -> dict[str, torch.Tensor]:
    """The tensors of safetensors blobs, merged; a name in two blobs is a ParameterError."""
    state: dict[str, torch.Tensor] = {}
    for index, blob in enumerate(blobs):
        for name, tensor in load_safetensors(blob).items():
            if name in state:
                raise ParameterError(f"tensor {name!r} appears twice (again in bucket {index})")
            state[name] = tensor
    return state


def _get(refs: Any, timeout: float) -> Any:
    """``ray.get`` that always has a timeout (and a type mypy accepts for nested refs)."""
    return ray.get(refs, timeout=timeout)


def _copy(version: int, snapshot: _Snapshot, state: Mapping[str, torch.Tensor]) -> None:
    """Fill a staging buffer; runs in the snapshot thread (``copy_`` releases the GIL)."""
    try:
        snapshot.fill(state)
    except RuntimeError as err:  # torch's errors, e.g. a tensor without data (meta device)
        raise ParameterError(
            f"copying version {version} into a staging buffer failed: {err}"
        ) from err


# -- relays --------------------------------------------------------------------------------


class _Relay:
    """Holds the newest version it has taken as objects it owns; forwards it downstream."""

    def __init__(self, index: int, downstream: ActorHandle | None, fetch_timeout: float) -> None:
        self._index = index
        self._downstream = downstream
        self._fetch_timeout = fetch_timeout
        self._lock = threading.Lock()
        self._version = EMPTY
        self._refs: list[ray.ObjectRef] = []

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group="fetch")
    def offer(self, version: int, refs: list[ray.ObjectRef]) -> bool:
        """Take ``version`` if it is newer than the one held; True if it was taken.

        The refs arrive unresolved (nested in a list); the relay fetches the buckets to its
        own node and re-puts them, so it owns them and they outlive whoever offered them.
        """
        with self._lock:
            held = self._version
        if version <= held:
            logger.warning("relay %d ignores version %d: it holds %d", self._index, version, held)
            return False
        try:
            buckets = _get(refs, self._fetch_timeout)
        except GetTimeoutError as err:
            raise ParameterError(
                f"relay {self._index} timed out after {self._fetch_timeout:g} s fetching "
                f"version {version}"
            ) from err
        except ObjectLostError as err:
            raise ParameterError(
                f"relay {self._index} lost version {version} before taking it (did the "
                f"publisher die?): {err}"
            ) from err
        owned = [ray.put(parts) for parts in buckets]
        with self._lock:
            if version <= self._version:
                return False  # a newer offer finished first
            self._version, self._refs = version, owned
        if self._downstream is not None:
            self._downstream.offer.remote(version, owned)
        return True

    def latest(self, after: int) -> tuple[int, list[ray.ObjectRef]] | None:
        """The held version and its bucket refs, or None if it is not newer than ``after``."""
        with self._lock:
            if self._version <= after:
                return None
            return self._version, list(self._refs)

    def version(self) -> int:
        with self._lock:
            return self._version


# Typed Any: Ray's stubs know neither `concurrency_groups` nor `.options(...)` on actors.
Relay: Any = ray.remote(**_RELAY_OPTIONS)(_Relay)


# -- the handle ----------------------------------------------------------------------------


def _ray_failure(err: Exception, what: str, relay: int, timeout: float) -> ParameterError:
    if isinstance(err, GetTimeoutError):
        return ParameterError(
            f"{what} from relay {relay} timed out after {timeout:g} s; is the relay alive?"
        )
    if isinstance(err, RayActorError):
        return ParameterError(f"{what} from relay {relay} failed: the relay is dead ({err})")
    return ParameterError(f"{what} from relay {relay} failed: its buckets are lost ({err})")


class _Slot:
    """A staging buffer and the version it holds: its snapshot, then its hand-over.

    ``copied`` and ``handover`` are the snapshot thread's and the hand-over thread's work
    on the version; ``handover`` is None once settled (the slot is free).
    """

    def __init__(self) -> None:
        self.snapshot: _Snapshot | None = None
        self.version = EMPTY
        self.copied: Future[None] | None = None
        self.handover: Future[None] | None = None


@dataclass(frozen=True)
class PendingPull:
    """A relay's answer on its way (``ParameterService.ask``)."""

    relay: int
    after: int
    answer: ray.ObjectRef

    def answered(self) -> bool:
        return bool(ray.wait([self.answer], timeout=0)[0])


class ParameterService:
    """A picklable handle on the relays; pass it to the trainer and the rollout workers."""

    def __init__(
        self,
        relays: list[ActorHandle],
        node_ids: list[str],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        fetch_timeout: float = FETCH_TIMEOUT_S,
    ) -> None:
        if not relays or len(relays) != len(node_ids):
            raise ValueError(
                f"need a relay and one node id per relay, got {len(relays)} relays and "
                f"{len(node_ids)} node ids"
            )
        self.relays = relays
        self.node_ids = node_ids
        self.bucket_bytes = bucket_bytes
        self.fetch_timeout = fetch_timeout
        self._reset_publisher()

    def _reset_publisher(self) -> None:
        """Publisher-side state: stays in the process that publishes (see __getstate__)."""
        self._published = EMPTY
        self._slots = [_Slot() for _ in range(MAX_IN_FLIGHT)]
        # The slot of the newest version while wait_snapshot has not seen its snapshot done.
        self._copying: _Slot | None = None
        self._snapshot_thread: ThreadPoolExecutor | None = None
        self._handover_thread: ThreadPoolExecutor | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "relays": self.relays,
            "node_ids": self.node_ids,
            "bucket_bytes": self.bucket_bytes,
            "fetch_timeout": self.fetch_timeout,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_publisher()

    @classmethod
    def create(
        cls,
        relays: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        first_at: Any = None,
    ) -> ParameterService:
        """Start a chain of ``relays`` relay actors (0 CPUs each), spread over the nodes.

        ``first_at``: a Ray scheduling strategy for relay 0 (the flow pins it to its own
        node, so losing a worker node never takes the published version with it).
        """
        if relays < 1:
            raise ValueError(f"relays must be at least 1, got {relays}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        handles: list[ActorHandle] = []
        downstream: ActorHandle | None = None
        for index in reversed(range(relays)):
            downstream = Relay.options(
                scheduling_strategy=first_at if index == 0 and first_at else "SPREAD",
            ).remote(index, downstream, FETCH_TIMEOUT_S)
            handles.insert(0, downstream)
        try:
            node_ids: list[str] = _get([h.node_id.remote() for h in handles], START_TIMEOUT_S)
        except (GetTimeoutError, RayActorError) as err:
            for handle in handles:
                ray.kill(handle)
            raise ParameterError(
                f"{relays} parameter relay(s) did not start within {START_TIMEOUT_S:g} s: {err}"
            ) from err
        return cls(handles, node_ids, bucket_bytes)

    # -- trainer side ----------------------------------------------------------------------

    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> float:
        """Hand ``state`` to the background to snapshot and pass on; returns seconds spent.

        **Do not modify ``state`` (its tensors, in place or not) until** :meth:`wait_snapshot`
        **returns**: publish only records the tensors, and the snapshot thread copies them
        into a staging buffer after publish has returned. The trainer calls
        ``wait_snapshot`` right before each optimizer step and before loading a checkpoint.
        CUDA tensors are read on the snapshot thread's current (default) stream.

        First raises (without publishing) an earlier failed snapshot or hand-over, then
        waits for the previous version's snapshot (normally long done), and, when
        ``MAX_IN_FLIGHT`` versions are still being handed over, for the oldest of them.
        """
        start = time.perf_counter()
        if version <= self._published:
            raise ParameterError(
                f"published version {version} is not newer than version {self._published}, "
                "published before"
            )
        for slot, handover in self._busy():
            if handover.done():
                self._settle(slot)
        self.wait_snapshot()
        slot = self._free_slot()
        if slot.snapshot is None or slot.snapshot.key != _layout_key(state):
            slot.snapshot = _Snapshot(state, self.bucket_bytes)
        if self._snapshot_thread is None or self._handover_thread is None:
            self._snapshot_thread = ThreadPoolExecutor(1, thread_name_prefix="param-snapshot")
            self._handover_thread = ThreadPoolExecutor(1, thread_name_prefix="param-handover")
        slot.version = version
        slot.copied = self._snapshot_thread.submit(_copy, version, slot.snapshot, dict(state))
        slot.handover = self._handover_thread.submit(
            self._hand_over, version, slot.copied, slot.snapshot.parts()
        )
        self._copying = slot
        self._published = version
        return time.perf_counter() - start

    def wait_snapshot(self, timeout: float = SNAPSHOT_TIMEOUT_S) -> float:
        """Wait until the newest published version has been copied; returns seconds waited.

        From then on the caller may modify the tensors it published. Returns at once when
        there is nothing to wait for (the usual case). Raises a ParameterError if the copy
        failed (once: not again from ``publish`` or ``flush``), or if it has not finished
        within ``timeout`` seconds (the tensors must then stay untouched; call again).
        """
        slot = self._copying
        if slot is None or slot.copied is None:
            return 0.0
        start = time.perf_counter()
        copied = slot.copied
        if not wait([copied], timeout).done:
            raise ParameterError(
                f"the snapshot of version {slot.version} is still being copied after "
                f"{timeout:g} s; its tensors must not change until it is done"
            )
        self._copying = None
        failure = copied.exception()
        if failure is not None:
            # The hand-over fails at once without this version; the slot is free again.
            slot.copied = slot.handover = None
            raise failure
        return time.perf_counter() - start

    def flush(self, timeout: float = FETCH_TIMEOUT_S) -> None:
        """Wait until relay 0 has taken every published version (or a newer one).

        Raises the oldest failed snapshot or hand-over (call again for the next), or a
        ParameterError if relay 0 has not taken them all within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        for slot, handover in self._busy():
            if not wait([handover], max(deadline - time.monotonic(), 0.0)).done:
                raise ParameterError(
                    f"relay 0 has not taken version {slot.version} within the flush's {timeout:g} s"
                )
            self._settle(slot)

    def _busy(self) -> list[tuple[_Slot, Future[None]]]:
        """Slots with an unsettled hand-over, and the hand-over, oldest version first."""
        busy = [(slot, slot.handover) for slot in self._slots if slot.handover is not None]
        return sorted(busy, key=lambda pair: pair[0].version)

    def _settle(self, slot: _Slot) -> None:
        """Free the slot of a finished hand-over; raise its error (or its snapshot's)."""
        handover, slot.handover = slot.handover, None
        if self._copying is slot:
            self._copying = None  # a finished hand-over means a finished snapshot
        if handover is not None:
            handover.result(timeout=0)  # re-raises the thread's ParameterError

    def _free_slot(self) -> _Slot:
        """A slot without a hand-over, waiting for the oldest hand-over if there is none."""
        for slot in self._slots:
            if slot.handover is None:
                return slot
        oldest, handover = self._busy()[0]
        patience = self.fetch_timeout + PUT_SLACK_S
        if not wait([handover], patience).done:
            raise ParameterError(
                f"the hand-over of version {oldest.version} to relay 0 has not finished after "
                f"{patience:g} s, with {MAX_IN_FLIGHT} versions waiting; is the object store "
                "full?"
            )
        self._settle(oldest)
        return oldest

    def _hand_over(self, version: int, copied: Future[None], buckets: list[Parts]) -> None:
        """Once the snapshot is copied, put its buckets into the object store, offer, wait.

        Runs in the hand-over thread, one version after another, so relay 0 is offered the
        versions in order. The snapshot thread always finishes a copy, so the wait for it
        has no timeout; a failed copy fails the hand-over with the same error. ``ray.put``
        has copied a bucket into the object store when it returns, so the staging buffer
        is free once the puts are done; its slot stays busy until relay 0 has taken the
        version, which bounds the object-store copies that relay 0 has not taken to one.
        """
        copied.result()  # re-raises the snapshot's ParameterError
        try:
            refs = [ray.put(parts) for parts in buckets]
        except RayError as err:
            raise ParameterError(f"putting version {version} into the object store: {err}") from err
        taken: ray.ObjectRef = self.relays[0].offer.remote(version, refs)
        # The pending offer keeps the buckets alive until relay 0 has them; the refs must
        # not outlive it in this frame, which a failure's traceback keeps until settled.
        del refs
        try:
            _get(taken, self.fetch_timeout)
        except GetTimeoutError as err:
            raise ParameterError(
                f"relay 0 has not taken version {version} after {self.fetch_timeout:g} s; "
                "is the relay alive?"
            ) from err
        except RayError as err:
            raise ParameterError(f"relay 0 did not take version {version}: {err}") from err

    # -- puller side -----------------------------------------------------------------------

    def latest_version(self, timeout: float = 10.0) -> int:
        """The newest version relay 0 holds (-1 before the first one arrives)."""
        try:
            version: int = _get(self.relays[0].version.remote(), timeout)
        except (GetTimeoutError, RayActorError) as err:
            raise _ray_failure(err, "asking for the latest version", 0, timeout) from err
        return version

    def _nearest(self) -> int:
        """A relay on this node if there is one, else relay 0."""
        here = ray.get_runtime_context().get_node_id()
        return self.node_ids.index(here) if here in self.node_ids else 0

    def pull_blobs(self, after: int, timeout: float = 30.0) -> tuple[int, list[bytes]] | None:
        """The newest version if newer than ``after``, as safetensors blobs; else None."""
        return self.collect(self.ask(after), timeout)

    def ask(self, after: int) -> PendingPull:
        """Ask the nearest relay (on this node, else relay 0) for a version newer than
        ``after`` without waiting for its answer: a puller that has other work checks
        ``PendingPull.answered`` and then ``collect``s."""
        index = self._nearest()
        return PendingPull(index, after, self.relays[index].latest.remote(after))

    def collect(self, asked: PendingPull, timeout: float = 30.0) -> tuple[int, list[bytes]] | None:
        """The answer to ``asked``: the newer version's blobs, or None; waits up to
        ``timeout`` for the answer and the blobs together."""
        deadline = time.monotonic() + timeout
        what = f"parameter pull of a version newer than {asked.after}"
        try:
            found: tuple[int, list[ray.ObjectRef]] | None = _get(asked.answer, timeout)
            if found is None:
                return None
            version, refs = found
            what = f"parameter pull of version {version}"
            buckets = _get(refs, max(deadline - time.monotonic(), 0.0))
        except (GetTimeoutError, RayActorError, ObjectLostError) as err:
            raise _ray_failure(err, what, asked.relay, timeout) from err
        return version, [b"".join(parts) for parts in buckets]

    def shutdown(self) -> None:
        """Kill the relays; their versions are freed with them, and pending hand-overs fail."""
        for thread in (self._snapshot_thread, self._handover_thread):
            if thread is not None:
                thread.shutdown(wait=False, cancel_futures=True)
        for handle in self.relays:
            ray.kill(handle)
