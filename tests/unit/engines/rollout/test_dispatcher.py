"""The dispatcher's admission control, skew-aware ordering and repack, without Ray."""

import time

import pytest

from sluice.config.tree import EnvConfig
from sluice.driver.environment import make_environment
from sluice.engines.rollout.dispatcher import LOOKAHEAD_STEPS, GroupDispatcher
from sluice.engines.rollout.messages import GroupDone, Handoff, PartialGroup, PartialSample
from sluice.envs.prompts import PromptStream
from sluice.rl.dispatch import InFlight
from sluice.storage.ledger import LedgerEvent
from sluice.storage.trajectory_store import DispatchRecovery

B, N = 2, 4  # groups per step, samples per group


class Book:
    """A ledger sink that keeps what the dispatcher records, and its journal, as the
    trajectory store does (``TrajectoryStore.journal``, ``recovery``)."""

    def __init__(self) -> None:
        self.events: list[LedgerEvent] = []
        self.state: dict | None = None
        self.since: dict[str, str] = {}

    def record(self, events: list[LedgerEvent], wait: bool = True) -> None:
        self.events.extend(events)
        for e in events:
            if e.event == "dispatched":
                self.since.setdefault(e.sample_id.rpartition("/")[0], e.prompt_id)

    def settle_records(self) -> None:
        """``record`` keeps every event at once: nothing is in flight."""

    def journal(self, state: dict) -> None:
        self.state, self.since = state, {}

    def recovery(self) -> DispatchRecovery | None:
        latest = {e.sample_id: e for e in self.events}
        in_flight = {
            s.rpartition("/")[0]: e.prompt_id for s, e in latest.items() if e.event == "dispatched"
        }
        return None if self.state is None else DispatchRecovery(self.state, self.since, in_flight)


@pytest.fixture
def dispatcher() -> GroupDispatcher:
    env, _ = make_environment(EnvConfig(train_prompts=64))
    return GroupDispatcher(
        Book(), PromptStream(env, 64, seed=0), env.name, B, N, max_staleness=1, seed=0
    )


def test_admission_keeps_generation_within_the_staleness_bound(dispatcher):
    # A worker at version v may start group g only while g < (v + k + 1) * B.
    first = dispatcher.take(worker=0, want=10, worker_version=0).assignments
    assert len(first) == (0 + 1 + 1) * B
    assert dispatcher.take(0, 10, 0).assignments == []  # held back until newer weights
    assert len(dispatcher.take(0, 10, 1).assignments) == B
    assert [a.group_id.split("@")[1] for a in first] == ["g0", "g1", "g2", "g3"]
    assert len({a.seed for a in first}) == len(first)


@pytest.mark.parametrize("long_first", [True, False], ids=["long-first", "stream-order"])
def test_long_groups_go_first_once_lengths_are_known(long_first):
    env, _ = make_environment(EnvConfig())
    stream = PromptStream(env, 4, seed=0)  # four prompts, coming round every epoch
    dispatcher = GroupDispatcher(Book(), stream, env.name, 2, N, 8, 0, long_first=long_first)
    first = dispatcher.take(0, 4, 0).assignments
    long = {a.problem.prompt_id for a in first[1::2]}
    for a in first:
        length = 30 if a.problem.prompt_id in long else 3
        done = GroupDone(
            a.group_id, a.problem.prompt_id, len(a.problem.prompt), [length] * N, 0, 0, 0, 0
        )
        dispatcher.report(0, [done], {"in_flight_tokens": 0.0, "free_groups": 4.0})
    second = dispatcher.take(0, 2, 0).assignments  # the same four prompts are back in the pool
    if long_first:
        assert {a.problem.prompt_id for a in second} == long
        assert [a.predicted for a in second] == [30.0, 30.0]
    else:
        assert [a.problem.prompt_id for a in second] == [p.prompt_id for p in stream_order(env)]


def stream_order(env):
    """The first two problems of the second epoch, as the stream alone would give them."""
    stream = PromptStream(env, 4, seed=0)
    stream.take(4)
    return stream.take(2)


def test_stop_and_resume(dispatcher):
    dispatcher.stop()
    assert dispatcher.take(0, 1, 0) is None
    dispatcher.resume()
    assert len(dispatcher.take(0, 1, 0).assignments) == 1


