"""The parameter service on a real local Ray: bucketing, publish/pull, background snapshots,
hand-over, ownership, failures."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch

from sluice.driver.weight_sync import ServedWeights, WeightsMismatch
from sluice.engines.rollout.worker import RolloutWorker
from sluice.envs import make_env
from sluice.envs.scoring import VerifierScorer
from sluice.storage.params import (
    _RELAY_OPTIONS,
    EMPTY,
    MAX_IN_FLIGHT,
    ParameterError,
    ParameterService,
    RelayRestarted,
    Weights,
    _Relay,
    digest_number,
    from_buckets,
    version_digest,
)

pytestmark = pytest.mark.integration

# Ray workers cannot import this test module; ship its actor classes by value instead.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MB = 1 << 20


def _state(seed: int, megabytes: int = 2) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes, ~``megabytes`` MB of float32 in 256 KB tensors."""
    gen = torch.Generator().manual_seed(seed)
    state = {f"layers.{i}.w": torch.randn(256, 256, generator=gen) for i in range(megabytes * 4)}
    state["embed.bf16"] = torch.randn(33, 7, generator=gen).to(torch.bfloat16)
    state["step"] = torch.tensor(seed, dtype=torch.int64)  # 0-dim
    state["mask"] = torch.rand(5, generator=gen) > 0.5
    state["empty"] = torch.zeros(0, 3)
    return state


def _loaded(weights: Weights) -> dict[str, torch.Tensor]:
    """What an engine does with a pulled version: read it once, copying each tensor."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        assert name not in state, name
        state[name] = tensor.clone()
    return state


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.02)


def _dead(actor: ray.actor.ActorHandle) -> bool:
    """Whether ``actor``'s process is gone (its calls fail), asked with a short timeout."""
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=1.0)
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        return False  # still there, too busy to answer
    return False  # it answered: alive


@ray.remote(num_cpus=0)
class _Trainer:
    """Publishes from its own process, as the trainer actor does."""

    def __init__(self, service: ParameterService) -> None:
        self._service = service

    def publish(self, version: int, seed: int) -> float:
        return self._service.publish(version, _state(seed))


