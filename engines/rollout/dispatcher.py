"""The dispatcher: hands prompt groups to streaming rollout workers, within the staleness bound.

A zero-CPU Ray actor, created by the flow's session in ``async`` mode and asked by each
rollout worker (``engines/rollout/worker.py: stream``) for more groups whenever the worker
has room; the flow reaches it through ``DispatcherClient``. The messages it exchanges are
in ``engines/rollout/messages.py``.

- Admission control (AReaL's rule, arXiv 2505.24298 section 5.1): group number g (in issue
  order) is trained at trainer version about g // B (B groups per step); a worker holding
  version v may only start it while ``g < (v + max_staleness + 1) * B``, so generation
  never runs further ahead of training than the bound allows. The store drops whatever
  still ends up staler (counted and recorded in the ledger).
- Skew-aware dispatch (StreamRL, arXiv 2504.15930): an online length predictor
  (``rl.dispatch.LengthPredictor``) learns response lengths per prompt and environment;
  a look-ahead pool of upcoming groups is handed out longest first, and with ``balance``
  the predicted tokens are spread across workers (``rl.dispatch.plan``).
- Repack (Laminar, arXiv 2510.12633): a worker whose batch has drained to a few
  stragglers sends them with each ``take``. When admission gives it no fresh group and at
  least two workers on its version straggle (``rl.dispatch.stragglers``), a worker the
  plan moves is told to hand its unfinished groups to the plan's target (``Work.give_to``,
  then ``hand_over``); the target gets them with its next ``take`` and continues each
  sample from its tokens. The mover is then free: it loads newer weights at once, even
  without partial rollout, and takes fresh groups as soon as admission allows.
- Held workers do not poll: a ``take`` admission answers empty says from which weight
  version the worker may start a group (``Work.held_until``), and the worker asks again
  once it holds that version or once a report's answer says to (a credit or a requeue
  opened the window, groups were repacked onto it, the plan moves it, or the run stops).
- Workers report finished groups (lengths, rewards) and their counters; the flow reads
  them once per step with ``drain``. Reports are paced to ``REPORTS_PER_S`` for the whole
  fleet (each answer says when to report next), so their cost does not grow with it.
- Failure isolation: the dispatcher knows which groups each worker holds. When a worker
  dies, ``requeue`` puts its unfinished groups back at the front of the queue (under new
  group ids) and takes them out of the admission count, so nothing it held is lost and
  the admission window does not shrink. Groups the store drops as too stale are credited
  back the same way (``credit``).
- Exactly once from dispatch: every sample of a group it hands out is in the ledger from
  that moment (``dispatched``, sent to the trajectory store, which keeps the ledger); a
  dead worker's groups are recorded ``dropped`` with the reason before their prompts go
  back to the queue, so every dispatched sample ends trained or dropped.
- Restart in place: whenever its prompt stream, queue or counters change other than by
  handing out groups (it draws prompts, requeues, is credited, stops or resumes, moves
  groups), it sends its state to the trajectory store with its ledger events, in order
  (``journal``). Ray restarts a dispatcher whose process died
  (``rollout.dispatcher_restarts``) and retries the calls on their way to it; the new process
  takes the last journal, counts the groups handed out after it and takes their prompts
  out of its queue (``recover``), so no prompt is handed out twice and no group id
  reused. Each answer names the process (``incarnation``); a worker that sees a new one
  tells it which groups it holds (``reclaim``). Groups in flight that no worker claims
  by the end of the next ``stop`` belonged to a worker that died meanwhile: they are
  recorded dropped and their admission places given back (``settle``).
- Rollouts in flight across a resume (``engines/rollout/in_flight.py``): for a checkpoint,
  ``snapshot`` asks every worker holding groups to send them as they stand (its next
  report's answer says so; it sends them with ``keep``), and ``in_flight`` answers them;
  a run resumed from that checkpoint gives them to ``carry_on``, which hands them out
  under new ids before any fresh group, within the same admission.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import ray

from sluice.config.tree import RunConfig
from sluice.engines.cluster.ray_cluster import on_driver_node
from sluice.engines.rollout.in_flight import problem_from_json, problem_json
from sluice.engines.rollout.messages import (
    Assignment,
    GroupDone,
    Handoff,
    PartialGroup,
    ReportReply,
    RolloutTotals,
    Work,
)
from sluice.envs import Problem
from sluice.envs.prompts import PromptSource
from sluice.rl.dispatch import GroupRequest, InFlight, LengthPredictor, WorkerLoad, plan, stragglers
from sluice.storage.faults import fault_point
from sluice.storage.ledger import LedgerEvent
from sluice.storage.trajectory_store import DispatchRecovery


class LedgerSink(Protocol):
    """Where the dispatcher's ledger events go: the trajectory store (``StoreClient``)."""

    def record(self, events: list[LedgerEvent], wait: bool = True) -> None:
        """Events in order; ``wait=False``: the sink may still be taking them on return."""

    def settle_records(self) -> None:
        """Wait until the sink has every event recorded so far."""

    def journal(self, state: dict[str, Any]) -> None:
        """Keep the dispatcher's state, in order with its events (``GroupDispatcher.journal``)."""

    def recovery(self) -> DispatchRecovery | None:
        """What a restarted dispatcher rebuilds from; None before any journal."""