def test_reports_are_drained_once(dispatcher):
    done = GroupDone(
        "p@g0", "p", 6, [3, 5, 7, 9], reward_sum=2.0, correct=1, truncated=0, reward_errors=0
    )
    dispatcher.report(0, [done], {"version": 1.0, "in_flight_tokens": 0.0, "free_groups": 1.0})
    state = dispatcher.drain()
    assert state["totals"].samples == 4 and state["totals"].tokens == 24
    assert dispatcher.drain()["totals"].samples == 0


def _done(a) -> GroupDone:
    return GroupDone(a.group_id, a.problem.prompt_id, len(a.problem.prompt), [1] * N, 0, 0, 0, 0)


def test_a_dead_workers_groups_go_back_to_the_front_of_the_queue(dispatcher):
    held = dispatcher.take(worker=0, want=3, worker_version=0).assignments
    other = dispatcher.take(worker=1, want=1, worker_version=0).assignments
    dispatcher.report(0, [_done(held[0])], {"in_flight_tokens": 0.0, "free_groups": 1.0})
    assert dispatcher.admitted == 4
    assert dispatcher.requeue(0) == 2  # the finished group is not handed out again
    assert dispatcher.admitted == 2  # the admission window is back
    again = dispatcher.take(worker=1, want=2, worker_version=0).assignments
    assert [a.problem for a in again] == [a.problem for a in held[1:]]
    issued = {a.group_id for a in held + other + again}
    assert len(issued) == 6  # new group ids: a late put from the dead worker cannot collide
    assert dispatcher.requeue(0) == 0


def test_a_resumed_dispatcher_continues_from_the_checkpoint_cursor(dispatcher):
    """The prompts drawn into the look-ahead pool and not handed out are not skipped: the
    cursor holds them, and the resumed dispatcher hands them out before the stream's next."""
    dispatcher.take(0, 3, 0)
    left = list(dispatcher._pool)
    cursor = dispatcher.cursor()
    assert len(left) == LOOKAHEAD_STEPS * B - 3 and len(cursor["pool"]) == len(left)
    env, _ = make_environment(EnvConfig(train_prompts=64))
    stream = PromptStream(env, 64, seed=0)
    stream.restore(cursor["prompts"])
    expected = left + stream.take(2 * B)  # the pool's prompts, then the stream's next
    fresh = GroupDispatcher(Book(), PromptStream(env, 64, seed=0), env.name, B, N, 1, seed=0)
    fresh.restart_at(cursor, admitted=2, tag="a1.")
    resumed = fresh.take(0, 10, 0).assignments
    assert len(resumed) == (0 + 1 + 1) * B - 2 and fresh.admitted == 2 * B
    assert left[0] in {a.problem for a in resumed} and {a.problem for a in resumed} <= set(expected)
    assert [a.group_id.split("@")[1] for a in resumed] == ["a1.g3", "a1.g4"]


def test_dropped_groups_give_their_admission_back(dispatcher):
    first = dispatcher.take(0, 10, 0).assignments
    assert len(first) == 2 * B and dispatcher.take(0, 10, 0).assignments == []
    dispatcher.credit(1)  # the store dropped one of them as too stale
    assert len(dispatcher.take(0, 10, 0).assignments) == 1


def _counters(version: int) -> dict[str, float]:
    return {"in_flight_tokens": 0.0, "free_groups": 4.0, "version": float(version)}


def test_a_held_worker_is_told_the_version_it_waits_for_and_when_to_ask_sooner(dispatcher):
    dispatcher.take(0, 2 * B, 0)  # admission full at version 0 (k = 1)
    held = dispatcher.take(0, 10, 0)
    assert held.assignments == [] and held.held_until == 1
    assert len(dispatcher.take(0, 10, held.held_until).assignments) == B  # exactly then
    assert dispatcher.take(0, 10, 1).held_until == 2
    assert not dispatcher.report(0, [], _counters(1)).ask  # nothing changed: keep waiting
    dispatcher.credit(1)  # the store dropped a group as stale: its place opens now
    assert dispatcher.report(0, [], _counters(1)).ask
    assert len(dispatcher.take(0, 10, 1).assignments) == 1
    assert not dispatcher.report(0, [], _counters(1)).ask
    dispatcher.stop()  # a held worker learns of the stop from its next report
    assert dispatcher.report(0, [], _counters(1)).ask and dispatcher.take(0, 10, 1) is None


def test_reports_are_paced_to_a_budget_for_the_whole_fleet(dispatcher):
    from sluice.engines.rollout.dispatcher import REPORTS_PER_S

    for worker in range(400):
        reply = dispatcher.report(worker, [], _counters(0))
    assert reply.report_every_s == pytest.approx(400 / REPORTS_PER_S)