@ray.remote(num_cpus=0)
class _Worker:
    """Pulls from its own process, as a rollout worker does."""

    def pull(
        self, service: ParameterService, after: int, timeout: float
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        found = service.pull(after, timeout=timeout)
        return None if found is None else (found.version, _loaded(found))


@pytest.fixture(scope="module")
def worker(ray_local) -> Iterator[ray.actor.ActorHandle]:
    handle = _Worker.remote()  # type: ignore[attr-defined]
    yield handle
    ray.kill(handle)


@pytest.fixture
def service(ray_local) -> Iterator[ParameterService]:
    svc = ParameterService.create(relays=1, bucket_bytes=MB)
    yield svc
    svc.shutdown()


# -- buckets -------------------------------------------------------------------------------


def _blobs(service: ParameterService, version: int, state: dict[str, torch.Tensor]) -> list[bytes]:
    """``state`` as a puller receives it: published as ``version``, then pulled as blobs."""
    service.publish(version, state)
    service.flush(timeout=30)
    found = service.pull_blobs(version - 1, timeout=10)
    assert found is not None and found[0] == version
    return found[1]


def test_buckets_round_trip_exactly(service):
    state = _state(0)
    blobs = _blobs(service, 1, state)
    _assert_same(from_buckets(blobs), state)
    assert _blobs(service, 2, state) == blobs  # deterministic


def test_buckets_respect_the_size_and_the_name_order(service):
    state = {f"t{i:02d}": torch.zeros(64 * 1024) for i in range(10)}  # 256 KB each
    names = [sorted(from_buckets([blob])) for blob in _blobs(service, 1, state)]
    assert [len(n) for n in names] == [4, 4, 2]  # 4 x 256 KB fill 1 MB exactly
    assert [name for bucket in names for name in bucket] == sorted(state)


def test_a_tensor_larger_than_a_bucket_gets_its_own(ray_local):
    state = {"a": torch.zeros(10), "big": torch.zeros(3 * MB // 4), "c": torch.zeros(10)}
    service = ParameterService.create(relays=1, bucket_bytes=MB // 2)
    try:
        blobs = _blobs(service, 1, state)
    finally:
        service.shutdown()
    assert [sorted(from_buckets([blob])) for blob in blobs] == [["a"], ["big"], ["c"]]


def test_a_name_in_two_buckets_is_an_error(service):
    blob = _blobs(service, 1, {"w": torch.zeros(3)})[0]
    with pytest.raises(ParameterError, match="'w' appears twice"):
        from_buckets([blob, blob])


# -- publish and pull ----------------------------------------------------------------------


def test_a_worker_pulls_what_was_published(service, worker):
    service.publish(3, _state(3))
    _wait_until(lambda: service.latest_version() == 3, "relay 0 taking version 3")

    version, state = ray.get(worker.pull.remote(service, -1, 10.0), timeout=30)
    assert version == 3
    _assert_same(state, _state(3))
    assert ray.get(worker.pull.remote(service, 3, 10.0), timeout=30) is None

    with pytest.raises(ParameterError, match="version 3 is not newer than version 3"):
        service.publish(3, _state(0))
    with pytest.raises(ParameterError, match="version 2 is not newer than version 3"):
        service.publish(2, _state(0))


def test_an_ask_is_answered_while_the_puller_goes_on(service):
    service.publish(3, _state(3))
    _wait_until(lambda: service.latest_version() == 3, "relay 0 taking version 3")

    asked = service.ask(-1)  # returns at once; the relay answers in the background
    _wait_until(asked.answered, "relay 0 answering")
    found = service.collect(asked, timeout=10.0)
    assert found is not None and found.version == 3
    _assert_same(_loaded(found), _state(3))
    assert service.collect(service.ask(3), timeout=10.0) is None


def test_a_version_outlives_the_trainer_that_published_it(service, worker):
    trainer = _Trainer.remote(service)  # type: ignore[attr-defined]
    ray.get(trainer.publish.remote(1, 1), timeout=30)
    # Once relay 0 holds the version it owns the buckets, so the trainer may die.
    _wait_until(lambda: service.latest_version() == 1, "relay 0 taking version 1")
    ray.kill(trainer)  # returns before the process is gone: a call sent at once may still run
    _wait_until(lambda: _dead(trainer), "the trainer's process ending")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(trainer.publish.remote(2, 2), timeout=30)
    version, state = ray.get(worker.pull.remote(service, -1, 10.0), timeout=30)
    assert version == 1
    _assert_same(state, _state(1))


def test_relay_0_restarted_in_place_holds_nothing_until_the_trainer_publishes_again(ray_local):
    service = ParameterService.create(relays=1, bucket_bytes=MB, max_restarts=1)
    state = _state(3)
    service.publish(1, state)
    service.flush(timeout=30)
    before = service.relay_incarnation()
    ray.kill(service.relays[0], no_restart=False)  # its process ends; Ray starts another
    _wait_until(lambda: service.relay_incarnation() != before, "relay 0 restarting")
    assert service.latest_version() == EMPTY and service.published_digest(1) is None
    # A version it had only part of when it restarted cannot be committed: the publisher
    # gives it up (``ParameterService._commit``) and waits for the next.
    ray.get(service.relays[0].take.remote(2, 1, [b"", b""]))
    with pytest.raises(RelayRestarted, match=r"has buckets \[1\] of version 2, not 0..1"):
        ray.get(service.relays[0].commit.remote(2, 2, ["a", "b"]))
    with pytest.raises(ParameterError, match="not newer"):
        service.publish(1, state)
    service.reopen()  # what the trainer does when the driver sees the restart
    service.publish(1, state)
    service.flush(timeout=30)
    weights = service.pull(EMPTY, timeout=10)
    assert weights is not None and weights.version == 1
    _assert_same(_loaded(weights), state)
    assert service.published_digest(1) is not None
    service.shutdown()


def _plasma_bytes() -> int:
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    return int(get_memory_info_reply(state).store_stats.object_store_bytes_used)


def test_old_versions_are_released(service):
    state = _state(0, megabytes=4)
    size = sum(t.nbytes for t in state.values())
    before = _plasma_bytes()
    for version in range(20):
        service.wait_snapshot()
        state["step"].fill_(version)
        service.publish(version, state)
    _wait_until(lambda: service.latest_version() == 19, "relay 0 taking version 19")
    # 20 versions were published; the relay holds one, the rest are freed (asynchronously).
    _wait_until(lambda: _plasma_bytes() - before < 2 * size, "old versions being freed")
    assert service.pull_blobs(18) is not None


def test_a_chained_relay_serves_the_version_on_its_own(ray_local):
    chained = ParameterService.create(relays=2, bucket_bytes=MB)
    try:
        chained.publish(5, _state(5))
        relay_1 = chained.relays[1]
        _wait_until(
            lambda: ray.get(relay_1.version.remote(), timeout=10) == 5, "relay 1 taking version 5"
        )
        # Relay 1 re-put the buckets itself: it serves them with relay 0 gone.
        ray.kill(chained.relays[0])
        version, refs, _ = ray.get(relay_1.latest.remote(4), timeout=30)
        assert version == 5
        blobs = [b"".join(parts) for parts in ray.get(refs, timeout=30)]
        _assert_same(from_buckets(blobs), _state(5))
    finally:
        chained.shutdown()


def test_relay_0_feeds_every_other_relay_and_drops_one_that_died(ray_local):
    """Relays hang off relay 0 alone: losing one (its node) leaves the others fed."""
    star = ParameterService.create(relays=3, bucket_bytes=MB)
    try:
        ray.kill(star.relays[1])
        for version in (1, 2):  # relay 0 learns of the death from its first offer's answer
            star.publish(version, _state(version))
            star.flush(timeout=30)
            _wait_until(
                lambda v=version: ray.get(star.relays[2].version.remote(), timeout=10) == v,
                f"relay 2 taking version {version}",
            )
    finally:
        star.shutdown()


def test_per_node_relays_on_one_node_are_relay_0_alone_and_bad_counts_are_refused(ray_local):
    service = ParameterService.create(relays="per_node", bucket_bytes=MB)
    try:
        assert len(service.relays) == 1
        assert service.node_ids == [ray.get_runtime_context().get_node_id()]
    finally:
        service.shutdown()
    for bad in (0, "per-node"):
        with pytest.raises(ValueError, match='at least 1 or "per_node"'):
            ParameterService.create(relays=bad)


def test_a_pulled_version_has_the_values_at_publish_time(service, worker):
    state = _state(7, megabytes=16)
    service.publish(7, state)
    # The trainer steps in place as soon as wait_snapshot returns, before the hand-over puts.
    assert service.wait_snapshot(timeout=30) >= 0.0
    for tensor in state.values():
        tensor.zero_()
    service.flush(timeout=30)
    version, pulled = ray.get(worker.pull.remote(service, -1, 10.0), timeout=30)
    assert version == 7
    _assert_same(pulled, _state(7, megabytes=16))
    assert service.wait_snapshot(timeout=0) == 0.0  # nothing left to wait for


def test_the_handle_a_worker_gets_carries_no_staging_buffers(service):
    service.publish(1, _state(1))
    copy = ray.cloudpickle.loads(ray.cloudpickle.dumps(service))
    assert len(ray.cloudpickle.dumps(service)) < 64 << 10  # the state is 2 MB
    # Nothing published through the copy: nothing to wait for.
    assert copy.wait_snapshot(timeout=0) == 0.0
    copy.flush(timeout=0)
    service.flush(timeout=30)


# -- streaming pulls, wire dtype, release --------------------------------------------------


@ray.remote(num_cpus=0)
def _never(seconds: float) -> None:
    time.sleep(seconds)


def test_a_pull_yields_views_of_the_object_store_bucket_by_bucket_in_name_order(service):
    state = _state(4, megabytes=4)
    service.publish(4, state)
    service.flush(timeout=30)
    weights = service.pull(3, timeout=10)
    assert weights is not None and weights.version == 4 and len(weights.refs) > 2
    # The buckets' arrays as Ray maps them into this process (read-only: the object store).
    arrays = [parts[1] for parts in ray.get(weights.refs, timeout=10)]
    assert not any(a.flags.writeable for a in arrays)
    spans = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays]
    names, buckets = [], []
    for name, tensor in weights:
        names.append(name)
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
        inside = [i for i, (lo, hi) in enumerate(spans) if lo <= start and end <= hi]
        if tensor.nbytes:
            assert len(inside) == 1, f"{name} is not a view of a bucket in the object store"
            buckets.append(inside[0])
        assert torch.equal(tensor, state[name]), name
    assert names == sorted(state)
    assert buckets == sorted(buckets) and set(buckets) == set(range(len(arrays)))


def test_every_bucket_is_checked_before_the_loader_gets_a_tensor(service):
    service.publish(1, _state(1))
    service.flush(timeout=30)
    weights = service.pull(0, timeout=10)
    assert weights is not None
    # The second bucket never arrives: the check stops there, before any tensor is read.
    stalled = Weights(1, [weights.refs[0], _never.remote(60)], 0, 0.5, weights.digests[:2])
    read = []
    with pytest.raises(ParameterError, match="bucket 1 of version 1 from relay 0 timed out"):
        for name, _ in stalled:
            read.append(name)
    assert read == [] and stalled.loaded is None


def test_a_publish_gives_its_bytes_and_each_hand_over_its_seconds_once(service):
    state = _state(1)
    service.publish(1, state)
    service.flush(timeout=30)
    weights = service.pull(0, timeout=10)
    assert weights is not None
    on_wire = sum(t.numel() * t.element_size() for t in state.values())
    assert (
        service.version_bytes
        == on_wire
        == sum(len(b) for b in weights.blobs())
        - sum(len(parts[0]) for parts in ray.get(weights.refs, timeout=10))
    )
    [seconds] = service.handed_over()
    assert 0.0 < seconds < 30.0
    assert service.handed_over() == []  # given out once


def test_a_version_carries_digests_and_a_full_read_is_its_published_digest(service):
    service.publish(1, _state(1))
    service.flush(timeout=30)
    weights = service.pull(0, timeout=10)
    assert weights is not None
    published = service.published_digest(1)
    assert published == version_digest(1, weights.digests)
    assert len(weights.digests) == len(weights.refs) > 1
    partial = service.pull(0, timeout=10)
    assert partial is not None
    next(iter(partial))  # an engine that stops after one tensor: no digest to serve
    assert partial.loaded is None
    _assert_same(_loaded(weights), _state(1))
    assert weights.loaded == published
    assert service.published_digest(2) is None  # never published


class _Corrupting(_Relay):
    """Relay 0 with a fault: its copy of bucket 1 of each version has one byte flipped."""

    def take(self, version: int, index: int, parts: list[Any]) -> bool:
        header, data = parts
        if index == 1:
            data = data.copy()
            data[len(data) // 2] ^= 0xFF
        return super().take(version, index, [header, data])


_CorruptingRelay = ray.remote(**_RELAY_OPTIONS)(_Corrupting)


def test_a_relay_that_corrupts_a_bucket_is_caught_before_anything_is_loaded(fake_service):
    service = fake_service(_CorruptingRelay.remote(0, [], 30.0), fetch_timeout=30)
    service.publish(1, _state(1))
    service.flush(timeout=30)
    weights = service.pull(0, timeout=10)
    assert weights is not None
    read = []
    with pytest.raises(
        ParameterError,
        match=r"bucket 1 of version 1 from relay 0 is not what the trainer published "
        r"\(digest \w+, published \w+\): its bytes were cut or changed on the way",
    ):
        for name, _ in weights:
            read.append(name)
    assert read == [] and weights.loaded is None


def test_the_same_bytes_under_a_newer_number_do_not_pass_for_it(service):
    """A relay that serves a stale version's objects under the new version's number: each
    bucket matches its digest, but what the worker loaded is not the version it reports."""
    service.publish(1, _state(1))
    service.flush(timeout=30)
    stale = service.pull(0, timeout=10)
    service.publish(2, _state(2))
    service.flush(timeout=30)
    assert stale is not None
    relabelled = Weights(2, stale.refs, 0, 10.0, stale.digests)
    _loaded(relabelled)
    assert relabelled.loaded is not None
    checker = ServedWeights(service.published_digest, stale_after_s=60.0)
    with pytest.raises(WeightsMismatch, match="rollout worker 3 reports version 2, but what"):
        checker.check(3, 2, digest_number(relabelled.loaded), newest=2)


def test_floating_point_tensors_travel_in_the_wire_dtype(ray_local, worker):
    with pytest.raises(ValueError, match="'float8' is not one of"):
        ParameterService.create(dtype="float8")
    service = ParameterService.create(relays=1, bucket_bytes=MB, dtype="bfloat16")
    try:
        # The trainer's handle (pickled into its actor) publishes in the wire dtype too.
        trainer = _Trainer.remote(service)  # type: ignore[attr-defined]
        ray.get(trainer.publish.remote(1, 5), timeout=30)
        _wait_until(lambda: service.latest_version() == 1, "relay 0 taking version 1")
        version, pulled = ray.get(worker.pull.remote(service, 0, 10.0), timeout=30)
        found = service.pull(0, timeout=10)
        assert found is not None
        wire = sum(memoryview(parts[1]).nbytes for parts in ray.get(found.refs, timeout=10))
        ray.kill(trainer)
    finally:
        service.shutdown()
    state = _state(5)
    want = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()}
    assert version == 1
    _assert_same(pulled, want)
    assert (
        wire == sum(t.nbytes for t in want.values()) < 0.6 * sum(t.nbytes for t in state.values())
    )


def test_a_version_stays_while_a_puller_holds_it_and_goes_once_it_is_dropped(service):
    state = _state(0, megabytes=4)
    size = sum(t.nbytes for t in state.values())
    before = _plasma_bytes()
    service.publish(1, state)
    service.flush(timeout=30)
    held = service.pull(0, timeout=10)
    service.publish(2, state)
    service.flush(timeout=30)
    time.sleep(0.5)  # freeing is asynchronous: give it the chance to (wrongly) happen
    assert _plasma_bytes() - before > 1.9 * size  # version 1 is still held by the puller
    del held
    _wait_until(lambda: _plasma_bytes() - before < 1.1 * size, "version 1 being freed")


# -- the hand-over thread ------------------------------------------------------------------


@ray.remote(num_cpus=0, max_concurrency=4)
class _RecordingRelay:
    """A relay that keeps every version it is offered; ``gated`` ones wait for `open`."""

    def __init__(self, gated: bool) -> None:
        self._gate = threading.Event()
        if not gated:
            self._gate.set()
        self._staged: dict[int, dict[int, bytes]] = {}
        self._taken: dict[int, list[bytes]] = {}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def open(self) -> None:
        self._gate.set()

    def take(self, version: int, index: int, parts: list[Any]) -> bool:
        self._gate.wait()
        self._staged.setdefault(version, {})[index] = b"".join(parts)
        return True

    def commit(self, version: int, count: int, digests: list[str]) -> bool:
        staged = self._staged.pop(version)
        assert sorted(staged) == list(range(count))
        self._taken[version] = [staged[i] for i in range(count)]
        return True

    def taken(self) -> dict[int, list[bytes]]:
        return self._taken

    def version(self) -> int:
        return max(self._taken, default=-1)


@pytest.fixture
def fake_service(ray_local) -> Iterator[Callable[..., ParameterService]]:
    """Makes services whose one relay is the given fake; kills them afterwards."""
    made: list[ParameterService] = []

    def make(relay: ray.actor.ActorHandle, fetch_timeout: float = 0.5) -> ParameterService:
        node = ray.get(relay.node_id.remote(), timeout=30)
        made.append(ParameterService([relay], [node], MB, fetch_timeout=fetch_timeout))
        return made[-1]

    yield make
    for svc in made:
        svc.shutdown()


def test_publish_returns_before_relay_0_has_the_version_and_flush_waits(fake_service):
    relay = _RecordingRelay.remote(gated=True)  # type: ignore[attr-defined]
    service = fake_service(relay, fetch_timeout=30)
    service.publish(1, _state(1))
    assert service.latest_version() == -1
    with pytest.raises(ParameterError, match=r"relay 0 has not taken version 1 within .* 0.2 s"):
        service.flush(timeout=0.2)
    ray.get(relay.open.remote(), timeout=10)
    service.flush(timeout=30)
    assert service.latest_version() == 1


def test_every_version_is_the_state_at_its_publish(fake_service):
    # Versions follow each other faster than they are put: both staging buffers are busy
    # and the third publish waits for the first; none may see a later step's values.
    relay = _RecordingRelay.remote(gated=False)  # type: ignore[attr-defined]
    service = fake_service(relay, fetch_timeout=30)
    versions = range(6)
    state = _state(versions[0], megabytes=8)
    for version in versions:
        service.publish(version, state)
        following = _state(version + 1, megabytes=8)
        service.wait_snapshot(timeout=30)
        for name, tensor in state.items():  # the next step, in place
            tensor.copy_(following[name])
    service.flush(timeout=60)
    taken = ray.get(relay.taken.remote(), timeout=30)
    assert sorted(taken) == list(versions)
    for version in versions:
        _assert_same(from_buckets(taken[version]), _state(version, megabytes=8))


# -- the snapshot thread -------------------------------------------------------------------


class _HeldTensor(torch.Tensor):
    """A tensor whose copies out wait for ``release``: holds a snapshot mid-copy."""

    release = threading.Event()

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.Tensor.copy_:
            assert cls.release.wait(30), "the test never released the snapshot"
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture
def held() -> Iterator[torch.Tensor]:
    """A tensor to publish whose snapshot waits until ``_HeldTensor.release`` is set."""
    _HeldTensor.release.clear()
    yield torch.arange(6, dtype=torch.float32).as_subclass(_HeldTensor)
    _HeldTensor.release.set()  # never leave a snapshot thread stuck


def test_publish_returns_before_the_snapshot_and_wait_snapshot_waits(service, held, worker):
    state = {**_state(1), "held": held}
    service.publish(1, state)  # returns with the copy still held
    with pytest.raises(
        ParameterError, match=r"snapshot of version 1 is still being copied after 0.1 s"
    ):
        service.wait_snapshot(timeout=0.1)
    _HeldTensor.release.set()
    service.wait_snapshot(timeout=30)
    for tensor in state.values():
        tensor.zero_()
    service.flush(timeout=30)
    version, pulled = ray.get(worker.pull.remote(service, -1, 10.0), timeout=30)
    assert version == 1
    _assert_same(pulled, {**_state(1), "held": torch.arange(6, dtype=torch.float32)})


def test_publish_waits_for_the_previous_snapshot(service, held):
    state = {**_state(1), "held": held}
    service.publish(1, state)
    second = threading.Thread(target=service.publish, args=(2, _state(2)))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # held behind version 1's copy, which is still running
    _HeldTensor.release.set()
    second.join(30)
    assert not second.is_alive()
    service.flush(timeout=30)
    assert service.latest_version() == 2


def test_a_large_snapshot_completes_in_the_background(service, worker):
    # No timing asserted: publish returns a duration, wait_snapshot then leaves nothing.
    state = _state(3, megabytes=64)
    assert service.publish(3, state) >= 0.0
    assert service.wait_snapshot(timeout=60) >= 0.0
    assert service.wait_snapshot(timeout=0) == 0.0
    for tensor in state.values():
        tensor.fill_(1)
    service.flush(timeout=60)
    version, pulled = ray.get(worker.pull.remote(service, -1, 30.0), timeout=60)
    assert version == 3
    _assert_same(pulled, _state(3, megabytes=64))


def _no_data() -> dict[str, torch.Tensor]:
    """A state whose copy fails in the snapshot thread: a meta tensor has no data."""
    return {"w": torch.zeros(4), "lazy": torch.empty(3, device="meta")}


def test_a_failed_snapshot_is_raised_once_by_wait_snapshot(service):
    service.publish(1, _no_data())  # nothing is read in publish itself
    with pytest.raises(
        ParameterError, match=r"copying version 1 into a staging buffer failed: .*meta"
    ):
        service.wait_snapshot(timeout=30)
    assert service.wait_snapshot(timeout=0) == 0.0
    service.flush(timeout=0)  # nothing left in flight
    service.publish(2, _state(2))
    service.flush(timeout=30)
    assert service.latest_version() == 2


@pytest.mark.parametrize("surfaces_from", ["publish", "flush"])
def test_a_failed_snapshot_is_raised_once_by_the_next_publish_or_flush(service, surfaces_from):
    service.publish(1, _no_data())
    with pytest.raises(ParameterError, match="copying version 1 into a staging buffer failed"):
        if surfaces_from == "publish":
            service.publish(2, _state(2))
        else:
            service.flush(timeout=30)
    assert service.wait_snapshot(timeout=0) == 0.0
    service.flush(timeout=0)
    service.publish(3, _state(3))
    service.flush(timeout=30)
    assert service.latest_version() == 3


# -- failures ------------------------------------------------------------------------------


def _is_dead(actor: ray.actor.ActorHandle) -> bool:
    try:
        ray.get(actor.version.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_pulling_from_a_killed_relay_fails_fast_and_says_why(service):
    service.publish(1, _state(1))
    _wait_until(lambda: service.latest_version() == 1, "relay 0 taking version 1")
    ray.kill(service.relays[0])  # asynchronous: wait until Ray reports the relay dead
    _wait_until(lambda: _is_dead(service.relays[0]), "relay 0 dying")
    start = time.monotonic()
    with pytest.raises(
        ParameterError, match="newer than -1 from relay 0 failed: the relay is dead"
    ):
        service.pull_blobs(-1, timeout=5.0)
    assert time.monotonic() - start < 2.0
    with pytest.raises(ParameterError, match="relay 0 failed: the relay is dead"):
        service.latest_version(timeout=5.0)


@ray.remote(num_cpus=0)
class _FakeRelay:
    """A relay on a stalled node: every fetch fails (or hangs), `latest` never answers."""

    def __init__(self, hang: bool) -> None:
        self._hang = hang

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def take(self, version: int, index: int, parts: list[Any]) -> bool:
        if self._hang:
            time.sleep(600)
        raise RuntimeError(f"cannot fetch version {version}")

    def commit(self, version: int, count: int, digests: list[str]) -> bool:
        raise AssertionError("no bucket was taken")

    def latest(self, after: int) -> None:
        time.sleep(600)

    def version(self) -> int:
        return -1


def test_publish_does_not_wait_for_the_relay_until_too_far_behind(fake_service):
    service = fake_service(_FakeRelay.remote(hang=True))  # type: ignore[attr-defined]
    state = _state(1)
    start = time.monotonic()
    for version in range(MAX_IN_FLIGHT):
        service.publish(version, state)
    assert time.monotonic() - start < 2.0
    # One more needs a staging buffer, and both hold versions relay 0 has not taken: it
    # waits for the oldest hand-over, which gives up on the relay, and says why.
    with pytest.raises(ParameterError, match=r"relay 0 has not taken version 0 after 0.5 s"):
        service.publish(MAX_IN_FLIGHT, state)


def test_a_failed_hand_over_is_raised_by_a_later_publish_and_by_flush(fake_service):
    # Every offer fails at once.
    service = fake_service(_FakeRelay.remote(hang=False))  # type: ignore[attr-defined]
    service.publish(1, _state(1))
    # Version 1's failure comes out of the first publish after it happened, at the latest
    # out of the one that needs its staging buffer back (that one waits for it). The
    # publish that raises it publishes nothing.
    published = [1]
    with pytest.raises(
        ParameterError, match=r"(?s)relay 0 did not take version 1: .*cannot fetch version 1"
    ):
        for version in range(2, 2 + MAX_IN_FLIGHT):
            service.publish(version, _state(version))
            published.append(version)
    for version in published[1:]:  # published in between, failed too: flush raises each
        with pytest.raises(ParameterError, match=rf"did not take version {version}: "):
            service.flush(timeout=10)
    # The retry of the publish that raised does publish, and its failure reaches flush.
    retry = published[-1] + 1
    service.publish(retry, _state(retry))
    with pytest.raises(
        ParameterError,
        match=rf"(?s)relay 0 did not take version {retry}: .*cannot fetch version {retry}",
    ):
        service.flush(timeout=10)
    service.flush(timeout=0)  # each failure is raised once


def test_a_pull_from_an_unresponsive_relay_times_out(fake_service):
    service = fake_service(_FakeRelay.remote(hang=False))  # type: ignore[attr-defined]
    start = time.monotonic()
    with pytest.raises(ParameterError, match=r"relay 0 timed out after 0.5 s; is the relay alive"):
        service.pull_blobs(-1, timeout=0.5)
    assert time.monotonic() - start < 3.0

    asked = service.ask(-1)
    time.sleep(0.2)
    assert not asked.answered()
    with pytest.raises(ParameterError, match=r"relay 0 timed out after 0.5 s; is the relay alive"):
        service.collect(asked, timeout=0.5)


# -- a version gathered from shards --------------------------------------------------------


def _one_at_a_time(state: dict[str, torch.Tensor], alive: list[int]):
    """``state``'s tensors as a sharded trainer gathers them: each a fresh full tensor,
    made when asked for. ``alive`` records, as each is made, how many made before are still
    referenced somewhere (weakly watched)."""
    import weakref

    made: list[weakref.ref] = []
    for name, tensor in state.items():
        alive.append(sum(ref() is not None for ref in made))
        full = tensor.clone()  # the gather
        made.append(weakref.ref(full))
        yield name, full
        del full


def test_a_version_gathered_one_tensor_at_a_time_holds_one_at_a_time(service, worker):
    """``publish_from`` copies each tensor into the bucket being filled and lets it go before
    the next is gathered; relay 0 holds the version when it returns."""
    state = _state(5)
    layout = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    alive: list[int] = []
    service.publish_from(1, layout, _one_at_a_time(state, alive))
    assert len(alive) == len(state) and max(alive) == 0  # each copied, then let go
    assert service.latest_version() == 1
    pulled = ray.get(worker.pull.remote(service, 0, 30.0), timeout=60)
    assert pulled is not None and pulled[0] == 1
    _assert_same(pulled[1], state)
    service.publish(2, _state(6))  # the same staging buffers serve a plain publish after
    service.flush(timeout=30)
    assert service.latest_version() == 2


@pytest.mark.parametrize(
    ("tensors", "why"),
    [
        (lambda s: [*s.items(), ("extra", torch.zeros(1))], "'extra' came but is not in"),
        (lambda s: list(s.items())[:-1], r"1 tensor\(s\) of the layout never came"),
        (lambda s: list(s.items())[1:], r"'layers\.1\.w' came where 'layers\.0\.w' was due"),
        (lambda s: [*s.items(), next(iter(s.items()))], "came twice"),
    ],
    ids=["unknown", "missing", "out-of-order", "twice"],
)
def test_a_gathered_version_that_does_not_fit_its_layout_is_refused(service, tensors, why):
    state = _state(1)
    layout = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    given = tensors(state)
    read = []

    def reading():
        for pair in given:
            read.append(pair[0])
            yield pair

    with pytest.raises(ParameterError, match=why):
        service.publish_from(1, layout, reading())
    assert len(read) == len(given)  # read to the end: the other ranks' gathers end too
    assert service.latest_version() == -1  # relay 0 committed nothing
    service.publish_from(1, layout, iter(state.items()))
    assert service.latest_version() == 1


class _Engine:
    """A rollout engine's weight side: ``skips`` takes a version's number without reading
    its tensors (a load that never reached the model)."""

    def __init__(self, skips: bool) -> None:
        self.skips, self._version = skips, 0

    def version(self) -> int:
        return self._version

    def load_weights(self, weights: Weights, version: int) -> None:
        if not self.skips:
            _loaded(weights)
        self._version = version


@pytest.mark.parametrize("skips", [False, True], ids=["loads", "skips-the-load"])
def test_a_worker_that_skips_a_load_is_caught_by_the_driver(service, skips):
    env = make_env("addition")
    worker = RolloutWorker(lambda: _Engine(skips), env, lambda: VerifierScorer(env), None, service)
    service.publish(1, _state(1))
    service.flush(timeout=30)
    served = worker.sync_weights(1, timeout_s=10)
    assert served.version == 1
    checker = ServedWeights(service.published_digest, stale_after_s=60.0)
    if not skips:
        assert served.digest == service.published_digest(1)
        assert checker.check(0, 1, digest_number(served.digest), newest=1) == []
        return
    with pytest.raises(
        WeightsMismatch, match=r"rollout worker 0 reports version 1, .*did not read the whole"
    ):
        checker.check(0, served.version, digest_number(served.digest), newest=1)
