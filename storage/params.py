"""Versioned parameter service: the trainer publishes weights, rollout workers pull them.

Components, after Laminar's relays. The trainer calls :meth:`ParameterService.publish`
with ``(version, state dict)``; publish only records the tensors and returns. Two threads
of the service, in the trainer's process, do the rest in order: the snapshot thread copies
every tensor once, with torch, into a staging buffer (a flat byte buffer per bucket of
safetensors-format parts, allocated on the first publish and reused after), casting
floating-point tensors to the rollout engines' dtype on the way (``dtype``: the weights
travel in it); then the hand-over thread puts the buckets into the Ray object store (a
second copy) one at a time, each handed to relay 0 and dropped once relay 0 has copied it,
and finally asks relay 0 to commit the version. A sharded trainer (FSDP2, ZeRO-3), whose
ranks gather the weights one tensor at a time, calls :meth:`ParameterService.publish_from`
instead: each tensor goes into the bucket being filled as it is gathered, and each full
bucket straight to relay 0, so no process holds the whole version; that publish returns
once relay 0 has committed.

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

A ``Relay`` actor holds the newest version it has taken and nothing older: it copies each
incoming bucket into an object it owns before taking the next, so the version outlives the
trainer process and the relay never holds an incoming version beside its copy; once the new
version is complete it drops its references to the previous one, which Ray frees as soon
as no puller still holds it. Relay 0 forwards every version it takes to each other relay;
with ``relays="per_node"`` there is one on every node, so the weight checks of a node's
rollout workers stay on that node (at 1024 accelerators one relay for all would answer
thousands of checks a second; BENCHMARKS.md, control plane). The others hang off relay 0
alone: losing a node loses only its own relay, and a node without one (it joined later,
or lost its relay) asks relay 0. Rollout workers ask when they choose ("anything newer
than version 6?": :meth:`ParameterService.ask`, then :meth:`ParameterService.collect`, or
:meth:`ParameterService.pull` for both); the trainer never waits for them. A pull answers
:class:`Weights`: the version's buckets, fetched to the worker's node, which yield their
tensors as views of the object store's buffers, bucket by bucket in name order, while the
engine loads them; nothing joins or copies the version in the worker's process.
``ParameterService`` is a picklable handle on the relays, handed to the trainer and the
rollout workers by whoever creates it; the staging buffers and the threads stay in the
process that publishes.

Each version carries digests (xxh3-128, about 18 GB/s on one core here): one per bucket,
computed by the publisher as it hands the bucket over, and one for the whole version over
its number and the buckets' digests, which relay 0 keeps for ``HISTORY`` versions
(:meth:`ParameterService.published_digest`). A puller checks every bucket it received against
the publisher's digest before it yields a tensor (:class:`Weights`), so bytes cut, changed or
mixed up on the way are a :class:`ParameterError` before the engine loads any of them, and
``Weights.loaded`` is the version's digest only once the engine has read every tensor: the
digest a rollout worker reports as the one it serves, which the driver compares with the
published one (``driver/weight_sync.py``).

Every wait on Ray has a timeout, and Ray's timeout, dead-actor and lost-object errors come
back as :class:`ParameterError` naming the version, the relay and the timeout. A failed
snapshot or hand-over is raised once: from the trainer's next ``publish`` or ``flush``,
whichever comes first, oldest version first, or, for a failed snapshot, from
``wait_snapshot`` if that comes first (it raises only the newest version's snapshot).

Ray 2.56 removed ``ray.put(..., _owner=)``, so the trainer cannot create objects on a
relay's behalf: until relay 0 has committed a version the version lives only in the
trainer's process, and a trainer that dies in that window loses that one version; the relay
keeps serving the previous one.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import ray
import torch
import xxhash
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from safetensors.torch import load as load_safetensors

from sluice.storage.faults import fault_point

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
# Whole-version digests relay 0 keeps, for the driver to compare served ones with.
HISTORY = 4096
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
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
# The wire dtypes a publisher may cast floating-point tensors to (``ParameterService.dtype``).
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# A version as an engine loads it: (name, tensor) pairs, read once, in name order.
NamedTensors = Iterable[tuple[str, torch.Tensor]]

# One bucket as it travels: a safetensors header, then the raw bytes of its tensors in
# the header's order (one array). Joined, the parts are a safetensors file.
Parts = list[Any]


class RelayRestarted(RuntimeError):
    """Relay 0 was asked to commit a version it has only part of: it restarted in place
    during the hand-over and lost the buckets it had copied before."""


class ParameterError(RuntimeError):
    """A publish or pull failed; the message names the version, the relay and the timeout."""


class PullFailed(ParameterError):
    """A pulled version could not be read before any of it reached the engine (a bucket
    lost, late, or not what was published): the engine still serves what it served, and a
    later pull can fetch a newer version."""


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


def wire_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a torch dtype (a name of ``WIRE_DTYPES`` or a torch dtype), or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire dtype {dtype} is not one of {sorted(WIRE_DTYPES)}")
        return dtype
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[dtype]


def _on_wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` travels in: ``dtype`` for floating point, else its own."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _layout_key(
    state: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> tuple[tuple[str, torch.dtype, Any], ...]:
    """What a staging buffer's layout depends on: the names, wire dtypes and shapes."""
    return tuple(
        (name, _on_wire(state[name], dtype), tuple(state[name].shape)) for name in sorted(state)
    )