def test_a_held_straggler_is_told_to_ask_when_repack_moves_it_or_hands_it_groups():
    dispatcher = _repacking()
    mine = dispatcher.take(0, 1, 0).assignments
    theirs = dispatcher.take(1, 3, 0).assignments
    assert _straggling(dispatcher, 0, mine).held_until == 1
    assert not dispatcher.report(0, [], _counters(0)).ask  # alone, it has nowhere to go
    assert _straggling(dispatcher, 1, theirs[:2]).give_to is None
    assert dispatcher.report(0, [], _counters(0)).ask  # the plan moves it to worker 1 now
    assert not dispatcher.report(1, [], _counters(0)).ask
    assert _straggling(dispatcher, 0, mine).give_to == 1
    assert dispatcher.hand_over(0, 1, [_handoff(mine[0])])
    assert dispatcher.report(1, [], _counters(0)).ask  # its handed-over groups wait for it


def _straggling(dispatcher, worker, groups, version=0, age_s=5.0):
    """``worker`` asks for work while one sample of each of ``groups`` runs, started
    ``age_s`` ago; returns the answer."""
    started = time.time() - age_s
    running = [InFlight(f"{a.group_id}/0", a.group_id, started, 3, 10.0) for a in groups]
    return dispatcher.take(worker, 4, version, running)


def _handoff(a) -> Handoff:
    samples = [PartialSample(a.group_id, j, a.predicted, token_ids=[1, 2, 3]) for j in range(N)]
    return Handoff(a.group_id, PartialGroup(a.problem, [5, 6], samples, a.seed))


def _repacking() -> GroupDispatcher:
    env, _ = make_environment(EnvConfig(train_prompts=64))
    stream = PromptStream(env, 64, seed=0)
    return GroupDispatcher(Book(), stream, env.name, B, N, 1, 0, repack_max_stragglers=2)


def test_repack_moves_a_straggling_workers_groups_to_the_other_straggler():
    dispatcher = _repacking()
    mine = dispatcher.take(0, 1, 0).assignments
    theirs = dispatcher.take(1, 3, 0).assignments  # admission is now full: 2 * B issued
    assert _straggling(dispatcher, 0, mine).give_to is None  # only one worker straggles
    # Worker 1 has two stragglers, worker 0 one: worker 1 is the target, it keeps its own.
    assert _straggling(dispatcher, 1, theirs[:2]).give_to is None
    order = _straggling(dispatcher, 0, mine)
    assert order.assignments == [] and order.give_to == 1

    assert dispatcher.hand_over(0, 1, [_handoff(mine[0])])
    arrived = dispatcher.take(1, 4, 0)
    assert [h.group_id for h in arrived.handoffs] == [mine[0].group_id]
    assert dispatcher.take(1, 4, 0).handoffs == []  # delivered once
    assert dispatcher.drain()["totals"].repacked == 1
    # The moved group is worker 1's now: if worker 1 dies, it goes back to the queue.
    assert dispatcher.requeue(0) == 0
    assert dispatcher.requeue(1) == 4


def test_repack_leaves_young_samples_other_versions_and_a_stopped_run_alone():
    dispatcher = _repacking()
    mine = dispatcher.take(0, 1, 0).assignments
    theirs = dispatcher.take(1, 3, 0).assignments
    _straggling(dispatcher, 1, theirs[:2])
    assert _straggling(dispatcher, 0, mine, age_s=0.1).give_to is None  # too young to move
    assert _straggling(dispatcher, 0, mine, version=1).give_to is None  # a newer policy
    # A full batch again (no stragglers sent): worker 1 is no target any more.
    dispatcher.take(1, 4, 0)
    assert _straggling(dispatcher, 0, mine).give_to is None
    assert not dispatcher.hand_over(0, 1, [_handoff(mine[0])])
    _straggling(dispatcher, 1, theirs[:2])
    dispatcher.stop()
    assert _straggling(dispatcher, 0, mine) is None
    assert not dispatcher.hand_over(0, 1, [_handoff(mine[0])])  # the worker keeps its group


