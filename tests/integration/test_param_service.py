"""The parameter service on a real local Ray: bucketing, publish/pull, ownership, failures."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator

import pytest
import ray
import torch

from storage.params import (
    MAX_IN_FLIGHT,
    ParameterError,
    ParameterService,
    from_buckets,
    to_buckets,
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
        self, service: ParameterService, after: int, timeout: float, relay: int | None = None
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        return service.pull(after, timeout=timeout, relay=relay)


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


def test_buckets_round_trip_exactly():
    state = _state(0)
    blobs = to_buckets(state, bucket_bytes=MB)
    _assert_same(from_buckets(blobs), state)
    assert to_buckets(state, bucket_bytes=MB) == blobs  # deterministic


def test_buckets_respect_the_size_and_the_name_order():
    state = {f"t{i:02d}": torch.zeros(64 * 1024) for i in range(10)}  # 256 KB each
    blobs = to_buckets(state, bucket_bytes=MB)
    names = [sorted(from_buckets([blob])) for blob in blobs]
    assert [len(n) for n in names] == [4, 4, 2]  # 4 x 256 KB fill 1 MB exactly
    assert [name for bucket in names for name in bucket] == sorted(state)


def test_a_tensor_larger_than_a_bucket_gets_its_own():
    state = {"a": torch.zeros(10), "big": torch.zeros(3 * MB // 4), "c": torch.zeros(10)}
    blobs = to_buckets(state, bucket_bytes=MB // 2)
    assert [sorted(from_buckets([blob])) for blob in blobs] == [["a"], ["big"], ["c"]]


def test_a_name_in_two_buckets_is_an_error():
    blob = to_buckets({"w": torch.zeros(3)}, bucket_bytes=MB)[0]
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


def test_a_version_outlives_the_trainer_that_published_it(service, worker):
    trainer = _Trainer.remote(service)  # type: ignore[attr-defined]
    ray.get(trainer.publish.remote(1, 1), timeout=30)
    # Once relay 0 holds the version it owns the buckets, so the trainer may die.
    _wait_until(lambda: service.latest_version() == 1, "relay 0 taking version 1")
    ray.kill(trainer)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(trainer.publish.remote(2, 2), timeout=30)
    version, state = ray.get(worker.pull.remote(service, -1, 10.0), timeout=30)
    assert version == 1
    _assert_same(state, _state(1))


def _plasma_bytes() -> int:
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    return int(get_memory_info_reply(state).store_stats.object_store_bytes_used)


def test_old_versions_are_released(service):
    state = _state(0, megabytes=4)
    size = sum(t.nbytes for t in state.values())
    before = _plasma_bytes()
    for version in range(20):
        state["step"].fill_(version)
        service.publish(version, state)
    _wait_until(lambda: service.latest_version() == 19, "relay 0 taking version 19")
    # 20 versions were published; the relay holds one, the rest are freed (asynchronously).
    _wait_until(lambda: _plasma_bytes() - before < 2 * size, "old versions being freed")
    assert service.pull(18) is not None


def test_a_chained_relay_serves_the_version_on_its_own(ray_local, worker):
    chained = ParameterService.create(relays=2, bucket_bytes=MB)
    try:
        chained.publish(5, _state(5))
        relay_1 = chained.relays[1]
        _wait_until(
            lambda: ray.get(relay_1.version.remote(), timeout=10) == 5, "relay 1 taking version 5"
        )
        # Relay 1 re-put the buckets itself: it serves them with relay 0 gone.
        ray.kill(chained.relays[0])
        version, state = ray.get(worker.pull.remote(chained, 4, 10.0, 1), timeout=30)
        assert version == 5
        _assert_same(state, _state(5))
    finally:
        chained.shutdown()


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
        service.pull(-1, timeout=5.0)
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

    def offer(self, version: int, refs: list[ray.ObjectRef]) -> bool:
        if self._hang:
            time.sleep(600)
        raise RuntimeError(f"cannot fetch version {version}")

    def latest(self, after: int) -> None:
        time.sleep(600)

    def version(self) -> int:
        return -1


@pytest.fixture
def fake_service(ray_local) -> Iterator[Callable[[bool], ParameterService]]:
    """Makes services whose one relay is a `_FakeRelay`; kills them afterwards."""
    made: list[ParameterService] = []

    def make(hang: bool) -> ParameterService:
        relay = _FakeRelay.remote(hang)  # type: ignore[attr-defined]
        node = ray.get(relay.node_id.remote(), timeout=30)
        made.append(ParameterService([relay], [node], MB, fetch_timeout=0.5))
        return made[-1]

    yield make
    for svc in made:
        svc.shutdown()


def test_publish_does_not_wait_for_the_relay_until_too_far_behind(fake_service):
    service = fake_service(True)  # its offers take 600 s
    state = _state(1)
    start = time.monotonic()
    for version in range(MAX_IN_FLIGHT):
        service.publish(version, state)
    assert time.monotonic() - start < 2.0
    # One more would pile another copy into the object store: it waits, then says why.
    with pytest.raises(ParameterError, match=r"relay 0 has not taken version 0 after 0.5 s"):
        service.publish(MAX_IN_FLIGHT, state)


def test_a_failed_hand_over_is_raised_by_the_next_publish(fake_service):
    service = fake_service(False)
    service.publish(1, _state(1))
    # The relay runs its calls in order, so once this returns the offer has failed.
    assert service.latest_version() == -1
    with pytest.raises(
        ParameterError, match=r"(?s)relay 0 did not take version 1: .*cannot fetch version 1"
    ):
        service.publish(2, _state(2))


def test_a_pull_from_an_unresponsive_relay_times_out(fake_service):
    service = fake_service(False)
    start = time.monotonic()
    with pytest.raises(ParameterError, match=r"relay 0 timed out after 0.5 s; is the relay alive"):
        service.pull(-1, timeout=0.5)
    assert time.monotonic() - start < 3.0