def _cut(names: list[str], size: Mapping[str, int], bucket_bytes: int) -> list[list[str]]:
    """``names`` in their order, cut into buckets of at most ~``bucket_bytes`` (a tensor
    larger than that gets a bucket of its own)."""
    groups: list[list[str]] = []
    filled = 0
    for name in names:
        if not groups or (filled + size[name] > bucket_bytes and filled > 0):
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += size[name]
    return groups


class _Snapshot:
    """A state dict's bytes in buckets: one flat uint8 buffer per bucket, filled in place.

    Buckets hold at most ~bucket_bytes of tensor data, names in sorted order (a tensor
    larger than ``bucket_bytes`` gets a bucket of its own); within a bucket the widest
    dtypes come first, which keeps every tensor aligned to its element size. ``views``
    are typed windows on the buffers, one per tensor, so a snapshot is one ``copy_`` per
    tensor: it reads any device and layout, casts floating-point tensors to the wire
    ``dtype`` on the way (None: no cast), and releases the GIL.
    """

    def __init__(
        self, state: Mapping[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype | None
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        for name, tensor in state.items():
            if tensor.dtype not in _DTYPES:
                raise ParameterError(
                    f"tensor {name!r} has dtype {tensor.dtype}, which safetensors lacks"
                )
        self.key = _layout_key(state, dtype)
        wire = {name: _on_wire(tensor, dtype) for name, tensor in state.items()}
        size = {name: state[name].numel() * wire[name].itemsize for name in state}
        self.headers: list[bytes] = []
        self.buffers: list[torch.Tensor] = []
        self.views: dict[str, torch.Tensor] = {}
        for names in self._groups(size, bucket_bytes):
            names.sort(key=lambda n: (-wire[n].itemsize, n))
            buffer = torch.empty(sum(size[n] for n in names), dtype=torch.uint8)
            offset = 0
            for name in names:
                window = buffer[offset : offset + size[name]].view(wire[name])
                self.views[name] = window.view(state[name].shape)
                offset += size[name]
            entries = [(n, _DTYPES[wire[n]], list(state[n].shape), size[n]) for n in names]
            self.headers.append(_header(entries))
            self.buffers.append(buffer)

    @staticmethod
    def _groups(size: Mapping[str, int], bucket_bytes: int) -> list[list[str]]:
        return _cut(sorted(size), size, bucket_bytes)

    def fill(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` (of this snapshot's layout) into the buffers."""
        with torch.no_grad():
            for name, view in self.views.items():
                view.copy_(state[name])

    def parts(self) -> list[Parts]:
        """The buckets as they travel; the arrays are views of the buffers, not copies."""
        return [[h, b.numpy()] for h, b in zip(self.headers, self.buffers, strict=True)]


def bucket_tensors(header: bytes, data: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one bucket (its safetensors header and its data), in name order, as
    views of ``data`` (any buffer, e.g. the object store's): nothing is copied.

    The views are read-only in fact (torch cannot mark them so): a consumer copies them.
    """
    (length,) = struct.unpack("<Q", header[:8])
    table = json.loads(header[8 : 8 + length])
    table.pop("__metadata__", None)
    if memoryview(data).nbytes == 0:
        flat = torch.empty(0, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():  # the object store's buffers are read-only
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            flat = torch.frombuffer(data, dtype=torch.uint8)
    for name in sorted(table):
        entry = table[name]
        start, end = entry["data_offsets"]
        yield name, flat[start:end].view(_TORCH_DTYPES[entry["dtype"]]).view(entry["shape"])


def bucket_digest(header: bytes, data: Any) -> str:
    """The digest of one bucket as it travels: its safetensors header and its bytes. A
    check for bytes lost, cut or mixed up on the way, not against an adversary."""
    digest = xxhash.xxh3_128(header)
    digest.update(data)
    return digest.hexdigest()


def version_digest(version: int, buckets: Iterable[str]) -> str:
    """A version's digest: over its number and its buckets' digests, in order (the same
    bytes published as another version do not pass for it)."""
    return xxhash.xxh3_128(f"{version}:{','.join(buckets)}".encode()).hexdigest()


def digest_number(digest: str) -> float:
    """A digest's first 52 bits as a float, exactly: how a rollout worker's stream counters
    (all floats) carry the digest it serves; 0.0 for none."""
    return float(int(digest[:13], 16)) if digest else 0.0


class Weights:
    """One pulled version, read lazily: iterate for ``(name, tensor)`` in name order.

    Holds the refs of the version's buckets, which Ray has fetched to this node's object
    store; iterating gets one bucket at a time and yields views of the object store's
    buffers (``torch.frombuffer``), so a pull never joins the version into one ``bytes``
    nor copies it into this process: the consumer's copy is the only one. A bucket stays
    mapped while a tensor of it is referenced; the version stays in the object store while
    this object (or the relay) holds it: drop it once loaded.

    Before the first tensor, every bucket is checked against ``digests``, the publisher's
    (a ParameterError names the first that differs); ``loaded`` is the version's digest
    once every tensor has been read, None before (a load skipped or cut short).
    """

    def __init__(
        self,
        version: int,
        refs: list[ray.ObjectRef],
        relay: int,
        timeout: float,
        digests: list[str],
    ) -> None:
        if len(digests) != len(refs):
            raise ParameterError(
                f"version {version} from relay {relay} has {len(refs)} buckets but "
                f"{len(digests)} digests"
            )
        self.version = version
        self.refs = refs
        self.relay = relay
        self.timeout = timeout
        self.digests = digests
        self.loaded: str | None = None
        self._checked = False

    def _bucket(self, index: int) -> Parts:
        try:
            return _get(self.refs[index], self.timeout)
        except (GetTimeoutError, RayActorError, ObjectLostError) as err:
            raise _ray_failure(
                err, f"bucket {index} of version {self.version}", self.relay, self.timeout
            ) from err

    def check(self) -> None:
        """Every bucket against the publisher's digest; a ParameterError names the first
        bucket that differs. Each is mapped from the object store and hashed, not copied."""
        if self._checked:
            return
        for index, published in enumerate(self.digests):
            try:
                header, data = self._bucket(index)
            except ParameterError as err:
                raise PullFailed(str(err)) from err
            received = bucket_digest(header, data)
            del header, data
            if received != published:
                raise PullFailed(
                    f"bucket {index} of version {self.version} from relay {self.relay} is not "
                    f"what the trainer published (digest {received}, published {published}): "
                    "its bytes were cut or changed on the way. Nothing of it was loaded"
                )
        self._checked = True

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.check()
        for index in range(len(self.refs)):
            header, data = self._bucket(index)
            yield from bucket_tensors(header, data)
            del header, data  # unmapped before the next bucket is fetched
            fault_point("worker.weight_load")  # tests: a worker dying half way through
        self.loaded = version_digest(self.version, self.digests)

    def blobs(self) -> list[bytes]:
        """Every bucket as a safetensors file in memory, checked: a copy, for tools and
        tests."""
        self.check()
        return [b"".join(parts) for parts in _get(self.refs, self.timeout)]


def safetensors_tensors(blobs: Iterable[bytes]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of safetensors files in memory, file by file, in name order."""
    for blob in blobs:
        yield from sorted(load_safetensors(bytes(blob)).items())


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
    """Holds the newest version it has taken as objects it owns; forwards it downstream.

    A version arrives bucket by bucket, and the relay copies each into an object of its own
    (so it outlives whoever sent it) before the next: it never holds the incoming version
    beside its copy, only one incoming bucket. The version it holds stays until a newer one
    is complete (pullers keep getting a whole version), then goes: Ray frees it once no
    puller that took it still holds it.
    """

    def __init__(self, index: int, downstream: list[ActorHandle], fetch_timeout: float) -> None:
        self._index = index
        self._downstream = downstream
        self._offers: list[ray.ObjectRef | None] = [None] * len(downstream)  # the last, each
        self._fetch_timeout = fetch_timeout
        self._lock = threading.Lock()
        self._version = EMPTY
        self._refs: list[ray.ObjectRef] = []
        self._digests: list[str] = []  # the publisher's, one per bucket of the held version
        self._history: dict[int, str] = {}  # version: its digest, the newest HISTORY
        # The version being taken from the publisher, and the buckets of it copied so far.
        self._staging = EMPTY
        self._staged: dict[int, ray.ObjectRef] = {}
        # Which process of the relay this is: newer after each restart in place.
        self._incarnation = time.time_ns()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group="fetch")
    def take(self, version: int, index: int, parts: Parts) -> bool:
        """Copy bucket ``index`` of ``version`` (resolved by Ray: a view of the sender's
        object) into an object this relay owns; False if a version as new is held.

        The publisher drops its copy of the bucket once this returns, so the object store
        holds at most the publisher's next bucket beside the relay's copies.
        """
        with self._lock:
            if version <= self._version:
                return False
            if self._staging != version:  # a new version: an unfinished older one is dropped
                self._staging, self._staged = version, {}
        owned = ray.put(parts)
        fault_point("relay.handover")  # tests: relay 0 dying half way through a version
        with self._lock:
            if self._staging != version:
                return False
            self._staged[index] = owned
        return True

    @ray.method(concurrency_group="fetch")
    def commit(self, version: int, count: int, digests: list[str]) -> bool:
        """Serve ``version``, whose ``count`` buckets ``take`` has copied, with the
        publisher's ``digests`` of them; forward it."""
        with self._lock:
            if version <= self._version:
                return False
            if len(digests) != count:
                raise ParameterError(
                    f"relay {self._index} cannot commit version {version}: {count} buckets "
                    f"but {len(digests)} digests"
                )
            if self._staging != version or sorted(self._staged) != list(range(count)):
                raise RelayRestarted(
                    f"relay {self._index} cannot commit version {version}: it has buckets "
                    f"{sorted(self._staged)} of version {self._staging}, not 0..{count - 1}"
                )
            owned = [self._staged[i] for i in range(count)]
            self._staging, self._staged = EMPTY, {}
        return self._install(version, owned, digests)

    @ray.method(concurrency_group="fetch")
    def offer(self, version: int, refs: list[ray.ObjectRef], digests: list[str]) -> bool:
        """Take ``version`` from the upstream relay if it is newer than the one held; True if
        it was taken.

        The refs arrive unresolved (nested in a list) and stay alive upstream; the relay
        fetches the buckets to its own node one at a time and copies each into an object it
        owns before fetching the next.
        """
        with self._lock:
            held = self._version
        if version <= held:
            logger.warning("relay %d ignores version %d: it holds %d", self._index, version, held)
            return False
        owned = []
        for ref in refs:
            try:
                parts = _get(ref, self._fetch_timeout)
            except GetTimeoutError as err:
                raise ParameterError(
                    f"relay {self._index} timed out after {self._fetch_timeout:g} s fetching "
                    f"version {version}"
                ) from err
            except ObjectLostError as err:
                raise ParameterError(
                    f"relay {self._index} lost version {version} before taking it (did the "
                    f"upstream relay die?): {err}"
                ) from err
            owned.append(ray.put(parts))
            del parts
        return self._install(version, owned, digests)

    def _install(self, version: int, owned: list[ray.ObjectRef], digests: list[str]) -> bool:
        """Serve ``owned`` as ``version`` (dropping the version held), forward it."""
        with self._lock:
            if version <= self._version:
                return False  # a newer version finished first
            self._version, self._refs, self._digests = version, owned, digests
            self._history[version] = version_digest(version, digests)
            if len(self._history) > HISTORY:  # versions come in order: the first is oldest
                del self._history[next(iter(self._history))]
        self._forward(version, owned, digests)
        return True

    def _forward(self, version: int, owned: list[ray.ObjectRef], digests: list[str]) -> None:
        """Offer ``version`` to each downstream relay without waiting for it; a relay whose
        last offer failed because it died (its node was lost) is offered nothing more."""
        with self._lock:  # two versions can be installed at once (the fetch group)
            alive = []
            for relay, last in zip(self._downstream, self._offers, strict=True):
                if last is not None and ray.wait([last], timeout=0)[0]:
                    try:
                        ray.get(last)
                    except RayActorError:
                        logger.warning("relay %d drops a downstream relay: it died", self._index)
                        continue
                    except RayError as err:  # it missed one version; the next may reach it
                        logger.warning("relay %d: a downstream relay failed: %s", self._index, err)
                alive.append(relay)
            self._downstream = alive
            self._offers = [relay.offer.remote(version, owned, digests) for relay in alive]

    def latest(self, after: int) -> tuple[int, list[ray.ObjectRef], list[str]] | None:
        """The held version, its bucket refs and their digests, or None if it is not newer
        than ``after``."""
        with self._lock:
            if self._version <= after:
                return None
            return self._version, list(self._refs), list(self._digests)

    def digest(self, version: int) -> str | None:
        """The digest of ``version`` as published, if this relay took it (and it is one of
        the newest ``HISTORY``)."""
        with self._lock:
            return self._history.get(version)

    def version(self) -> int:
        with self._lock:
            return self._version

    def incarnation(self) -> int:
        return self._incarnation


# Typed Any: Ray's stubs know neither `concurrency_groups` nor `.options(...)` on actors.
Relay: Any = ray.remote(**_RELAY_OPTIONS)(_Relay)


def _relay_places(relays: int | str, first_at: Any) -> list[Any]:
    """A Ray scheduling strategy for each relay, relay 0's first."""
    if relays == "per_node":
        here = getattr(first_at, "node_id", None) or ray.get_runtime_context().get_node_id()
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
        first = first_at or NodeAffinitySchedulingStrategy(here, soft=False)
        return [first] + [NodeAffinitySchedulingStrategy(n, soft=False) for n in alive]
    if not isinstance(relays, int) or relays < 1:
        raise ValueError(f'relays must be a count of at least 1 or "per_node", got {relays!r}')
    return [first_at or "DEFAULT"] + ["SPREAD"] * (relays - 1)


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
        dtype: torch.dtype | str | None = None,
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
        self.dtype = wire_dtype(dtype)
        self._reset_publisher()

    def _reset_publisher(self) -> None:
        """Publisher-side state: stays in the process that publishes (see __getstate__)."""
        self._published = EMPTY
        # The newest version's bytes on the wire, and the seconds each hand-over to relay
        # 0 took (its snapshot copied to relay 0's commit) that ``handed_over`` has not
        # given out yet.
        self.version_bytes = 0
        self._handed: list[float] = []
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
            "dtype": self.dtype,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_publisher()

    @classmethod
    def create(
        cls,
        relays: int | str = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        first_at: Any = None,
        dtype: torch.dtype | str | None = None,
        max_restarts: int = 0,
    ) -> ParameterService:
        """Start ``relays`` relay actors (0 CPUs each): relay 0, and the others spread over
        the nodes and fed by it; ``"per_node"``: one on every node alive now.

        ``first_at``: a Ray scheduling strategy for relay 0 (the flow pins it to its own
        node, so losing a worker node never takes the published version with it).
        ``dtype``: the rollout engines' dtype (a name of ``WIRE_DTYPES`` or a torch dtype):
        floating-point tensors travel in it, cast while they are copied into the staging
        buffers. None sends every tensor in its own dtype.
        ``max_restarts``: times Ray restarts relay 0 in place after its process dies,
        retrying the calls on their way to it. A restarted relay 0 holds no version until
        the trainer publishes again (``reopen``); a hand-over it cut short is given up with a
        warning. The other relays are not restarted (their node may be gone): relay 0
        stops feeding a dead one.
        """
        wire = wire_dtype(dtype)
        places = _relay_places(relays, first_at)
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        others = [
            Relay.options(scheduling_strategy=place).remote(index, [], FETCH_TIMEOUT_S)
            for index, place in enumerate(places[1:], start=1)
        ]
        first = Relay.options(
            scheduling_strategy=places[0],
            max_restarts=max_restarts,
            max_task_retries=-1 if max_restarts else 0,
        )
        handles = [first.remote(0, others, FETCH_TIMEOUT_S)]
        handles += others
        try:
            node_ids: list[str] = _get([h.node_id.remote() for h in handles], START_TIMEOUT_S)
        except (GetTimeoutError, RayActorError) as err:
            for handle in handles:
                ray.kill(handle)
            raise ParameterError(
                f"{len(handles)} parameter relay(s) did not start within {START_TIMEOUT_S:g} s: "
                f"{err}"
            ) from err
        return cls(handles, node_ids, bucket_bytes, dtype=wire)

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
        self._check_newer(version)
        for slot, handover in self._busy():
            if handover.done():
                self._settle(slot)
        self.wait_snapshot()
        slot = self._free_slot()
        if slot.snapshot is None or slot.snapshot.key != _layout_key(state, self.dtype):
            slot.snapshot = _Snapshot(state, self.bucket_bytes, self.dtype)
        if self._snapshot_thread is None or self._handover_thread is None:
            self._snapshot_thread = ThreadPoolExecutor(1, thread_name_prefix="param-snapshot")
            self._handover_thread = ThreadPoolExecutor(1, thread_name_prefix="param-handover")
        slot.version = version
        self.version_bytes = sum(b.numel() for b in slot.snapshot.buffers)
        slot.copied = self._snapshot_thread.submit(_copy, version, slot.snapshot, dict(state))
        slot.handover = self._handover_thread.submit(
            self._hand_over, version, slot.copied, slot.snapshot.parts()
        )
        self._copying = slot
        self._published = version
        return time.perf_counter() - start

    def publish_from(
        self,
        version: int,
        layout: Mapping[str, torch.Tensor],
        tensors: Iterable[tuple[str, torch.Tensor]],
    ) -> float:
        """Publish a version whose tensors come one at a time, as a sharded trainer gathers
        them, handing each bucket to relay 0 as soon as it is full; returns the seconds
        spent, and relay 0 holds the version when it returns.

        ``layout`` names every tensor with its shape and dtype (meta tensors will do), in
        the order the tensors come; buckets are cut in that order. Each tensor is copied
        into the current bucket's buffer here, on the caller's thread; a full bucket goes
        into the object store (a copy) and to relay 0, which copies it while the next one
        fills. So this process holds one bucket and one full tensor at a time, never the
        version; unlike ``publish``, the caller waits for the hand-over. A tensor out of
        the layout's order, one it lacks, one twice, or one missing at the end is a
        ParameterError, raised after the rest of ``tensors`` is read (each may be a
        collective the other ranks are in too); relay 0 then keeps the version before.
        """
        start = time.perf_counter()
        self._check_newer(version)
        self.flush()  # relay 0 takes the versions in order
        self.version_bytes = sum(
            t.numel() * _on_wire(t, self.dtype).itemsize for t in layout.values()
        )
        coming = iter(tensors)
        try:
            self._stream(version, layout, coming)
        finally:
            for _ in coming:  # read to the end: the other ranks' gathers end too
                pass
        self._published = version
        return time.perf_counter() - start

    def _check_newer(self, version: int) -> None:
        if version <= self._published:
            raise ParameterError(
                f"published version {version} is not newer than version {self._published}, "
                "published before"
            )

    def _stream(
        self,
        version: int,
        layout: Mapping[str, torch.Tensor],
        coming: Iterator[tuple[str, torch.Tensor]],
    ) -> None:
        """Fill, put and hand over ``layout``'s buckets one at a time, then commit."""
        wire = {name: _on_wire(tensor, self.dtype) for name, tensor in layout.items()}
        size = {name: layout[name].numel() * wire[name].itemsize for name in layout}
        seen: set[str] = set()

        def wrong(name: str, due: str) -> ParameterError:
            why = (
                "came twice"
                if name in seen
                else f"came where {due} was due"
                if name in layout
                else "came but is not in the layout"
            )
            return ParameterError(f"version {version}: tensor {name!r} {why}")

        relay = self.relays[0]
        pending: ray.ObjectRef | None = None
        digests: list[str] = []
        groups = _cut(list(layout), size, self.bucket_bytes)
        for index, names in enumerate(groups):
            # Widest dtypes first within a bucket: every tensor aligned to its element size.
            order = sorted(names, key=lambda n: (-wire[n].itemsize, n))
            buffer = torch.empty(sum(size[n] for n in names), dtype=torch.uint8)
            views, offset = {}, 0
            for name in order:
                window = buffer[offset : offset + size[name]].view(wire[name])
                views[name] = window.view(layout[name].shape)
                offset += size[name]
            entries = [(n, _DTYPES[wire[n]], list(layout[n].shape), size[n]) for n in order]
            with torch.no_grad():
                for due in names:
                    got = next(coming, None)
                    if got is None:
                        missing = len(layout) - len(seen)
                        raise ParameterError(
                            f"version {version}: {missing} tensor(s) of the layout never "
                            f"came, from {due!r} on"
                        )
                    name, tensor = got
                    if name != due:
                        raise wrong(name, repr(due))
                    views[name].copy_(tensor)
                    seen.add(name)
                    del got, tensor  # let it go before the next is gathered
            header = _header(entries)
            digests.append(bucket_digest(header, buffer.numpy()))
            ref = ray.put([header, buffer.numpy()])  # a copy: the buffer is free
            del views, buffer
            if pending is not None and not self._relay_answer(version, pending):
                return  # relay 0 already holds a version as new
            pending = relay.take.remote(version, index, ref)
            del ref
        extra = next(coming, None)
        if extra is not None:
            raise wrong(extra[0], "the end")
        if pending is not None and not self._relay_answer(version, pending):
            return
        self._commit(version, len(groups), digests)

    def _commit(self, version: int, count: int, digests: list[str]) -> bool:
        """Ask relay 0 to serve ``version``; True if it does. Relay 0 restarted in place
        during the hand-over lacks the buckets it took before: the version is given up
        (the driver has the trainer publish it again; else the next version comes)."""
        try:
            answer: ray.ObjectRef = self.relays[0].commit.remote(version, count, digests)
            return self._relay_answer(version, answer)
        except ParameterError as err:
            if not isinstance(getattr(err.__cause__, "cause", None), RelayRestarted):
                raise
            logger.warning("relay 0 restarted during the hand-over of version %d", version)
            return False

    def reopen(self) -> None:
        """Let the version published last be published again (after ``flush``): relay 0
        restarted in place and lost it."""
        self.flush()
        self._published = EMPTY

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
        """Once the snapshot is copied, hand its buckets to relay 0 one by one, then commit.

        Runs in the hand-over thread, one version after another, so relay 0 is offered the
        versions in order. The snapshot thread always finishes a copy, so the wait for it
        has no timeout; a failed copy fails the hand-over with the same error. Bucket i+1
        is put into the object store while relay 0 copies bucket i, and each is dropped once
        relay 0 has its own copy: at most two of this process's buckets are in the store.
        ``ray.put`` has copied a bucket when it returns, so the staging buffer is free once
        the puts are done; its slot stays busy until relay 0 has committed the version.
        """
        copied.result()  # re-raises the snapshot's ParameterError
        started = time.monotonic()
        relay = self.relays[0]
        pending: ray.ObjectRef | None = None
        digests = []
        for index, parts in enumerate(buckets):
            digests.append(bucket_digest(*parts))
            try:
                ref = ray.put(parts)
            except RayError as err:
                raise ParameterError(
                    f"putting version {version} into the object store: {err}"
                ) from err
            if pending is not None and not self._relay_answer(version, pending):
                return  # relay 0 already holds a version as new
            # The pending call keeps the bucket alive until relay 0 has it; the ref must
            # not outlive it in this frame, which a failure's traceback keeps until settled.
            pending = relay.take.remote(version, index, ref)
            del ref
        if pending is not None and not self._relay_answer(version, pending):
            return
        if self._commit(version, len(buckets), digests):
            self._handed.append(time.monotonic() - started)

    def handed_over(self) -> list[float]:
        """The seconds each hand-over to relay 0 took (from its snapshot being copied to
        relay 0's commit) that finished since the last call, oldest first: the relay's share
        of a version's trip, which the trainer logs beside the publish."""
        done, self._handed = self._handed, []
        return done

    def _relay_answer(self, version: int, answer: ray.ObjectRef) -> bool:
        try:
            return bool(_get(answer, self.fetch_timeout))
        except GetTimeoutError as err:
            raise ParameterError(
                f"relay 0 has not taken version {version} after {self.fetch_timeout:g} s; "
                "is the relay alive?"
            ) from err
        except RayError as err:
            raise ParameterError(f"relay 0 did not take version {version}: {err}") from err

    # -- puller side -----------------------------------------------------------------------

    def _ask_relay_0(self, what: str, answer: ray.ObjectRef, timeout: float) -> Any:
        """Relay 0's ``answer`` to a question about ``what``; Ray's timeout and dead-actor
        errors as a ParameterError."""
        try:
            return _get(answer, timeout)
        except (GetTimeoutError, RayActorError) as err:
            raise _ray_failure(err, f"asking for {what}", 0, timeout) from err

    def latest_version(self, timeout: float = 10.0) -> int:
        """The newest version relay 0 holds (-1 before the first one arrives)."""
        version: int = self._ask_relay_0(
            "the latest version", self.relays[0].version.remote(), timeout
        )
        return version

    def published_digest(self, version: int, timeout: float = 10.0) -> str | None:
        """The digest of ``version`` as the trainer published it (relay 0's record), or
        None if relay 0 never took it or has forgotten it (older than ``HISTORY``)."""
        digest: str | None = self._ask_relay_0(
            f"the digest of version {version}", self.relays[0].digest.remote(version), timeout
        )
        return digest

    def relay_incarnation(self, timeout: float = 10.0) -> int:
        """Relay 0's incarnation: it changes when Ray restarts relay 0 in place."""
        incarnation: int = self._ask_relay_0(
            "its incarnation", self.relays[0].incarnation.remote(), timeout
        )
        return incarnation

    def _nearest(self) -> int:
        """A relay on this node if there is one, else relay 0."""
        here = ray.get_runtime_context().get_node_id()
        return self.node_ids.index(here) if here in self.node_ids else 0

    def pull(self, after: int, timeout: float = 30.0) -> Weights | None:
        """The newest version if newer than ``after``, to read lazily; else None."""
        return self.collect(self.ask(after), timeout)

    def pull_blobs(self, after: int, timeout: float = 30.0) -> tuple[int, list[bytes]] | None:
        """The newest version if newer than ``after``, as safetensors blobs (a copy of every
        bucket: for tools and tests; a puller loads with ``pull``); else None."""
        found = self.pull(after, timeout)
        return None if found is None else (found.version, found.blobs())

    def ask(self, after: int) -> PendingPull:
        """Ask the nearest relay (on this node, else relay 0) for a version newer than
        ``after`` without waiting for its answer: a puller that has other work checks
        ``PendingPull.answered`` and then ``collect``s."""
        index = self._nearest()
        return PendingPull(index, after, self.relays[index].latest.remote(after))

    def collect(self, asked: PendingPull, timeout: float = 30.0) -> Weights | None:
        """The answer to ``asked``: the newer version, or None. Waits up to ``timeout`` for
        the answer and for every bucket to be in this node's object store (not in this
        process: ``Weights`` reads them as it is iterated), so a load that starts does not
        stop halfway for a lost or slow bucket."""
        deadline = time.monotonic() + timeout
        what = f"parameter pull of a version newer than {asked.after}"
        try:
            found: tuple[int, list[ray.ObjectRef], list[str]] | None = _get(asked.answer, timeout)
            if found is None:
                return None
            version, refs, digests = found
            what = f"parameter pull of version {version}"
            left = max(deadline - time.monotonic(), 0.0)
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=left) if refs else ([], [])
            if len(ready) < len(refs):
                raise GetTimeoutError(f"{len(refs) - len(ready)} of {len(refs)} buckets missing")
        except (GetTimeoutError, RayActorError, ObjectLostError) as err:
            raise _ray_failure(err, what, asked.relay, timeout) from err
        return Weights(version, refs, asked.relay, timeout, digests)

    def shutdown(self) -> None:
        """Kill the relays; their versions are freed with them, and pending hand-overs fail."""
        for thread in (self._snapshot_thread, self._handover_thread):
            if thread is not None:
                thread.shutdown(wait=False, cancel_futures=True)
        for handle in self.relays:
            ray.kill(handle)