def test_groups_handed_over_before_a_stop_still_reach_their_target():
    dispatcher = _repacking()
    mine = dispatcher.take(0, 1, 0).assignments
    theirs = dispatcher.take(1, 3, 0).assignments
    _straggling(dispatcher, 1, theirs[:1])
    assert dispatcher.hand_over(0, 1, [_handoff(mine[0])])
    dispatcher.stop()
    last = dispatcher.take(1, 4, 0)
    assert last is not None and len(last.handoffs) == 1 and last.assignments == []
    assert dispatcher.take(1, 4, 0) is None


def test_every_dispatched_sample_is_in_the_ledger_and_a_dead_workers_are_dropped(dispatcher):
    book = dispatcher._ledger
    first = dispatcher.take(worker=0, want=2, worker_version=0).assignments
    second = dispatcher.take(worker=1, want=2, worker_version=0).assignments
    dispatched = [e.sample_id for e in book.events if e.event == "dispatched"]
    assert dispatched == [f"{a.group_id}/{j}" for a in first + second for j in range(N)]
    assert all(e.prompt_id == e.sample_id.split("@")[0] for e in book.events)
    book.events.clear()
    assert dispatcher.requeue(1) == 2
    dropped = {e.sample_id: e.reason for e in book.events}
    assert set(dropped) == {f"{a.group_id}/{j}" for a in second for j in range(N)}
    assert all("rollout worker 1 died" in reason for reason in dropped.values())
    again = dispatcher.take(worker=0, want=2, worker_version=1).assignments
    # The requeued prompts come back under new group ids, dispatched anew.
    assert [a.problem.prompt_id for a in again] == [a.problem.prompt_id for a in second]
    assert not {a.group_id for a in again} & {a.group_id for a in second}


def test_a_worker_gets_its_groups_however_many_others_report_room():
    """Each take plans over every worker's reported room but hands out only the asker's
    share; with more room reported than groups in the look-ahead pool, the asker (last, and
    losing ties) got nothing while admission was open, and asked again, and again."""
    env, _ = make_environment(EnvConfig(train_prompts=64))
    dispatcher = GroupDispatcher(
        Book(), PromptStream(env, 64, seed=0), env.name, 8, N, max_staleness=1, seed=0
    )
    idle = {"in_flight_tokens": 0.0, "free_groups": 4.0}
    for worker in range(1, 64):
        dispatcher.report(worker, [], idle)
    assert len(dispatcher.take(worker=0, want=4, worker_version=0).assignments) == 4


def test_a_dispatcher_restarted_in_place_continues_where_the_dead_one_stopped():
    """Rebuilt from its last journal and the groups handed out after it, a new process
    hands out the prompts the dead one would have, under new group ids; in-flight groups
    are held again once their worker claims them, and those no worker claims (their
    worker died too) are dropped, their admission places given back."""
    env, _ = make_environment(EnvConfig(train_prompts=64))

    def start(book: Book) -> GroupDispatcher:
        stream = PromptStream(env, 64, seed=0)
        return GroupDispatcher(book, stream, env.name, B, N, 3, 0, long_first=False, balance=False)

    book, twin = Book(), Book()
    dead, alive = start(book), start(twin)  # `alive` shows what the dead one would do
    for d in (dead, alive):
        first = d.take(0, 3, 0).assignments
        second = d.take(1, 2, 0).assignments
        done = GroupDone(first[0].group_id, "p", 1, [1] * N, 0, 0, 0, 0)
        d.report(0, [done], {"in_flight_tokens": 0.0, "free_groups": 0.0})
    held_by_1 = {a.group_id: a.problem for a in second}
    put = first[0]  # its rows reached the store before the report
    book.record([LedgerEvent(f"{put.group_id}/{j}", "p", "scored") for j in range(N)])

    new = start(book)
    new.recover(book.recovery())
    assert new.admitted == dead.admitted == 5 and new.incarnation > dead.incarnation
    assert "5 groups handed out so far, 4 in flight" in new.restored
    after = new.take(2, 3, 0)
    expected = alive.take(2, 3, 0).assignments
    assert [a.problem.prompt_id for a in after.assignments] == [
        a.problem.prompt_id for a in expected
    ]
    assert after.incarnation == new.incarnation
    assert {a.group_id.split("@")[1] for a in after.assignments} == {"d1.g5", "d1.g6", "d1.g7"}

    new.reclaim(1, held_by_1)  # worker 1 saw the new process answer; worker 0 died
    assert new.settle() == 2  # worker 0's two unfinished groups
    dropped = {e.sample_id.rpartition("/")[0] for e in book.events if e.event == "dropped"}
    assert dropped == {a.group_id for a in first[1:]}
    assert new.admitted == 5 + 3 - 2
    assert new.requeue(1) == 2  # worker 1's groups are held again: its death requeues them


