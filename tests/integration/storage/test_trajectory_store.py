"""The trajectory store on a real Ray instance, with its ledger on file:// and on S3."""

from __future__ import annotations

import os
import re
import time
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.parquet  # (pa.parquet)
import pytest
import ray

from sluice.storage.batches import to_train_batch
from sluice.storage.ledger import Ledger, LedgerEvent, check_exactly_once, latest_events
from sluice.storage.schema import SCHEMA, SCHEMA_VERSION, SchemaError, batch_from_rows
from sluice.storage.trajectory_store import LeaseError, StoreClient, create_store
from sluice.storage.urls import credential_env, open_url

pytestmark = pytest.mark.integration

GROUP = 4


def rows(group: str, version: int = 0, size: int = GROUP, tokens: int = 6) -> list[dict]:
    now = datetime.now(UTC)
    return [
        {
            "sample_id": f"{group}/{j}",
            "prompt_id": f"prompt-{group}",
            "group_id": group,
            "env": "addition",
            "prompt_ids": [1, 2, 3],
            "response_ids": [4 + j] * tokens,
            "behaviour_logprobs": [-0.5] * tokens,
            "token_versions": [version] * tokens,
            "reward": j / size,
            "advantage": j - size / 2,
            "prompt_len": 3,
            "response_len": tokens,
            "status": "scored",
            "generated_at": now,
            "scored_at": now,
        }
        for j in range(size)
    ]


def block(*groups: str, version: int = 0) -> pa.RecordBatch:
    return batch_from_rows([r for g in groups for r in rows(g, version)])


def creds() -> dict:
    """Actors open the storage URL themselves: they need the S3 variables of this test."""
    return {"env_vars": credential_env()}


@pytest.fixture
def client(ray_local, store_url):
    handle = create_store(store_url, capacity=64)
    yield StoreClient(handle, store_url)
    ray.kill(handle)


@ray.remote(num_cpus=0)
class Consumer:
    """A trainer stand-in in its own process: leases and (maybe) acknowledges."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client
        self.lease = None

    def take(self, count: int, version: int) -> list[str]:
        self.lease = self.client.lease(count, version, max_staleness=2, lease_s=1.0)
        return self.lease.sample_ids


@ray.remote(num_cpus=0)
class Producer:
    def put(self, client: StoreClient, batch: pa.RecordBatch) -> None:
        client.put(batch)

    def crash(self) -> None:
        os._exit(1)


def test_put_lease_ack_round_trip(client):
    ray.get(
        Producer.options(runtime_env=creds()).remote().put.remote(client, block("a", "b"))
    )  # another process puts
    lease = client.lease(8, current_version=1, max_staleness=1)
    assert lease.sample_ids == [f"{g}/{j}" for g in "ab" for j in range(GROUP)]
    assert lease.table.schema.names == SCHEMA.names
    tensors = to_train_batch(lease.table, pad_id=0)
    assert tensors.input_ids.shape == (8, 9) and tensors.advantages[:4].tolist() == [-2, -1, 0, 1]
    only = client.lease  # field projection: a consumer reads just the columns it needs
    client.put(block("c"))
    narrow = only(4, 1, 1, fields=["sample_id", "advantage"])
    assert narrow.table.column_names == ["sample_id", "advantage"]
    assert client.ack(lease, version=2) == 8 and client.ack(narrow, version=2) == 4
    events = Ledger(client.url).read()
    assert check_exactly_once(events) == []
    assert set(latest_events(events).values()) == {"trained"}


def test_rows_outlive_the_producer_that_put_them(ray_local):
    """The producer owns the object it put; the store keeps its own copy of the block."""
    client = StoreClient(create_store(None, capacity=64))
    producer = Producer.remote()
    ray.get(producer.put.remote(client, block("a")))
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(producer.crash.remote(), timeout=60)
    time.sleep(1.0)  # let Ray free what the dead producer owned
    lease = client.lease(GROUP, 0, 0, timeout_s=30)
    assert lease.sample_ids == [f"a/{j}" for j in range(GROUP)]
    assert to_train_batch(lease.table, pad_id=0).input_ids.shape == (GROUP, 9)
    ray.kill(client.handle)


def test_a_dead_consumers_lease_comes_back(client):
    client.put(block("a", "b"))
    consumer = Consumer.options(runtime_env=creds()).remote(client)
    taken = ray.get(consumer.take.remote(4, 0))
    ray.kill(consumer)  # dies holding the lease on one group
    # Only one group is ready; the other comes back when the dead consumer's lease expires.
    first = client.lease(4, 0, 2, timeout_s=30)
    second = client.lease(4, 0, 2, timeout_s=30)
    assert taken in (first.sample_ids, second.sample_ids)
    assert sorted(first.sample_ids + second.sample_ids) == [
        f"{g}/{j}" for g in "ab" for j in range(4)
    ]
    assert client.stats()["expired_leases"] == 1
    client.ack(first, 1)
    client.ack(second, 1)
    assert check_exactly_once(Ledger(client.url).read()) == []


def test_a_full_store_holds_producers_back(ray_local, tmp_path):
    url = f"file://{tmp_path}"
    client = StoreClient(create_store(url, capacity=8), url)
    client.put(block("a", "b"))
    blocked = Producer.options(runtime_env=creds()).remote().put.remote(client, block("c"))
    ready, _ = ray.wait([blocked], timeout=2.0)
    assert not ready and client.stats()["held"] == 8  # waiting, not growing
    client.ack(client.lease(4, 0, 0), 1)
    ray.get(blocked, timeout=15)  # room was made: the producer got in
    assert client.stats()["held"] == 8
    with pytest.raises(ValueError, match="can never fit a store of capacity 8"):
        client.put(block("d", "e", "f"))


def test_dynamic_sampling_drops_uniform_groups_and_makes_room(ray_local, tmp_path):
    """A group whose rewards are all equal is dropped as it arrives, its reason in the
    ledger, and frees its room at once: a full store takes the next producer's block."""
    url = f"file://{tmp_path}"
    client = StoreClient(create_store(url, capacity=8, drop_uniform=True), url)
    uniform = batch_from_rows([{**r, "reward": 1.0} for r in rows("same")])
    client.put(uniform)
    client.put(block("a", "b"))  # rewards 0, 1/4, 2/4, 3/4: kept (8 of 8 places)
    assert client.stats()["dropped"] == GROUP and client.stats()["ready"] == 2 * GROUP
    lease = client.lease(2 * GROUP, 0, 0)
    assert sorted(lease.sample_ids) == [f"{g}/{j}" for g in "ab" for j in range(GROUP)]
    client.ack(lease, 1)  # the ledger is written at every ack
    events = Ledger(url).read()
    dropped = [e for e in events.to_pylist() if e["event"] == "dropped"]
    assert [e["sample_id"] for e in dropped] == [f"same/{j}" for j in range(GROUP)]
    assert {e["reason"] for e in dropped} == {"dynamic sampling: all 4 rewards equal (1)"}
    assert check_exactly_once(events) == []


