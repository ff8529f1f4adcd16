"""Versioned parameter service: the trainer publishes weights, rollout workers pull them.

Components, after Laminar's relays. The trainer calls :meth:`ParameterService.publish`
with ``(version, state dict)``: each tensor is copied once, straight into the Ray object
store, in buckets of safetensors-format parts, and the buckets are offered to relay 0
without waiting. A ``Relay`` actor holds the newest version it has taken and nothing
older: it fetches an offered version to its own node and re-puts it as objects it owns,
so the version outlives the trainer process, then drops its references to the previous
version so Ray frees it. Relays form a chain (relay 0 forwards every version it takes to
relay 1, and so on) spread over the nodes, so a far node pulls from a relay next to it.
Rollout workers call :meth:`ParameterService.pull` when they choose ("anything newer than
version 6?"); the trainer never waits for them. ``ParameterService`` is a picklable handle
on the relays, handed to the trainer and the rollout workers by whoever creates it.

Every wait on Ray has a timeout, and Ray's timeout, dead-actor and lost-object errors come
back as :class:`ParameterError` naming the version, the relay and the timeout.

Ray 2.56 removed ``ray.put(..., _owner=)``, so the trainer cannot create objects on a
relay's behalf: until relay 0 has taken a version (one more copy, about as long as the
publish itself) its buckets are the trainer's, and a trainer that dies in that window
loses that one version; the relay keeps serving the previous one. A failed hand-over is
raised from the trainer's next ``publish``.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
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
# long a publish waits for relay 0 when MAX_IN_FLIGHT versions are already on their way.
FETCH_TIMEOUT_S = 120.0
# Versions a publisher may have offered that relay 0 has not taken yet. Each holds a full
# copy of the weights in the object store, so past this a publish waits for the oldest.
MAX_IN_FLIGHT = 2
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

# One bucket as it travels: a safetensors header, then the raw bytes of each tensor in the
# header's order. Joined, the parts are a safetensors file; apart, each tensor is copied
# straight from the trainer's memory into the object store (no intermediate blob).
Parts = list[Any]


class ParameterError(RuntimeError):
    """A publish or pull failed; the message names the version, the relay and the timeout."""


# -- buckets -------------------------------------------------------------------------------


def _raw(name: str, tensor: torch.Tensor) -> tuple[str, list[int], np.ndarray]:
    """Safetensors dtype, shape and a uint8 view of a tensor's bytes (a copy only off-CPU)."""
    if tensor.dtype not in _DTYPES:
        raise ParameterError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors lacks")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return _DTYPES[tensor.dtype], list(tensor.shape), flat.view(torch.uint8).numpy()


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


