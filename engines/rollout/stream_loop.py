"""The stream loop of mode ``async``: one ``RolloutWorker.stream`` call, from its first
``take`` to the dispatcher's stop.

It keeps vLLM's running batch full with one request per sample, takes prompt groups from
the dispatcher as samples finish, scores each finished group (on a thread of its own when
the scorer is isolated user code), puts finished groups into the store in blocks
(``PUT_GROUPS``, ``PUT_EVERY_S``), reports them to the dispatcher once the store holds them,
and loads newer weights between engine steps when the parameter service has them, never
waiting on the trainer. With repack on, a worker whose batch has drained to a few stragglers
hands its unfinished groups over (``Handoff``); for a checkpoint it sends all of them as
they stand (``keep``), and a resumed run's are handed to it to go on with.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import ray

from sluice.engines.agents.episodes import AgentEpisodes
from sluice.engines.protocols import StreamingRolloutEngine
from sluice.engines.rollout.episodes import EpisodeSteps
from sluice.engines.rollout.messages import (
    GroupDone,
    Handoff,
    PartialGroup,
    PartialSample,
    RolloutStats,
    StreamSettings,
)
from sluice.engines.rollout.sample_runner import SampleRunner
from sluice.engines.rollout.scored import ScoredRows, block_of, score_groups
from sluice.envs import Environment, Problem
from sluice.envs.multi_turn import EpisodeLimits
from sluice.envs.scoring import RecordedScorer, Scorer
from sluice.rl.dispatch import InFlight
from sluice.storage.block_builder import VersionRuns
from sluice.storage.params import (
    ParameterService,
    PendingPull,
    PullFailed,
    Weights,
    digest_number,
)
from sluice.storage.trajectory_store import StoreClient

log = logging.getLogger(__name__)

# How often a worker that needs a version asks the relay again.
RELAY_POLL_S = 0.005
RowsAndStats = tuple[ScoredRows, RolloutStats]
# A streaming worker puts finished groups into the store in blocks of up to PUT_GROUPS, and
# never holds one back longer than PUT_EVERY_S: one store call per group cost ~10% of a
# worker's time, and with blocks of one or two groups (a group finishes every ~40 ms here)
# still ~5%, while the trainer only ever waits for whole batches.
PUT_GROUPS = 8
PUT_EVERY_S = 0.25
# A streaming worker asks the dispatcher for more groups once this share of its running
# batch is free (or when nothing is running).
REFILL_AT = 0.25


def _as_reported(group: PartialGroup) -> PartialGroup:
    """``group`` cut back to the tokens ``step`` has reported: a version mark taken from
    ``generated`` may lie past them, and the worker that continues the group regenerates
    the rest."""
    samples = [
        replace(s, marks=[(min(first, len(s.token_ids)), v) for first, v in s.marks])
        for s in group.samples
    ]
    return replace(group, samples=samples)


class StreamHost(Protocol):
    """What a stream uses of the rollout worker that runs it (``RolloutWorker``)."""

    engine: StreamingRolloutEngine
    episodes: EpisodeSteps | None
    limits: EpisodeLimits
    stream_counters: dict[str, float]
    agents: AgentEpisodes | None
    env: Environment
    scorer: Scorer
    scoring: ThreadPoolExecutor | None
    served_digest: str

    @property
    def store(self) -> StoreClient: ...

    def load(self, weights: Weights) -> None: ...

    @property
    def params(self) -> ParameterService: ...


class GroupSource(Protocol):
    """Where a streaming worker gets work: the dispatcher's actor handle
    (``engines/rollout/dispatcher.py``). ``take`` answers a ``messages.Work`` (or None: stop),
    ``report`` takes finished groups and counters, ``hand_over`` a repacked worker's groups,
    ``reclaim`` the groups a worker holds (to a dispatcher restarted in place), ``keep`` its
    groups in flight for a checkpoint."""

    take: Any
    report: Any
    hand_over: Any
    reclaim: Any
    keep: Any


class StreamLoop(SampleRunner):
    """The state of one ``stream`` call; a class so the loop reads as its steps."""

    def __init__(self, worker: StreamHost, source: GroupSource, settings: StreamSettings) -> None:
        super().__init__(
            worker.engine,
            worker.episodes,
            worker.limits,
            settings.max_new_tokens,
            settings.temperature,
            worker.stream_counters,
            worker.agents,
        )
        self.env, self.scorer, self.store, self.params = (
            worker.env,
            worker.scorer,
            worker.store,
            worker.params,
        )
        self.source, self.s = source, settings
        self.scoring = worker.scoring
        self.host = worker  # loads the weights and keeps what it serves
        # Finished groups whose scores are being computed on ``scoring``.
        self.being_scored: list[tuple[str, PartialGroup, Future[RowsAndStats]]] = []
        self.reports: list[GroupDone] = []  # groups the store took, to report
        self.unsent: list[ScoredRows] = []  # finished groups not yet in the store
        self.unsent_done: list[GroupDone] = []  # their reports
        # Reports of groups put but maybe not taken yet, by put number: a group is reported
        # done only once the store holds its rows. Reported sooner, a worker dying with the
        # put in flight would lose them unrecorded (the dispatcher no longer holds them).
        self.unsettled: list[tuple[int, list[GroupDone]]] = []
        # Finished groups until the store has taken their rows (a checkpoint keeps them).
        self.unstored: dict[str, PartialGroup] = {}
        self.unsent_since = 0.0
        self.stopping = False
        self.newer: Weights | None = None  # pulled, not loaded yet
        self.next_check = self.next_report = 0.0
        self.report_every_s = settings.report_every_s  # the dispatcher may ask for less often
        self.asked: ray.ObjectRef | None = None  # a `take` sent, not yet answered
        # Admission held this worker back until it holds this version (or a report's
        # answer says to ask again): no take is sent before.
        self.held_until: int | None = None
        self.reported: ray.ObjectRef | None = None  # the last report, its answer unread
        self.weights_asked: PendingPull | None = None  # a relay asked, not yet answered
        # The prompt of every group this worker holds until it is reported, and the
        # dispatcher's process that answered last: a new one is told what it holds.
        self.problems: dict[str, Problem] = {}
        self.dispatcher_at = 0
        # The checkpoint snapshot of groups in flight the dispatcher asks for, and the last
        # one this worker sent (``keep``).
        self.keep_asked = self.kept = 0

    def loop(self) -> dict[str, float]:
        try:
            return self._loop()
        except BaseException:
            self.abandon()
            raise

    def _loop(self) -> dict[str, float]:
        while True:
            now = time.monotonic()
            if self.weights_asked is not None or now >= self.next_check:
                self.check_weights()
            if not self.stopping and self.newer is None:
                self.refill()
            self.take_scored()
            self.poll()
            if self.keep_asked > self.kept:
                self.keep()
            if not self.decoding():
                if self.newer is not None:
                    self.load_newer()
                    continue
                if self.stopping and not self.groups and not self.being_scored:
                    break
                if self.being_scored:  # nothing to decode: wait for a score
                    futures = [future for _, _, future in self.being_scored]
                    wait(futures, timeout=RELAY_POLL_S, return_when=FIRST_COMPLETED)
                elif self.waiting():  # or for an environment or an agent
                    self.wait(RELAY_POLL_S)
                else:
                    time.sleep(RELAY_POLL_S)  # admission holds us back: idle
                self.counters["idle_s"] += time.monotonic() - now
            else:
                for delta in self.engine.step():
                    self.advance(delta)
                self.counters["busy_s"] += time.monotonic() - now
            if self.unsent and (
                len(self.unsent) >= PUT_GROUPS or time.monotonic() - self.unsent_since > PUT_EVERY_S
            ):
                self.send()
            if time.monotonic() >= self.next_report:
                self.report()
        self.send()
        self.store.flush()
        self.report(last=True)
        assert self.reported is not None  # the last report always goes
        ray.get(self.reported)  # the dispatcher has every group before the stream returns
        return dict(self.counters)

    def check_weights(self) -> None:
        """Ask the parameter service for a newer version; load it once answered.

        Like ``refill``, the question is sent ahead and its answer read when it is there,
        so a running batch never waits for the relay (those waits cost ~1% of a worker).
        """
        started = time.monotonic()
        if self.weights_asked is None:
            after = max(self.engine.version(), self.newer.version if self.newer else -1)
            self.weights_asked = self.params.ask(after)
            self.next_check = started + self.s.weight_check_s
        if self.running and not self.weights_asked.answered():
            return
        asked, self.weights_asked = self.weights_asked, None
        found = self.params.collect(asked, timeout=self.s.pull_timeout_s)
        self.counters["pull_s"] += time.monotonic() - started
        if found is not None:
            self.newer = found
        if self.newer is not None and (self.s.partial_rollout or not self.running):
            self.load_newer()

    def load_newer(self) -> None:
        assert self.newer is not None
        version = self.newer.version
        try:
            self.host.load(self.newer)
        except PullFailed as err:
            # Nothing of it reached the engine: go on with the weights it has, and take the
            # newest version at the next check (a relay keeps one: a slow pull can find the
            # version it was answered gone).
            log.warning("rollout worker %d skips version %d: %s", self.s.worker, version, err)
            self.newer = None
            self.counters["weight_pull_failures"] += 1
            return
        self.newer = None  # the version may go from the object store once the relay drops it
        self.counters["weight_loads"] += 1
        for request, sample in self.running.items():  # tokens from here on: `version`
            generated = self.engine.generated(request)  # counted from the request's start
            sample.marks.append(
                (len(sample.token_ids) if generated is None else sample.offset + generated, version)
            )

    def refill(self) -> None:
        """Ask the dispatcher for groups once there is room, and start what it sends.

        The ask is sent ahead and read once answered: while samples are running the worker
        goes on stepping instead of waiting for the dispatcher, which on a busy machine must
        first be scheduled (the waits cost ~1% of a worker on 2 cores).
        """
        n = self.s.samples_per_prompt
        if self.asked is None:
            # Episodes waiting for their environment leave the running batch to others,
            # up to as many again.
            waiting = max(0, len(self.stepping) - self.s.concurrency)
            busy = len(self.agents.runs) if self.agents is not None else len(self.running)
            room = (self.s.concurrency - busy - waiting) // n
            # Ask in chunks: an actor call per finished group cost ~5% of the worker.
            if room <= 0 or (self.running and room * n < REFILL_AT * self.s.concurrency):
                return
            if self.held_until is not None and not self.may_ask_again():
                return
            stragglers = None
            if 0 < len(self.running) <= self.s.repack_max_stragglers:
                stragglers = [
                    InFlight(request, s.group, s.started_at, len(s.token_ids), s.predicted)
                    for request, s in self.running.items()
                ]
            self.asked = self.source.take.remote(
                self.s.worker, room, self.engine.version(), stragglers
            )
        if self.running and not ray.wait([self.asked], timeout=0)[0]:
            return  # not answered yet: keep generating
        self.take_answer()

    def take_answer(self) -> None:
        """Start what the dispatcher's answer to the last ``take`` holds."""
        assert self.asked is not None
        n = self.s.samples_per_prompt
        work, self.asked = ray.get(self.asked), None
        if work is None:
            self.stopping = True
            return
        self.answered_by(work.incarnation)
        self.held_until = work.held_until
        if work.give_to is not None:
            self.give_up(work.give_to)
        for handoff in work.handoffs:  # repacked onto this worker, or kept across a resume
            group_id, group = handoff.group_id, handoff.group
            self.groups[group_id] = group
            self.problems[group_id] = group.problem
            if all(sample.done is not None for sample in group.samples):
                del self.groups[group_id]  # done but not scored when it was kept
                self.finish(group_id, group)
            for sample in group.samples:
                if sample.done is None:
                    self.go_on(group_id, group, sample)
        for a in work.assignments:
            ids = self.engine.prompt_ids([a.problem.prompt])[0]
            started = time.time()
            samples = [PartialSample(a.group_id, j, a.predicted, started) for j in range(n)]
            group = PartialGroup(a.problem, ids, samples, a.seed)
            self.groups[a.group_id] = group
            self.problems[a.group_id] = a.problem
            for sample in group.samples:
                self.begin(a.group_id, group, sample)

    def answered_by(self, incarnation: int) -> None:
        """A dispatcher restarted in place answered: tell it which groups this worker holds."""
        if incarnation != self.dispatcher_at and self.dispatcher_at:
            ray.get(self.source.reclaim.remote(self.s.worker, dict(self.problems)))
        self.dispatcher_at = incarnation or self.dispatcher_at

    def may_ask_again(self) -> bool:
        """Held back: ask again once this worker holds the version admission waits for, or
        once the answer to its last report says to."""
        assert self.held_until is not None
        return self.engine.version() >= self.held_until or self.read_reply()

    def read_reply(self) -> bool:
        """The answer to the last report, once it is there: take its pace; True if it says
        to ask for work now."""
        if self.reported is None or not ray.wait([self.reported], timeout=0)[0]:
            return False
        reply, self.reported = ray.get(self.reported), None
        self.answered_by(reply.incarnation)
        self.keep_asked = max(self.keep_asked, reply.keep)
        self.report_every_s = max(self.s.report_every_s, reply.report_every_s)
        return bool(reply.ask)

    def give_up(self, target: int) -> None:
        """Repack: hand every unfinished group to worker ``target``, as the dispatcher
        planned, and drop their requests here; this worker is then free for fresh work."""
        waiting = {group_id for _, group_id, _ in self.stepping}  # they stay here
        if self.agents is not None:
            waiting |= {group_id for _, group_id, _, _ in self.agents.runs}
        handoffs = [
            Handoff(group_id, _as_reported(group))
            for group_id, group in self.groups.items()
            if group_id not in waiting
        ]
        if not ray.get(self.source.hand_over.remote(self.s.worker, target, handoffs)):
            return  # the dispatcher stopped or the target is gone: keep them
        moved = {h.group_id for h in handoffs}
        requests = [r for r, sample in self.running.items() if sample.group in moved]
        self.engine.abort(requests)
        for request in requests:
            del self.running[request]
        for group_id in moved:
            del self.groups[group_id]
            del self.problems[group_id]

    def keep(self) -> None:
        """A checkpoint asks for this worker's groups in flight: every group whose rows
        are not in storage yet goes to the dispatcher as it stands (``Handoff``), finished
        ones whose puts the store has not taken included, and the rows it has taken are
        written. Nothing here waits for the store: it may be full while the trainer
        checkpoints. A resume continues only the groups of which nothing was stored. An
        agent's episodes are not kept: their state lives in the agent's process."""
        if self.asked is not None:  # the answer to a take may hold groups: start them first
            self.take_answer()
        self.take_settled()
        self.store.write_settled()
        agents = {group_id for _, group_id, _, _ in self.agents.runs} if self.agents else set()
        held = [(g, group) for g, group in self.groups.items() if g not in agents]
        held += [(g, group) for g, group, _ in self.being_scored]
        held += list(self.unstored.items())
        groups = [Handoff(group_id, _as_reported(group)) for group_id, group in held]
        self.source.keep.remote(self.s.worker, self.keep_asked, groups)
        self.kept = self.keep_asked

    def finish(self, group_id: str, group: PartialGroup) -> None:
        """Score a group whose samples are all done: here, or on the scoring thread."""
        completions = [s.done for s in group.samples if s.done is not None]
        marks: list[VersionRuns] = [s.marks for s in group.samples]
        episodes = [s.result for s in group.samples if s.result is not None]
        recorded = len(episodes) == len(group.samples)  # a multi-turn env gave the verdicts
        score = partial(
            score_groups,
            RecordedScorer([episodes]) if recorded else self.scorer,
            self.env.name,
            [group.problem],
            [group.prompt_ids],
            [completions],
            [marks],
            [group_id],
            self.s.credit,
            [[s.mask for s in group.samples]],
            [[s.prompt_ids for s in group.samples]],
        )
        if self.scoring is None or recorded:
            self.scored(group_id, group, score())
        else:
            self.being_scored.append((group_id, group, self.scoring.submit(score)))

    def take_scored(self) -> None:
        """Move the groups whose scores are in to the unsent ones, in the order they were
        finished: a group whose reward is slow holds back no other."""
        if not any(future.done() for _, _, future in self.being_scored):
            return
        still = []
        for group_id, group, future in self.being_scored:
            if future.done():
                self.scored(group_id, group, future.result())
            else:
                still.append((group_id, group, future))
        self.being_scored = still

    def scored(
        self, group_id: str, group: PartialGroup, scored: tuple[ScoredRows, RolloutStats]
    ) -> None:
        rows, stats = scored
        if not self.unsent:
            self.unsent_since = time.monotonic()
        self.unsent.append(rows)
        self.unstored[group_id] = group
        self.unsent_done.append(
            GroupDone(
                group_id=group_id,
                prompt_id=group.problem.prompt_id,
                prompt_len=len(group.problem.prompt),
                lengths=[len(s.token_ids) for s in group.samples],
                reward_sum=stats.reward_sum,
                correct=stats.correct,
                truncated=stats.truncated,
                reward_errors=stats.reward_errors,
                reward_metrics=stats.reward_metrics,
                reward_messages=stats.reward_messages,
            )
        )

    def send(self) -> None:
        """Put the finished groups into the store as one block."""
        if self.unsent:
            number = self.store.put(block_of(self.unsent))
            self.unsettled.append((number, self.unsent_done))
            self.unsent, self.unsent_done = [], []

    def take_settled(self) -> None:
        """Move the reports of groups the store has taken to ``reports``."""
        self.store.settle_answered()
        while self.unsettled and self.unsettled[0][0] <= self.store.settled:
            taken = self.unsettled.pop(0)[1]
            self.reports.extend(taken)
            for done in taken:
                self.unstored.pop(done.group_id, None)

    def report(self, last: bool = False) -> None:
        """Finished groups and counters to the dispatcher, one report at a time: while the
        dispatcher has not taken the last one, the groups wait for the next (a saturated
        dispatcher would otherwise queue reports without bound: 395 a second at 512 workers
        of ``benchmarks/control_plane.py`` against its pace of 100). The stream's ``last``
        report goes regardless."""
        self.next_report = time.monotonic() + self.report_every_s
        if not last and self.reported is not None and not ray.wait([self.reported], timeout=0)[0]:
            return
        self.take_settled()
        in_flight = sum(max(0.0, s.predicted - len(s.token_ids)) for s in self.running.values())
        counters = {
            **self.counters,
            "version": float(self.engine.version()),
            "weights_digest": digest_number(self.host.served_digest),  # the driver checks it
            "pid": float(os.getpid()),  # the flow notices a restarted worker by it
            "in_flight_tokens": float(in_flight),
            "free_groups": float(
                max(0, self.s.concurrency - len(self.running)) // self.s.samples_per_prompt
            ),
        }
        if self.read_reply():
            self.held_until = None
        self.reported = self.source.report.remote(self.s.worker, self.reports, counters)
        for done in self.reports:
            self.problems.pop(done.group_id, None)
        self.reports = []