# Groups kept ready for ordering: enough for a couple of steps, so "longest first" has
# something to choose from without running far ahead of the prompt stream.
LOOKAHEAD_STEPS = 2
# Reports the whole fleet sends a second, at most: a worker reports every
# max(StreamSettings.report_every_s, workers / REPORTS_PER_S) seconds. A report costs the
# dispatcher ~0.7 ms of CPU on these machines (BENCHMARKS.md, control plane), so reports
# keep it under a tenth of a core at any fleet size.
REPORTS_PER_S = 100.0


class GroupDispatcher:
    """The dispatcher's logic; ``Dispatcher`` is the same class as a Ray actor."""

    def __init__(
        self,
        ledger: LedgerSink,
        prompts: PromptSource,
        env: str,
        groups_per_step: int,
        samples_per_prompt: int,
        max_staleness: int,
        seed: int,
        long_first: bool = True,
        balance: bool = True,
        prior_length: float = 32.0,
        repack_max_stragglers: int = 0,
        repack_min_age_s: float = 1.0,
    ) -> None:
        self._ledger = ledger
        self._prompts = prompts
        self._env = env
        self._per_step = groups_per_step
        self._n = samples_per_prompt
        self._k = max_staleness
        self._seed = seed
        self._long_first = long_first
        self._balance = balance
        self._predictor = LengthPredictor(prior=prior_length)
        self._pool: list[Problem] = []
        self._issued = 0  # group ids handed out so far (ids are never reused)
        self._returned = 0  # issued groups that came back unfinished (requeue, restart)
        self._tag = ""  # a resumed run's group ids differ from the rolled-back run's
        self._held: dict[int, dict[str, Problem]] = {}  # worker -> its unfinished groups
        self._stopped = False
        self._workers: dict[int, dict[str, float]] = {}
        self._totals = RolloutTotals()
        self._repack = (repack_max_stragglers, repack_min_age_s)  # max 0: off
        # worker -> (its version, its running samples) as of its last take, while draining
        self._stragglers: dict[int, tuple[int, list[InFlight]]] = {}
        self._handoffs: dict[int, list[Handoff]] = {}  # worker -> groups repacked onto it
        # Groups a resumed run continues from a checkpoint, not handed out yet: fresh work
        # that goes first (``carry_on``).
        self._carried: list[PartialGroup] = []
        # A checkpoint's snapshot of the groups in flight: its number, the workers that
        # still owe their groups, and what each sent (``snapshot``, ``keep``, ``in_flight``).
        self._snapshot = 0
        self._owed: set[int] = set()
        self._kept: dict[int, list[Handoff]] = {}
        # Which process this is (each answer says), how many restarts came before it, and
        # the groups in flight it has not yet heard of from a worker (group id: prompt id).
        self.incarnation = time.time_ns()
        self._restarts = 0
        self._unclaimed: dict[str, str] = {}
        self.restored = ""  # what a restart in place rebuilt, for the flow to log
        if _restarted_actor():  # a process Ray restarts (``Dispatcher``) rebuilds its state
            self.recover(ledger.recovery())

    def _request(self, index: int, problem: Problem) -> GroupRequest:
        prompt_len = len(problem.prompt)
        return GroupRequest(
            group_id=str(index),  # the pool position: a prompt can be in the pool twice
            prompt_id=problem.prompt_id,
            env=self._env,
            prompt_len=prompt_len,
            samples=self._n,
            predicted=self._predictor.predict(problem.prompt_id, self._env, prompt_len),
        )

    def take(
        self,
        worker: int,
        want: int,
        worker_version: int,
        stragglers: list[InFlight] | None = None,
    ) -> Work | None:
        """Up to ``want`` fresh groups for ``worker`` (none while admission holds it back),
        any groups repacked onto it, and maybe a repack order; None: stop.

        ``stragglers``: the worker's running samples when only a few are left (repack
        plans with them); none while its batch is full.
        """
        fault_point("dispatcher.take")  # tests: the dispatcher dying as it hands out groups
        handoffs = self._handoffs.pop(worker, [])
        if handoffs:
            self.journal()
        if self._stopped:  # groups already handed over are finished, not lost
            return Work([], handoffs, incarnation=self.incarnation) if handoffs else None
        carried = self._carry(worker, want, worker_version)
        handoffs += carried
        out = self._fresh(worker, want - len(carried), worker_version)
        if stragglers and not out and not handoffs:
            self._stragglers[worker] = (worker_version, stragglers)
        else:
            self._stragglers.pop(worker, None)
        if out or handoffs:
            return Work(out, handoffs, incarnation=self.incarnation)
        give_to = self._repack_target(worker, worker_version)
        held_until = None if give_to is not None else self._open_at()
        return Work([], [], give_to, held_until, self.incarnation)

    def _allowed(self, worker_version: int) -> int:
        """Groups admission lets a worker holding ``worker_version`` start now."""
        return (worker_version + self._k + 1) * self._per_step - self.admitted

    def _carry(self, worker: int, want: int, worker_version: int) -> list[Handoff]:
        """Groups kept across a resume, handed out before any fresh group and within the
        same admission, under new ids."""
        count = min(want, self._allowed(worker_version), len(self._carried))
        if count <= 0:
            return []
        out = []
        for group in self._carried[:count]:
            group_id = f"{group.problem.prompt_id}@{self._tag}g{self._issued}"
            self._issued += 1
            for sample in group.samples:
                sample.group = group_id
            out.append(Handoff(group_id, group))
        del self._carried[:count]
        self._held.setdefault(worker, {}).update({h.group_id: h.group.problem for h in out})
        self._record({h.group_id: h.group.problem.prompt_id for h in out}, "dispatched")
        self.journal()
        return out

    def _fresh(self, worker: int, want: int, worker_version: int) -> list[Assignment]:
        count = min(want, self._allowed(worker_version))
        if count <= 0:
            return []
        loads = [
            WorkerLoad(w, c["in_flight_tokens"], int(c["free_groups"]) if self._balance else 0)
            for w, c in self._workers.items()
            if w != worker
        ] + [WorkerLoad(worker, self._load(worker), count)]
        # The plan fills every worker's reported room before the asker's (last, losing
        # ties), and only the asker's share is handed out: the pool must cover all of it.
        room = sum(load.capacity for load in loads)
        drawn = len(self._pool) < max(room, LOOKAHEAD_STEPS * self._per_step)
        while len(self._pool) < max(room, LOOKAHEAD_STEPS * self._per_step):
            self._pool.extend(self._prompts.take(self._per_step))
        if drawn:
            self.journal()  # the groups handed out from here on are "since" it
        requests = [self._request(i, p) for i, p in enumerate(self._pool)]
        chosen = plan(requests, loads, self._long_first, self._balance).assignments[worker]
        taken = {int(r.group_id) for r in chosen}
        picked = [(self._pool[int(r.group_id)], r.predicted) for r in chosen]
        self._pool = [p for i, p in enumerate(self._pool) if i not in taken]
        out = []
        held = self._held.setdefault(worker, {})
        for problem, predicted in picked:
            group_id = f"{problem.prompt_id}@{self._tag}g{self._issued}"
            out.append(
                Assignment(problem, group_id, self._seed * 1_000_003 + self._issued, predicted)
            )
            held[group_id] = problem
            self._issued += 1
        # In the ledger from this moment: a dispatched sample ends trained or dropped. The
        # take does not wait for the store to have the events (the next call to the store
        # does): they are stamped now, and the ledger is read in time order.
        self._record({a.group_id: a.problem.prompt_id for a in out}, "dispatched", wait=False)
        return out

    def _record(
        self, groups: dict[str, str], event: str, reason: str | None = None, wait: bool = True
    ) -> None:
        """One ledger event for each sample of each group (``{group id: prompt id}``)."""
        if groups:
            self._ledger.record(
                [
                    LedgerEvent(f"{group_id}/{j}", prompt_id, event, reason=reason)
                    for group_id, prompt_id in groups.items()
                    for j in range(self._n)
                ],
                wait=wait,
            )

    # -- restart in place --------------------------------------------------------------------

    def journal(self) -> None:
        """Send the state a restarted dispatcher rebuilds from (see the module docstring)."""
        self._ledger.journal(
            {
                "cursor": self._prompts.cursor(),
                "pool": list(self._pool),
                "issued": self._issued,
                "returned": self._returned,
                "tag": self._tag,
                "stopped": self._stopped,
                "handoffs": {w: list(h) for w, h in self._handoffs.items()},
                "carried": list(self._carried),
                "restarts": self._restarts,
            }
        )

    def recover(self, found: DispatchRecovery | None) -> None:
        """Rebuild after a restart in place from the last journal, the groups handed out
        after it and the groups in flight; new group ids get a tag of their own."""
        self._restarts = 1
        if found is not None:
            state = found.state
            self._prompts.restore(state["cursor"])
            self._pool = list(state["pool"])
            for prompt_id in found.since.values():  # handed out after the journal
                at = next((i for i, p in enumerate(self._pool) if p.prompt_id == prompt_id), None)
                if at is not None:
                    del self._pool[at]
            self._issued = int(state["issued"]) + len(found.since)
            self._returned = int(state["returned"])
            self._stopped = bool(state["stopped"])
            self._handoffs = {int(w): list(h) for w, h in state["handoffs"].items()}
            self._carried = list(state["carried"])
            self._restarts = int(state["restarts"]) + 1
            self._tag = str(state["tag"])
            moving = {h.group_id for handoffs in self._handoffs.values() for h in handoffs}
            self._unclaimed = {g: p for g, p in found.open.items() if g not in moving}
        self._tag += f"d{self._restarts}."
        self.restored = (
            f"the dispatcher restarted in place: {self._issued} groups handed out so far, "
            f"{len(self._unclaimed)} in flight await their rollout workers"
        )
        self.journal()

    def reclaim(self, worker: int, groups: dict[str, Problem]) -> None:
        """``worker`` holds ``groups`` (it saw this process answer for the first time)."""
        self._held.setdefault(worker, {}).update(groups)
        for group_id in groups:
            self._unclaimed.pop(group_id, None)

    def settle(self) -> int:
        """Groups in flight at a restart that no worker claimed by now (every stream has
        finished): their worker died meanwhile. Recorded dropped, their places given back;
        their prompts are not drawn again (the journal did not hold them). How many."""
        lost, self._unclaimed = self._unclaimed, {}
        reason = "the dispatcher restarted while its rollout worker died; no worker held it"
        self._record(lost, "dropped", reason)
        self._returned += len(lost)
        if lost:
            self.journal()
        return len(lost)

    def _open_at(self) -> int:
        """The lowest worker version admission lets start a group now: the least v with
        ``(v + max_staleness + 1) * groups_per_step > admitted``."""
        return self.admitted // self._per_step - self._k

    def _repack_target(self, worker: int, version: int) -> int | None:
        """Where ``worker`` should move its stragglers, if the repack plan moves them."""
        most, min_age = self._repack
        if not most or worker not in self._stragglers:
            return None
        # Only between workers on the same version: a moved sample keeps one policy's tokens.
        peers = {w: reqs for w, (v, reqs) in self._stragglers.items() if v == version}
        found = stragglers(peers, most, min_age, time.time())
        if found is None or worker not in found.moves:
            return None
        return found.target

    def hand_over(self, worker: int, target: int, handoffs: list[Handoff]) -> bool:
        """Repack: ``worker``'s unfinished groups move to ``target`` (its next ``take``).
        False, and nothing moves, once stopped or when ``target`` no longer straggles (it
        took fresh groups, or died)."""
        if self._stopped or target not in self._stragglers:
            return False
        held, theirs = self._held.get(worker, {}), self._held.setdefault(target, {})
        for h in handoffs:
            theirs[h.group_id] = held.pop(h.group_id)
        self._handoffs.setdefault(target, []).extend(handoffs)
        self._stragglers.pop(worker, None)  # out of date now: both ask again
        self._stragglers.pop(target, None)
        self._totals.repacked += len(handoffs)
        self.journal()
        return True

    @property
    def admitted(self) -> int:
        """Groups counted by admission control: issued, less those that came back."""
        return self._issued - self._returned

    def requeue(self, worker: int) -> int:
        """``worker`` died: its unfinished groups go back to the front of the queue."""
        lost = self._held.pop(worker, {})  # groups repacked onto it included
        self._record(
            {group_id: problem.prompt_id for group_id, problem in lost.items()},
            "dropped",
            f"rollout worker {worker} died before it finished the group; the prompt goes "
            "back to the queue",
        )
        self._pool[:0] = list(lost.values())
        self._returned += len(lost)
        self._workers.pop(worker, None)
        self._stragglers.pop(worker, None)
        self._handoffs.pop(worker, None)
        self.journal()
        return len(lost)

    def credit(self, groups: int) -> None:
        """``groups`` admitted groups were dropped by the store (too stale) and will never be
        trained: give their places in the admission window back, or every drop would
        narrow it for the rest of the run."""
        self._returned += groups
        self.journal()

    def restart_at(self, cursor: dict[str, Any], admitted: int, tag: str) -> None:
        """Continue a resumed run from a checkpoint's ``cursor``, with ``admitted`` groups
        counted (trained ones plus those the restored store re-offers), new ids tagged ``tag``.
        """
        self._prompts.restore(cursor["prompts"])
        self._pool = [problem_from_json(p) for p in cursor.get("pool", [])]
        self._issued = int(cursor["issued"])
        self._returned = self._issued - admitted
        self._tag = tag
        self.journal()

    def carry_on(self, groups: list[Handoff], again: list[Problem]) -> None:
        """A resumed run continues ``groups``, kept in flight at its checkpoint (their old
        ids were recorded dropped when the store restored): they are handed out first as
        admission allows, under new ids (``_carry``); the prompts ``again`` (kept groups
        too stale to continue) go to the front of the queue."""
        self._pool[:0] = again
        self._carried.extend(h.group for h in groups)
        self.journal()

    # -- a checkpoint's groups in flight ---------------------------------------------------

    def snapshot(self) -> int:
        """A checkpoint asks for the groups in flight: every worker holding groups is told
        to send them (``ReportReply.keep``, then ``keep``). The snapshot's number."""
        self._snapshot += 1
        self._owed = {w for w, held in self._held.items() if held}
        self._kept = {}
        return self._snapshot

    def keep(self, worker: int, snapshot: int, groups: list[Handoff]) -> None:
        """``worker``'s groups in flight, as it held them when snapshot ``snapshot`` asked."""
        if snapshot == self._snapshot:
            self._kept[worker] = groups
            self._owed.discard(worker)

    def in_flight(self, snapshot: int) -> tuple[list[Handoff], list[int]]:
        """The groups in flight the workers sent for ``snapshot`` with those on their way
        between workers (repack), and the workers that hold groups and have not sent them
        yet. Kept groups not handed out again yet are not among them: the cursor holds
        their prompts."""
        if snapshot != self._snapshot:
            return [], []
        groups = {
            h.group_id: h
            for handoffs in [*self._kept.values(), *self._handoffs.values()]
            for h in handoffs
        }
        return list(groups.values()), sorted(w for w in self._owed if self._held.get(w))

    def _load(self, worker: int) -> float:
        counters = self._workers.get(worker)
        return counters["in_flight_tokens"] if counters else 0.0

    def report(
        self, worker: int, groups: list[GroupDone], counters: dict[str, float]
    ) -> ReportReply:
        """Take a worker's finished groups and counters (its ``version`` among them); answer
        whether it should ``take`` now and when to report next."""
        held = self._held.get(worker, {})
        for g in groups:
            held.pop(g.group_id, None)
            self._unclaimed.pop(g.group_id, None)
            self._predictor.observe(g.prompt_id, self._env, g.prompt_len, g.lengths)
            t = self._totals
            t.groups += 1
            t.samples += len(g.lengths)
            t.tokens += sum(g.lengths)
            t.reward_sum += g.reward_sum
            t.correct += g.correct
            t.truncated += g.truncated
            t.reward_errors += g.reward_errors
            t.lengths.extend(g.lengths)
            t.add_reward_metrics(g.reward_metrics, g.reward_messages)
        self._workers[worker] = counters
        version = int(counters.get("version", -1))
        ask = (
            self._stopped
            or worker in self._handoffs
            or version >= self._open_at()
            or self._repack_target(worker, version) is not None
        )
        keep = self._snapshot if worker in self._owed else 0
        return ReportReply(ask, len(self._workers) / REPORTS_PER_S, self.incarnation, keep)

    def drain(self) -> dict[str, Any]:
        """Rollout totals since the last call, and each worker's latest counters; the store
        has every ledger event of the groups issued so far."""
        self._ledger.settle_records()
        totals, self._totals = self._totals, RolloutTotals()
        return {
            "totals": totals,
            "workers": dict(self._workers),
            "issued": self._issued,
            "incarnation": self.incarnation,
            "restored": self.restored,
        }

    def stop(self) -> None:
        """No more groups: workers finish what they hold and return."""
        self._stopped = True
        self.journal()
        self._ledger.settle_records()

    def resume(self) -> None:
        self._stopped = False
        self.journal()

    def cursor(self) -> dict[str, Any]:
        """Where the prompt stream stands, with the prompts drawn and not handed out yet
        (the look-ahead pool, a dead worker's requeued prompts, and those of groups kept
        across the last resume not yet handed out again), which a resume queues first."""
        self._ledger.settle_records()  # a checkpoint's ledger holds what it issued
        drawn = [problem_json(p) for p in [*(g.problem for g in self._carried), *self._pool]]
        return {
            "prompts": self._prompts.cursor(),
            "issued": self._issued,
            "pool": [p for p in drawn if p is not None],
        }


