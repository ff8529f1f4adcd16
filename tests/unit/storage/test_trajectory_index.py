"""The store's bookkeeping with a fake clock: readiness, whole groups, leases, staleness."""

import pytest

from sluice.storage.ledger import LedgerEvent
from sluice.storage.trajectory_index import LeaseError, SampleMeta, TrajectoryIndex


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Sink:
    def __init__(self) -> None:
        self.events: list[LedgerEvent] = []

    def append(self, events: list[LedgerEvent]) -> None:
        self.events.extend(events)

    def of(self, kind: str) -> list[LedgerEvent]:
        return [e for e in self.events if e.event == kind]


def group(name: str, size: int = 4, version: int = 0, scored: bool = True) -> list[SampleMeta]:
    return [
        SampleMeta(
            f"{name}/{j}",
            f"p-{name}",
            name,
            version,
            reward=0.5 if scored else None,
            advantage=float(j) if scored else None,
        )
        for j in range(size)
    ]


@pytest.fixture
def parts() -> tuple[TrajectoryIndex, Sink, Clock]:
    sink, clock = Sink(), Clock()
    return TrajectoryIndex(sink, clock), sink, clock


def test_lease_whole_groups_oldest_first_and_ack_frees_blocks(parts):
    index, sink, _ = parts
    index.add("block-a", group("a") + group("b"))
    index.add("block-c", group("c"))
    grant = index.take(6, current_version=2, max_staleness=4, lease_s=60)
    # 6 samples asked, groups are never split: a and b (8 samples), both from block-a.
    assert grant.sample_ids == [f"{g}/{j}" for g in "ab" for j in range(4)]
    assert grant.blocks == ["block-a"] and grant.runs == [(0, 0, 8)]
    assert grant.advantages == [0.0, 1.0, 2.0, 3.0] * 2
    assert grant.staleness == [2] * 8
    assert index.stats()["leased"] == 8 and index.stats()["ready"] == 4
    assert index.ack(grant.lease_id, version=3) == 8
    trained = sink.of("trained")
    assert [e.sample_id for e in trained] == grant.sample_ids
    assert {(e.version, e.staleness) for e in trained} == {(3, 2)}
    assert index.stats()["blocks"] == 1  # block-a released, block-c still live
    with pytest.raises(LeaseError, match="already acknowledged"):
        index.ack(grant.lease_id, version=3)


def test_not_enough_ready_leases_nothing(parts):
    index, _, _ = parts
    index.add("blk", group("a"))
    assert index.take(5, 0, 1, 60) is None
    assert index.stats()["ready"] == 4 and index.stats()["leases"] == 0


def test_group_becomes_ready_only_when_every_sample_arrived(parts):
    index, sink, _ = parts
    first, second = group("g")[:2], group("g")[2:]
    second[1].reward, second[1].reason = 0.0, "verifier raised ValueError"
    index.add("b1", first, group_size=4)  # samples arrive one block at a time
    assert index.take(1, 0, 0, 60) is None
    index.add("b2", second, group_size=4)
    grant = index.take(4, 0, 0, 60)
    assert grant.runs == [(0, 0, 2), (1, 0, 2)]  # two blocks, one run each
    assert grant.rewards == [0.5, 0.5, 0.5, 0.0]
    assert len(sink.of("generated")) == len(sink.of("scored")) == 4  # the ledger has both
    assert sink.of("scored")[-1].reason == "verifier raised ValueError"


def test_stale_groups_are_dropped_with_the_reason(parts):
    index, sink, _ = parts
    index.add("old", group("old", version=0))
    index.add("new", group("new", version=2))
    grant = index.take(4, current_version=3, max_staleness=1, lease_s=60)
    assert grant.sample_ids[0] == "new/0"
    dropped = sink.of("dropped")
    assert len(dropped) == 4
    assert dropped[0].reason == "stale: finished at version 0, trainer at 3, max_staleness 1"
    assert index.stats()["blocks"] == 1  # the stale block was freed


def spanning(name: str, spans: list[tuple[int, int]]) -> list[SampleMeta]:
    """A group whose sample j has tokens of versions spans[j][0] to spans[j][1]."""
    return [
        SampleMeta(f"{name}/{j}", f"p-{name}", name, first, 0.5, 0.0, last_version=last)
        for j, (first, last) in enumerate(spans)
    ]


@pytest.mark.parametrize(
    ("stale_by", "kept", "staleness"),
    [("last_token", ["long"], [0, 0]), ("first_token", [], None)],
)
def test_a_group_is_as_old_as_the_token_the_rule_names(stale_by, kept, staleness):
    """Partial rollout: a group started under version 0; its short sample finished under
    1, its long one under 3. With the trainer at 3 and max_staleness 1, last_token dates
    the group at 3 and trains it, first_token dates it at 0 and drops it."""
    sink = Sink()
    index = TrajectoryIndex(sink, Clock(), stale_by=stale_by)
    index.add("b", spanning("long", [(0, 1), (0, 3)]))
    grant = index.take(2, current_version=3, max_staleness=1, lease_s=60)
    assert ([grant.sample_ids[0].split("/")[0]] if grant else []) == kept
    if grant:
        assert grant.staleness == staleness
        index.ack(grant.lease_id, 4)
        assert [e.staleness for e in sink.of("trained")] == staleness
    else:
        reasons = {e.reason for e in sink.of("dropped")}
        assert reasons == {"stale: started at version 0, trainer at 3, max_staleness 1"}