def test_a_draining_store_lets_producers_finish(ray_local, tmp_path):
    """Held-out evaluation and the end of a run consume nothing: a worker finishing what it
    holds must not block on a full store then."""
    url = f"file://{tmp_path}"
    client = StoreClient(create_store(url, capacity=8), url)
    client.put(block("a", "b"))
    blocked = Producer.options(runtime_env=creds()).remote().put.remote(client, block("c"))
    ready, _ = ray.wait([blocked], timeout=2.0)
    assert not ready  # full: waiting
    client.drain(True)
    ray.get(blocked, timeout=15)  # got in without a consumer
    assert client.stats()["held"] == 12
    client.drain(False)
    late = Producer.options(runtime_env=creds()).remote().put.remote(client, block("d"))
    ready, _ = ray.wait([late], timeout=2.0)
    assert not ready  # bounded again
    client.ack(client.lease(12, 0, 0), 1)
    ray.get(late, timeout=15)


def test_stale_samples_are_dropped_with_a_reason(client):
    client.put(block("old", version=0))
    client.put(block("new", version=5))
    lease = client.lease(4, current_version=6, max_staleness=2)
    assert lease.sample_ids[0] == "new/0" and lease.staleness == [1] * GROUP
    client.ack(lease, 7)
    dropped = [e for e in Ledger(client.url).read().to_pylist() if e["event"] == "dropped"]
    assert len(dropped) == GROUP
    assert dropped[0]["reason"] == "stale: finished at version 0, trainer at 6, max_staleness 2"