Dispatcher = ray.remote(num_cpus=0)(GroupDispatcher)


def _restarted_actor() -> bool:
    """Whether this runs in a Ray actor's process that Ray restarted."""
    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    return context.get_actor_id() is not None and context.was_current_actor_reconstructed


class DispatcherClient:
    """The dispatcher's actor handle, typed, for the flow; rollout workers hold ``handle``."""

    def __init__(self, handle: Any, args: list[Any] | None = None) -> None:
        self.handle = handle
        # Constructor arguments in the object store: Ray reads them again to restart the
        # dispatcher in place, so they live as long as it does.
        self.args = args or []

    def resume(self) -> None:
        ray.get(self.handle.resume.remote())

    def stop(self) -> None:
        ray.get(self.handle.stop.remote())

    def requeue(self, worker: int) -> int:
        return int(ray.get(self.handle.requeue.remote(worker)))

    def settle(self) -> int:
        return int(ray.get(self.handle.settle.remote()))

    def credit(self, groups: int) -> None:
        self.handle.credit.remote(groups)  # no answer needed: the next drain is behind it

    def drain(self) -> dict[str, Any]:
        return dict(ray.get(self.handle.drain.remote()))

    def cursor(self) -> dict[str, Any]:
        return dict(ray.get(self.handle.cursor.remote()))

    def restart_at(self, cursor: dict[str, Any], admitted: int, tag: str) -> None:
        ray.get(self.handle.restart_at.remote(cursor, admitted, tag))

    def carry_on(self, groups: list[Handoff], again: list[Problem]) -> None:
        ray.get(self.handle.carry_on.remote(groups, again))

    def snapshot(self) -> int:
        return int(ray.get(self.handle.snapshot.remote()))

    def in_flight(self, snapshot: int) -> tuple[list[Handoff], list[int]]:
        groups, owed = ray.get(self.handle.in_flight.remote(snapshot))
        return list(groups), list(owed)


def launch_dispatcher(
    cfg: RunConfig, ledger: LedgerSink, prompts: PromptSource, env: str
) -> DispatcherClient:
    """The dispatcher of an ``async`` run, on the driver's node (it holds the run's queue)."""
    r = cfg.rollout
    stream = ray.put(prompts)  # big (a data file's index): kept for restarts, see below
    handle = Dispatcher.options(
        scheduling_strategy=on_driver_node(),
        max_restarts=r.dispatcher_restarts,
        max_task_retries=-1 if r.dispatcher_restarts else 0,
    ).remote(
        ledger,
        stream,
        env,
        r.prompts_per_step,
        r.samples_per_prompt,
        cfg.max_staleness,
        cfg.seed,
        long_first=r.long_first,
        balance=r.balance,
        prior_length=float(r.max_new_tokens),
        repack_max_stragglers=r.repack_max_stragglers if r.repack else 0,
        repack_min_age_s=r.repack_min_age_s,
    )
    return DispatcherClient(handle, [stream])