def _bucket_parts(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[Parts]:
    """Buckets of at most ~bucket_bytes of tensor data, names in sorted order."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: list[list[str]] = []
    filled = 0
    for name in sorted(state):
        size = state[name].nbytes
        if not groups or (filled + size > bucket_bytes and filled > 0):
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += size
    buckets = []
    for names in groups:
        # Widest dtypes first keeps every tensor aligned to its element size.
        names.sort(key=lambda n: (-state[n].element_size(), n))
        raw = [(n, *_raw(n, state[n])) for n in names]
        header = _header([(n, dtype, shape, data.nbytes) for n, dtype, shape, data in raw])
        buckets.append([header, *(data for *_, data in raw)])
    return buckets


def to_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[bytes]:
    """A state dict as safetensors blobs of at most ~bucket_bytes each, in sorted name order.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own.
    """
    return [b"".join(parts) for parts in _bucket_parts(state, bucket_bytes)]


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
        # Publisher-side state: stays in the process that publishes (see __getstate__).
        self._published = EMPTY
        self._handovers: list[tuple[int, ray.ObjectRef]] = []

    def __getstate__(self) -> dict[str, Any]:
        return {
            "relays": self.relays,
            "node_ids": self.node_ids,
            "bucket_bytes": self.bucket_bytes,
            "fetch_timeout": self.fetch_timeout,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._published = EMPTY
        self._handovers = []

    @classmethod
    def create(
        cls,
        relays: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        name_prefix: str | None = None,
        fetch_timeout: float = FETCH_TIMEOUT_S,
    ) -> ParameterService:
        """Start a chain of ``relays`` relay actors (0 CPUs each), spread over the nodes.

        ``name_prefix`` names them ``<prefix>-relay-<i>`` (for ``ray.get_actor``);
        ``fetch_timeout`` bounds a relay's fetch of one version and a publish's wait.
        """
        if relays < 1:
            raise ValueError(f"relays must be at least 1, got {relays}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        handles: list[ActorHandle] = []
        downstream: ActorHandle | None = None
        for index in reversed(range(relays)):
            name = None if name_prefix is None else f"{name_prefix}-relay-{index}"
            downstream = Relay.options(
                name=name,
                scheduling_strategy="SPREAD",
            ).remote(index, downstream, fetch_timeout)
            handles.insert(0, downstream)
        try:
            node_ids: list[str] = _get([h.node_id.remote() for h in handles], START_TIMEOUT_S)
        except (GetTimeoutError, RayActorError) as err:
            for handle in handles:
                ray.kill(handle)
            raise ParameterError(
                f"{relays} parameter relay(s) did not start within {START_TIMEOUT_S:g} s: {err}"
            ) from err
        return cls(handles, node_ids, bucket_bytes, fetch_timeout)

    # -- trainer side ----------------------------------------------------------------------

    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> float:
        """Copy ``state`` into the object store and offer it to relay 0; returns seconds spent.

        Returns without waiting for the relay or any puller (unless relay 0 is
        ``MAX_IN_FLIGHT`` versions behind); ``state`` may change as soon as it returns.
        Raises if an earlier hand-over to relay 0 failed.
        """
        start = time.perf_counter()
        if version <= self._published:
            raise ParameterError(
                f"published version {version} is not newer than version {self._published}, "
                "published before"
            )
        self._check_handovers(wait=len(self._handovers) >= MAX_IN_FLIGHT)
        refs = [ray.put(parts) for parts in _bucket_parts(state, self.bucket_bytes)]
        self._handovers.append((version, self.relays[0].offer.remote(version, refs)))
        self._published = version
        return time.perf_counter() - start

    def _check_handovers(self, wait: bool) -> None:
        """Forget finished hand-overs to relay 0, raising if one failed; maybe wait for one."""
        if not self._handovers:
            return
        refs = [ref for _, ref in self._handovers]
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        if wait and not done:
            if not ray.wait(refs[:1], timeout=self.fetch_timeout)[0]:
                raise ParameterError(
                    f"relay 0 has not taken version {self._handovers[0][0]} after "
                    f"{self.fetch_timeout:g} s, with {len(refs)} versions waiting; "
                    "is the relay alive?"
                )
            done = {refs[0]}
        finished = [(version, ref) for version, ref in self._handovers if ref in done]
        self._handovers = [(version, ref) for version, ref in self._handovers if ref not in done]
        for version, ref in finished:
            try:
                _get(ref, 0)
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

    def _pick(self, relay: int | None) -> int:
        if relay is not None:
            if not 0 <= relay < len(self.relays):
                raise ValueError(f"relay must be in [0, {len(self.relays)}), got {relay}")
            return relay
        here = ray.get_runtime_context().get_node_id()
        return self.node_ids.index(here) if here in self.node_ids else 0

    def pull_blobs(
        self, after: int, timeout: float = 30.0, relay: int | None = None
    ) -> tuple[int, list[bytes]] | None:
        """The newest version if newer than ``after``, as safetensors blobs; else None.

        ``relay`` None means a relay on this node if there is one, else relay 0.
        """
        index = self._pick(relay)
        deadline = time.monotonic() + timeout
        what = f"parameter pull of a version newer than {after}"
        try:
            found: tuple[int, list[ray.ObjectRef]] | None = _get(
                self.relays[index].latest.remote(after), timeout
            )
            if found is None:
                return None
            version, refs = found
            what = f"parameter pull of version {version}"
            buckets = _get(refs, max(deadline - time.monotonic(), 0.0))
        except (GetTimeoutError, RayActorError, ObjectLostError) as err:
            raise _ray_failure(err, what, index, timeout) from err
        return version, [b"".join(parts) for parts in buckets]

    def pull(
        self, after: int, timeout: float = 30.0, relay: int | None = None
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest version if newer than ``after``, as tensors; else None."""
        found = self.pull_blobs(after, timeout, relay)
        if found is None:
            return None
        version, blobs = found
        return version, from_buckets(blobs)

    def shutdown(self) -> None:
        """Kill the relays; their versions are freed with them."""
        for handle in self.relays:
            ray.kill(handle)