def test_bad_rows_are_refused_and_nothing_stored_is_lost(client):
    client.put(block("good"))
    broken = block("bad").to_pylist()
    broken[1]["behaviour_logprobs"] = [-0.5]  # 1 log-prob for 6 tokens
    with pytest.raises(
        SchemaError, match="'behaviour_logprobs' has 1 entries but response_len is 6"
    ):
        client.put(pa.RecordBatch.from_pylist(broken, schema=SCHEMA))
    old = block("old-format").replace_schema_metadata({b"sluice.schema_version": b"0"})
    reads = f"schema version 0, but this code reads schema version {SCHEMA_VERSION}"
    with pytest.raises(SchemaError, match=reads):
        client.put(old)
    with pytest.raises(ValueError, match="'good/0' is already in the store"):
        client.put(block("good"))
    unscored = [{**r, "status": "generated", "reward": None, "advantage": None} for r in rows("u")]
    with pytest.raises(SchemaError, match="status 'generated'; producers add rows as 'scored'"):
        client.put(batch_from_rows(unscored), group_size=GROUP)
    no_reward = [{**r, "reward": None} for r in rows("blank")]
    with pytest.raises(SchemaError, match=r"'blank/0'\) is 'scored' but lacks its reward"):
        client.put(batch_from_rows(no_reward))
    fs, root = open_url(client.url)
    assert len(fs.ls(f"{root}/trajectories")) == 1  # the refused block left no file behind
    lease = client.lease(4, 0, 0)
    assert lease.sample_ids == [f"good/{j}" for j in range(GROUP)]
    with pytest.raises(LeaseError, match="unknown"):
        ray.get(client.handle.ack.remote("no-such-lease", 1))


def test_restart_rebuilds_from_the_ledger(ray_local, store_url):
    first = StoreClient(create_store(store_url, capacity=64, lease_s=60), store_url)
    for name in "abcdef":
        first.put(block(name))
    first.ack(first.lease(8, 0, 5), 1)  # a, b trained
    first.lease(4, 1, 5)  # c leased, never acknowledged: the store dies
    ray.kill(first.handle)

    second = StoreClient(create_store(store_url, capacity=64, restore=True), store_url)
    assert second.stats()["ready"] == 16
    rest = second.lease(16, 1, 5)
    assert sorted({s.split("/")[0] for s in rest.sample_ids}) == list("cdef")
    second.ack(rest, 2)
    events = Ledger(store_url).read()
    assert check_exactly_once(events) == []
    latest = latest_events(events)
    assert sorted(latest) == sorted(f"{g}/{j}" for g in "abcdef" for j in range(GROUP))
    assert set(latest.values()) == {"trained"}
    ray.kill(second.handle)


def _restart(handle) -> None:
    """End the store's process the way a crash would; Ray starts it again."""
    before = ray.get(handle.restart.remote())[0]
    ray.kill(handle, no_restart=False)
    deadline = time.monotonic() + 60
    while ray.get(handle.restart.remote())[0] == before:  # the kill is asynchronous
        assert time.monotonic() < deadline, "the store did not restart within 60 s"
        time.sleep(0.1)


def test_a_store_that_dies_restarts_in_place_and_loses_nothing(ray_local, tmp_path):
    """Killed twice: once with rows only in the producer's write buffer, a batch the
    trainer has read but not acknowledged and one it trained, once with rows in flight
    and the ledger events of a dispatched group not flushed. The producer sends what the
    new store lacks; the read batch is acknowledged by its sample ids; a late drop of a
    trained sample is left out; the ledger ends exactly once."""
    url = f"file://{tmp_path}"
    handle = create_store(url, capacity=64, max_restarts=2)
    producer = StoreClient(handle, url, persist_rows=100)  # rows stay in its buffer
    writer = StoreClient(handle, url)  # a file per put
    producer.put(block("a"))
    producer.put(block("b"))
    writer.put(block("c"))
    read = producer.lease(GROUP, 0, 5)  # the trainer read "a"'s rows
    producer.ack(producer.lease(2 * GROUP, 0, 5), 1)  # b and c trained (the ledger flushed)
    _restart(handle)

    producer.put(block("d"))  # waits for the new store; its answer says it is new
    assert producer.ack(read, 1) == GROUP  # a lease the new store never granted
    # b's worker died before it reported b done: the drop comes after b was trained
    producer.record([LedgerEvent(f"b/{j}", "prompt-b", "dropped", reason="late") for j in range(4)])
    assert producer.stats()["ready"] == GROUP  # d; a, b and c are trained

    producer.record([LedgerEvent(f"e/{j}", "prompt-e", "dispatched") for j in range(GROUP)])
    producer.put(block("e"))
    _restart(handle)
    producer.flush()  # asks the store which incarnation it is, sends d and e again
    rest = producer.lease(2 * GROUP, 1, 5)
    assert sorted({s.split("/")[0] for s in rest.sample_ids}) == list("de")
    producer.ack(rest, 2)
    ray.get(handle.close.remote("the run ended"))
    events = Ledger(url).read()
    assert check_exactly_once(events, finished=True) == []
    latest = latest_events(events)
    assert sorted(latest) == sorted(f"{g}/{j}" for g in "abcde" for j in range(GROUP))
    assert set(latest.values()) == {"trained"}
    ray.kill(handle)