def test_a_group_finished_long_ago_is_stale_by_its_last_token_too():
    sink = Sink()
    index = TrajectoryIndex(sink, Clock())
    index.add("b", spanning("g", [(0, 1), (1, 1)]))
    assert index.take(2, current_version=3, max_staleness=1, lease_s=60) is None
    reasons = {e.reason for e in sink.of("dropped")}
    assert reasons == {"stale: finished at version 1, trainer at 3, max_staleness 1"}


def test_expired_lease_goes_back_to_the_front(parts):
    index, _, clock = parts
    index.add("blk", group("a") + group("b"))
    lost = index.take(4, 0, 0, lease_s=30)
    clock.now = 31.0
    again = index.take(4, 0, 0, lease_s=30)
    assert again.sample_ids == lost.sample_ids
    assert index.stats()["expired_leases"] == 1
    with pytest.raises(LeaseError, match="expired"):
        index.ack(lost.lease_id, 1)
    assert index.ack(again.lease_id, 1) == 4


def test_bad_input_changes_nothing(parts):
    index, sink, _ = parts
    index.add("blk", group("a"))
    before, events = index.stats(), len(sink.events)
    with pytest.raises(ValueError, match="already in the store"):
        index.add("dup", group("a"))
    with pytest.raises(ValueError, match="'x/0' is already in the store"):
        index.add("dup", group("x", size=1) + group("x", size=1))
    with pytest.raises(ValueError, match="'u/0' needs both a reward and an advantage"):
        index.add("unscored", group("u", scored=False))
    assert index.stats() == before and len(sink.events) == events


def test_drop_all_accounts_for_every_sample_left(parts):
    index, sink, _ = parts
    index.add("b1", group("a") + group("b"))
    index.add("b2", group("c"), group_size=5)  # c still waits for a sample
    index.take(4, 0, 0, 60)  # a is leased when the run ends
    assert index.drop_all("the run ended") == 12
    assert {e.sample_id for e in sink.of("dropped")} == {
        f"{g}/{j}" for g in "abc" for j in range(4)
    }
    assert index.stats()["held"] == 0 and index.stats()["blocks"] == 0


def test_samples_trained_under_a_lease_of_a_dead_store_are_acknowledged_by_id(parts):
    """A store restarted in place re-offers what the old one had leased; the trainer's
    acknowledgement names the samples, and only ready ones count (trained ones are gone)."""
    index, sink, _ = parts
    index.add("block", group("a", version=1) + group("b"), record=False)
    trained = index.ack_samples(
        [f"a/{j}" for j in range(4)] + ["gone/0"], version=3, current_version=2
    )
    assert trained == 4 and not index.has_lease("never-granted")
    assert {(e.sample_id, e.version, e.staleness) for e in sink.of("trained")} == {
        (f"a/{j}", 3, 1) for j in range(4)
    }
    assert index.stats()["ready"] == 4  # b is still offered
    grant = index.take(4, current_version=2, max_staleness=4, lease_s=60)
    assert index.ack_samples(grant.sample_ids, 3, 2) == 0  # leased: the lease acks them
    assert index.has_lease(grant.lease_id)


def _scored(
    name: str, rewards: list[float], failed: frozenset[int] = frozenset()
) -> list[SampleMeta]:
    return [
        SampleMeta(
            f"{name}/{j}", f"p-{name}", name, 0, reward=r, advantage=0.0,
            reason="reward timed out" if j in failed else None,
        )
        for j, r in enumerate(rewards)
    ]  # fmt: skip


def test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal():
    sink = Sink()
    index = TrajectoryIndex(sink, Clock(), drop_uniform=True)
    index.add("block", _scored("same", [1.0, 1.0, 1.0]) + _scored("mixed", [1.0, 0.0, 1.0]))
    # the failed sample's reward is no verdict: its group's others all scored 0
    index.add("block-2", _scored("failed", [0.0, 5.0, 0.0], failed=frozenset({1})))
    index.add("block-3", _scored("all-failed", [0.0, 0.0], failed=frozenset({0, 1})))
    dropped = {e.sample_id: e.reason for e in sink.of("dropped")}
    assert dropped == {
        **{f"same/{j}": "dynamic sampling: all 3 rewards equal (1)" for j in range(3)},
        **{f"failed/{j}": "dynamic sampling: all 3 rewards equal (0)" for j in range(3)},
        **{
            f"all-failed/{j}": "dynamic sampling: every reward of the group's 2 samples failed"
            for j in range(2)
        },
    }
    assert index.stats()["ready"] == 3 and index.counts["dropped"] == 8
    grant = index.take(3, current_version=0, max_staleness=1, lease_s=60)
    assert grant.sample_ids == [f"mixed/{j}" for j in range(3)]


def test_without_dynamic_sampling_a_uniform_group_trains():
    index = TrajectoryIndex(Sink(), Clock())
    index.add("block", _scored("same", [1.0, 1.0]))
    assert index.take(2, current_version=0, max_staleness=1, lease_s=60) is not None