def test_a_checkpoint_collects_the_groups_in_flight_from_the_workers_holding_them(dispatcher):
    """Only workers that hold groups owe them; each is told so by its report's answer, and
    groups handed over between workers count too."""
    mine = dispatcher.take(0, 2, 0).assignments
    dispatcher.take(1, 0, 0)  # holds nothing
    snapshot = dispatcher.snapshot()
    assert dispatcher.in_flight(snapshot) == ([], [0])
    idle = {"in_flight_tokens": 0.0, "free_groups": 0.0}
    assert dispatcher.report(0, [], idle).keep == snapshot
    assert dispatcher.report(1, [], idle).keep == 0
    dispatcher.keep(0, snapshot - 1, [_handoff(mine[0])])  # an older snapshot's answer: ignored
    assert dispatcher.in_flight(snapshot)[1] == [0]
    dispatcher.keep(0, snapshot, [_handoff(a) for a in mine])
    groups, owed = dispatcher.in_flight(snapshot)
    assert owed == [] and [h.group_id for h in groups] == [a.group_id for a in mine]
    assert dispatcher.report(0, [], idle).keep == 0  # sent: not asked again
    assert dispatcher.in_flight(snapshot - 1) == ([], [])


def test_a_resumed_run_continues_kept_groups_under_new_ids_before_fresh_ones():
    """Kept groups go first, within the admission window like any group, under new ids
    given as they are handed out; the prompt of one too stale to continue is drawn again."""
    env, _ = make_environment(EnvConfig(train_prompts=64))
    old = GroupDispatcher(Book(), PromptStream(env, 64, seed=0), env.name, B, N, 1, 0)
    kept = [_handoff(a) for a in old.take(0, 3, 0).assignments]
    stale = old.take(0, 1, 0).assignments  # (admission allows 2 * B = 4)

    book = Book()
    resumed = GroupDispatcher(book, PromptStream(env, 64, seed=0), env.name, B, N, 1, 0)
    resumed.restart_at({"prompts": old._prompts.cursor(), "issued": 4}, 0, "a1.")
    resumed.carry_on(kept, [stale[0].problem])
    assert resumed.admitted == 0 and book.events == []  # not handed out yet
    first = resumed.take(1, 2, 0)
    ids = [f"{h.group.problem.prompt_id}@a1.g{4 + i}" for i, h in enumerate(kept)]
    assert [h.group_id for h in first.handoffs] == ids[:2] and first.assignments == []
    assert all(s.group == h.group_id for h in first.handoffs for s in h.group.samples)
    assert [s.token_ids for s in first.handoffs[0].group.samples] == [[1, 2, 3]] * N
    dispatched = [e.sample_id for e in book.events if e.event == "dispatched"]
    assert dispatched == [f"{g}/{j}" for g in ids[:2] for j in range(N)]
    # the last kept group, then the too-stale prompt drawn again, as admission allows
    second = resumed.take(1, 4, 0)
    assert [h.group_id for h in second.handoffs] == ids[2:]
    assert [a.problem.prompt_id for a in second.assignments] == [stale[0].problem.prompt_id]
    assert resumed.admitted == 2 * B and resumed.take(1, 4, 0).handoffs == []
    assert resumed.requeue(1) == 4  # held like any other group


def test_kept_groups_not_handed_out_yet_survive_a_restart_in_place_and_a_checkpoint():
    env, _ = make_environment(EnvConfig(train_prompts=64))
    book = Book()
    first = GroupDispatcher(book, PromptStream(env, 64, seed=0), env.name, B, N, 1, 0)
    kept = [_handoff(a) for a in first.take(0, 2, 0).assignments]
    d = GroupDispatcher(book, PromptStream(env, 64, seed=0), env.name, B, N, 1, 0)
    d.carry_on(kept, [])
    restarted = GroupDispatcher(book, PromptStream(env, 64, seed=0), env.name, B, N, 1, 0)
    restarted.recover(book.recovery())
    work = restarted.take(0, 4, 0)
    assert [h.group.problem for h in work.handoffs] == [h.group.problem for h in kept]
    # Their prompts are in a checkpoint's cursor until they are handed out.
    d.take(0, 1, 0)
    assert kept[1].group.problem.prompt_id in d.cursor()["pool"][0]