def test_a_restarted_store_drops_what_no_producer_sends_again(ray_local, tmp_path):
    """Rows whose producer died with them in its write buffer end dropped, named."""
    url = f"file://{tmp_path}"
    handle = create_store(url, capacity=64, max_restarts=1)
    lost = StoreClient(handle, url, persist_rows=100)
    lost.put(block("a"))
    ray.get(handle.flush.remote())
    del lost  # its producer is gone, and its buffer with it
    _restart(handle)
    assert ray.get(handle.close.remote("the run ended")) == GROUP
    dropped = [e for e in Ledger(url).read().to_pylist() if e["event"] == "dropped"]
    assert {e["sample_id"] for e in dropped} == {f"a/{j}" for j in range(GROUP)}
    assert "no rollout worker sent them again" in dropped[0]["reason"]
    ray.kill(handle)


def test_restart_records_rows_it_cannot_find(ray_local, tmp_path):
    url = f"file://{tmp_path}"
    first = StoreClient(create_store(url, capacity=64), url)
    first.put(block("kept"))
    first.put(block("gone"))
    ray.get(first.handle.flush.remote())
    ray.kill(first.handle)
    for path in (tmp_path / "trajectories").iterdir():
        if re.search(rb"gone/0", path.read_bytes()):
            path.unlink()
    second = StoreClient(create_store(url, capacity=64, restore=True), url)
    assert second.stats()["ready"] == GROUP
    latest = Ledger(url).read().to_pylist()
    lost = [e for e in latest if e["event"] == "dropped"]
    assert {e["sample_id"] for e in lost} == {f"gone/{j}" for j in range(GROUP)}
    assert lost[0]["reason"] == "its rows were lost in a restart"
    ray.kill(second.handle)


def test_restart_skips_an_unreadable_trajectory_file_and_records_its_rows(ray_local, tmp_path):
    url = f"file://{tmp_path}"
    first = StoreClient(create_store(url, capacity=64), url)
    first.put(block("kept"))
    first.put(block("torn"))
    ray.get(first.handle.flush.remote())
    ray.kill(first.handle)
    for path in (tmp_path / "trajectories").iterdir():
        if re.search(rb"torn/0", path.read_bytes()):
            path.write_bytes(path.read_bytes()[:100])  # a file cut short by a crash
    second = StoreClient(create_store(url, capacity=64, restore=True), url)
    assert second.stats()["ready"] == GROUP  # the readable file's rows, re-offered
    lost = [e for e in Ledger(url).read().to_pylist() if e["event"] == "dropped"]
    assert {e["sample_id"] for e in lost} == {f"torn/{j}" for j in range(GROUP)}
    ray.kill(second.handle)


def test_rows_are_written_in_files_of_persist_rows(ray_local, tmp_path):
    url = f"file://{tmp_path}"
    client = StoreClient(create_store(url, capacity=64), url, persist_rows=8)
    client.put(block("a"))
    assert not (tmp_path / "trajectories").exists()  # 4 rows buffered, below 8
    client.put(block("b"))
    client.put(block("c"))
    client.flush()
    files = sorted((tmp_path / "trajectories").glob("*.parquet"))
    assert [pa.parquet.read_table(f).num_rows for f in files] == [8, 4]
    ray.kill(client.handle)


def test_pipelined_puts_all_arrive_and_refusals_surface(ray_local, tmp_path):
    """Puts in flight may be registered in any order (Ray runs an async actor's calls
    concurrently); every block arrives once and a refusal is raised by ``flush``."""
    url = f"file://{tmp_path}"
    client = StoreClient(create_store(url, capacity=64), url, pipeline=2)
    for name in "abc":
        client.put(block(name))  # returns before the store has answered
    client.put(block("a"))  # a duplicate: refused by the store, reported later
    with pytest.raises(ValueError, match="'a/0' is already in the store"):
        client.flush()
    lease = client.lease(12, 0, 0)
    assert sorted(lease.sample_ids) == [f"{g}/{j}" for g in "abc" for j in range(GROUP)]
    assert client.stats()["held"] == 12  # the duplicate block was not added
    ray.kill(client.handle)


def test_dispatch_events_reach_the_ledger_and_a_drop_never_overrides_stored_rows(
    ray_local, tmp_path
):
    url = f"file://{tmp_path}"
    client = StoreClient(create_store(url, capacity=64), url)
    ids = {name: [f"{name}/{j}" for j in range(GROUP)] for name in ("put", "lost")}
    client.record(
        [
            LedgerEvent(s, "prompt-" + s.split("/")[0], "dispatched")
            for group in ids.values()
            for s in group
        ]
    )
    client.put(block("put"))
    # The worker died after its put, before it reported: the dispatcher drops both groups.
    client.record(
        [
            LedgerEvent(s, "prompt-" + s.split("/")[0], "dropped", reason="worker died")
            for g in ids.values()
            for s in g
        ]
    )
    client.ack(client.lease(GROUP, 0, 0), 1)
    ray.get(client.handle.flush.remote())
    table = Ledger(url).read()
    assert check_exactly_once(table, finished=True) == []
    latest = latest_events(table)
    assert {latest[s] for s in ids["put"]} == {"trained"}
    assert {latest[s] for s in ids["lost"]} == {"dropped"}
    ray.kill(client.handle)


def test_rows_that_come_after_their_samples_were_dropped_stay_out(ray_local, tmp_path):
    """A worker declared dead while its put was on its way: the dispatcher's ``dropped``
    reaches the store first, so the late rows are refused and each sample ends once."""
    url = f"file://{tmp_path}"
    client = StoreClient(create_store(url, capacity=64), url)
    late = [f"late/{j}" for j in range(GROUP)]
    client.record([LedgerEvent(s, "prompt-late", "dispatched") for s in late])
    client.record([LedgerEvent(s, "prompt-late", "dropped", reason="worker died") for s in late])
    client.put(block("late"))  # taken, as far as the producer knows: it must not retry
    client.put(block("fine"))
    assert client.stats()["held"] == GROUP
    client.ack(client.lease(GROUP, 0, 0), 1)
    ray.get(client.handle.flush.remote())
    table = Ledger(url).read()
    assert check_exactly_once(table, finished=True) == []
    latest = latest_events(table)
    assert {latest[s] for s in late} == {"dropped"}
    assert {latest[f"fine/{j}"] for j in range(GROUP)} == {"trained"}
    ray.kill(client.handle)


def test_put_numbers_count_what_the_store_has_taken(ray_local):
    """A streaming worker reports a group done only once its put is settled."""
    client = StoreClient(create_store(None, capacity=64), pipeline=2)
    assert [client.put(block(name)) for name in "ab"] == [1, 2]
    assert client.settled == 0  # both may still be on their way
    ray.wait([p.pending for p in client._in_flight], num_returns=2)
    client.settle_answered()
    assert client.settled == 2
    assert client.put(block("c")) == 3
    client.flush()
    assert client.settled == 3
    ray.kill(client.handle)


def test_a_resume_ends_kept_samples_with_their_reason_unless_their_rows_were_stored(
    ray_local, tmp_path
):
    """Groups a checkpoint kept in flight: the restore ends the old ids of those with no
    stored rows with the reason it is given and names them (the run continues them);
    one that finished before the checkpoint is re-offered from its rows instead."""
    url = f"file://{tmp_path}"
    first = StoreClient(create_store(url, capacity=64), url)
    first.record(
        [
            LedgerEvent(f"{g}/{j}", f"prompt-{g}", "dispatched")
            for g in ("kept", "done", "other")
            for j in range(GROUP)
        ]
    )
    first.put(block("done"))
    first.flush()
    ray.get(first.handle.flush.remote())
    ray.kill(first.handle)
    carried = {f"{g}/{j}": "continued" for g in ("kept", "done") for j in range(GROUP)}
    second = create_store(url, capacity=64, restore="checkpoint", carried=carried)
    assert ray.get(second.carried.remote()) == [f"kept/{j}" for j in range(GROUP)]
    assert ray.get(second.stats.remote())["ready"] == GROUP  # "done", from its rows
    events = Ledger(url).read().to_pylist()
    reasons = {e["sample_id"]: e["reason"] for e in events if e["event"] == "dropped"}
    assert reasons == {
        **{f"kept/{j}": "continued" for j in range(GROUP)},
        **{f"other/{j}": "dispatched, not generated before the restart" for j in range(GROUP)},
    }
    ray.kill(second)
