"""The rollout worker: a Ray actor holding a rollout engine (vLLM), a scorer (the
environment's verifier, or user code in a reward pool), a trajectory-store producer and a
parameter-service puller.

The flow's rollouts (``driver/rollouts.py``) drive it through ``RolloutWorkerClient``, in one
of two ways:
- ``rollout`` (modes ``sync`` and ``one_step``): generate n completions for each prompt of
  a batch with the weights it holds, score them with the environment's verifier, compute
  group-relative advantages and put the groups into the trajectory store as one Arrow
  block, every token tagged with the policy version; only counts come back.
  ``sync_weights`` then loads the version the flow names from the parameter service.
- ``stream`` (mode ``async``): run until told to stop, keeping vLLM's running batch full
  with one request per sample, taking prompt groups from the dispatcher as samples finish,
  putting finished groups into the store within ``PUT_EVERY_S``, and loading newer
  weights between engine steps when the parameter service has them, never waiting on the
  trainer. With repack on, a worker whose batch has drained to a few stragglers sends
  them when it asks for work, and the dispatcher may have it hand its unfinished groups
  to another straggling worker (``Handoff``), which continues each sample from the
  tokens it has.
Scoring here, next to the tokens, keeps trajectories off the driver. A stream scores
user code (an isolated scorer) on a thread of its own, so a slow or hung reward holds back
only its group, never the decoding of the others. Episodes (a multi-turn environment, or
an agent behind this worker's chat endpoint) run in both: ``rollout`` plays its batch's
episodes to their end, ``stream`` advances each on its own while the others decode;
``verdicts`` plays held-out ones.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any, Protocol

import pyarrow as pa
import ray
import torch
from ray import ObjectRef

from sluice.config.tree import LoraConfig, RolloutConfig
from sluice.engines.agents.episodes import AgentEpisodes, AgentSpec
from sluice.engines.cluster.ray_cluster import gpus_each, pool_dtype, thread_env, visible_gpus
from sluice.engines.protocols import Completion, StreamingRolloutEngine
from sluice.engines.rollout.episodes import EpisodeSteps, StepSpec
from sluice.engines.rollout.messages import (
    MESSAGES_KEPT,
    BatchShard,
    GroupDone,
    Handoff,
    PartialGroup,
    PartialSample,
    RolloutStats,
    StreamSettings,
)
from sluice.engines.rollout.sample_runner import Play, SampleRunner
from sluice.engines.rollout.vllm_engine import VLLMRolloutEngine
from sluice.envs import Environment, Problem, RewardResult
from sluice.envs.multi_turn import EpisodeLimits, is_multi_turn
from sluice.envs.scoring import RecordedScorer, Scorer, VerifierScorer
from sluice.rl.advantages import group_advantages
from sluice.rl.batching import Sample
from sluice.rl.dispatch import InFlight
from sluice.storage.block_builder import VersionRuns, trajectory_block
from sluice.storage.faults import fault_point
from sluice.storage.params import ParameterError, ParameterService, PendingPull, Weights
from sluice.storage.trajectory_store import StoreClient
from sluice.storage.urls import Credentials

# How often a worker that needs a version asks the relay again.
RELAY_POLL_S = 0.005
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


Scored = tuple[pa.RecordBatch, RolloutStats]


@dataclass
class ScoredRows:
    """Scored groups as rows not laid out yet: ``trajectory_block``'s per-row lists. A
    streaming worker scores each group as it finishes and builds one block per put
    (``block_of``): building a block per group cost it ~4% of its time, ~0.6% per batch."""

    env: str
    columns: dict[str, list[Any]]
    at: datetime


def block_of(parts: list[ScoredRows]) -> pa.RecordBatch:
    """One block of the rows of ``parts``, in order (stamped with the first part's time)."""
    columns = {name: [v for part in parts for v in part.columns[name]] for name in parts[0].columns}
    return trajectory_block(
        env=parts[0].env, status="scored", generated_at=parts[0].at, scored_at=parts[0].at,
        **columns,
    )  # fmt: skip


def score_groups(
    scorer: Scorer,
    env_name: str,
    problems: list[Problem],
    prompt_ids: list[list[int]],
    groups: list[list[Completion]],
    version_runs: list[list[VersionRuns]],
    group_ids: list[str],
    scale_by_std: bool,
    loss_masks: list[list[list[int] | None]] | None = None,
    sample_prompts: list[list[list[int] | None]] | None = None,
) -> tuple[ScoredRows, RolloutStats]:
    """Score every completion, compute GRPO advantages, and lay the groups out as rows.

    ``version_runs[g][j]`` gives the policy versions of completion j of group g as runs of
    ``(first token, version)``. Rows of one group are contiguous; sample ids are
    ``<group id>/<j>``. ``block_of`` builds the block column by column
    (``trajectory_block``); the store checks it against the schema when it is put. A sample
    whose reward failed keeps its reason in the row (the ledger records it) and gets
    advantage 0. ``loss_masks[g][j]`` marks the sampled tokens of a multi-turn episode
    (None: all of them); ``sample_prompts[g][j]`` is a sample's own prompt (an agent's;
    None: its group's).
    """
    results = scorer.score(
        problems,
        [[c.text for c in group] for group in groups],
        [[len(c.token_ids) for c in group] for group in groups],
    )
    rewards = torch.tensor([[r.reward for r in row] for row in results])
    valid = torch.tensor([[r.error is None for r in row] for row in results])
    advantages = group_advantages(rewards, scale_by_std=scale_by_std, valid=valid)
    # One entry per sample, group by group: (group index, sample index in its group).
    order = [(g, j) for g, group in enumerate(groups) for j in range(len(group))]
    completions = [groups[g][j] for g, j in order]
    flat_results = [results[g][j] for g, j in order]
    runs = [version_runs[g][j] for g, j in order]
    columns: dict[str, list[Any]] = {
        "sample_ids": [f"{group_ids[g]}/{j}" for g, j in order],
        "prompt_ids": [problems[g].prompt_id for g, _ in order],
        "group_ids": [group_ids[g] for g, _ in order],
        "prompts": [
            own if sample_prompts and (own := sample_prompts[g][j]) is not None else prompt_ids[g]
            for g, j in order
        ],
        "responses": [c.token_ids for c in completions],
        "logprobs": [c.logprobs for c in completions],
        "version_runs": runs,
        "rewards": [r.reward for r in flat_results],
        "advantages": [float(advantages[g, j]) for g, j in order],
        "reasons": [r.error for r in flat_results],
    }
    if loss_masks:
        columns["loss_masks"] = [loss_masks[g][j] for g, j in order]
    # The oldest version any response token has (a run starting past the end has none).
    oldest = min(
        (v for c, rs in zip(completions, runs, strict=True) for first, v in rs
         if first < len(c.token_ids)),
        default=0,
    )  # fmt: skip
    stats = RolloutStats(
        samples=len(completions),
        groups=len(groups),
        tokens=sum(len(c.token_ids) for c in completions),
        reward_sum=float(rewards.sum()),
        correct=sum(r.correct for r in flat_results),
        truncated=sum(not c.finished for c in completions),
        reward_errors=sum(r.error is not None for r in flat_results),
        behaviour_version=oldest,
        reward_metrics=_summed(r.metrics for r in flat_results),
        reward_messages=tuple(r.error for r in flat_results if r.error)[:MESSAGES_KEPT],
    )
    return ScoredRows(env_name, columns, datetime.now(UTC)), stats


def played_block(env_name: str, played: dict[str, PartialGroup], scale_by_std: bool) -> Scored:
    """Finished episodes as trajectory rows, with the verdicts their environment gave."""
    groups = list(played.values())
    rows, stats = score_groups(
        RecordedScorer([[s.result or RewardResult(0.0, False) for s in g.samples] for g in groups]),
        env_name,
        [g.problem for g in groups],
        [g.prompt_ids for g in groups],
        [[s.done for s in g.samples if s.done is not None] for g in groups],
        [[s.marks for s in g.samples] for g in groups],
        list(played),
        scale_by_std,
        [[s.mask for s in g.samples] for g in groups],
        [[s.prompt_ids for s in g.samples] for g in groups],
    )
    return block_of([rows]), stats


def _summed(metrics: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for one in metrics:
        for name, value in one.items():
            out[name] = out.get(name, 0.0) + value
    return out


class RolloutWorker:
    """A rollout engine held together with the environment, a store producer and a
    parameter-service puller; ``RolloutWorkerActor`` is the same class as a Ray actor.

    ``make_engine`` builds the engine once the process is set up (threads, credentials): in
    a run, vLLM (``engines/rollout/vllm_engine.py``); in tests, any ``StreamingRolloutEngine``.
    ``make_scorer`` builds the scorer (``envs/scoring.py``): the environment's verifier, or
    the user's reward functions in their own processes. A multi-turn environment's episodes
    run turn by turn (``engines/rollout/sample_runner.py``), its steps on ``episodes``; with an
    ``agent``, the agent plays each episode through this worker's chat endpoint
    (``engines/agents/episodes.py``).
    Without a store and parameter service a worker only ``generate``s (``sluice eval``).
    """

    def __init__(
        self,
        make_engine: Callable[[], StreamingRolloutEngine],
        env: Environment,
        make_scorer: Callable[[], Scorer],
        store: StoreClient | None,
        params: ParameterService | None,
        threads: int = 1,
        credentials: Credentials | None = None,
        limits: EpisodeLimits | None = None,
        agent: AgentSpec | None = None,
        steps: StepSpec | None = None,
    ) -> None:
        if credentials:
            credentials.apply()  # trajectory files under an s3:// url
        torch.set_num_threads(threads)
        self.engine = make_engine()
        self.scorer = make_scorer()
        # An isolated scorer waits on its processes: a stream scores on this thread while
        # the engine goes on decoding (one thread, so the pool has one caller at a time).
        self.scoring = (
            ThreadPoolExecutor(1, thread_name_prefix="score") if self.scorer.isolated else None
        )
        self.env, self._store, self._params = env, store, params
        self.limits = limits or EpisodeLimits()
        self.episodes: EpisodeSteps | None = None  # a multi-turn environment's steps
        if is_multi_turn(env):
            if steps is None:
                raise TypeError(
                    f"{env.name!r} is multi-turn: its steps run isolated, so the worker needs "
                    "its StepSpec (steps=)"
                )
            self.episodes = EpisodeSteps(steps, self.limits.step_timeout_s)
        # An agent plays each episode through this worker's chat endpoint.
        self.agents = None
        if agent is not None:
            tokenizer = getattr(self.engine, "tokenizer", None)
            if tokenizer is None:
                raise TypeError(f"{type(self.engine).__name__} has no tokenizer for the agent")
            self.agents = AgentEpisodes(agent, tokenizer, self.engine)
        # Running totals kept on the worker, so they survive a pause of the stream.
        self.stream_counters = {"busy_s": 0.0, "idle_s": 0.0, "pull_s": 0.0, "weight_loads": 0.0}

    @property
    def store(self) -> StoreClient:
        if self._store is None:
            raise RuntimeError("this rollout worker was started without a trajectory store")
        return self._store

    @property
    def params(self) -> ParameterService:
        if self._params is None:
            raise RuntimeError("this rollout worker was started without a parameter service")
        return self._params

    def pid(self) -> int:
        return os.getpid()

    def devices(self) -> str:
        return visible_gpus()

    def generate(
        self, prompts: list[str], n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> list[list[Completion]]:
        """Completions that come back to the caller (held-out evaluation), not to the store."""
        fault_point("worker.evaluate")  # tests: a worker that dies during an evaluation
        return self.engine.generate(prompts, n, max_new_tokens, temperature, seed)

    def sampled(
        self, prompts: list[str], max_new_tokens: int, temperature: float, seed: int, version: int
    ) -> list[Sample]:
        """One sampled completion of each prompt, with the engine's log-prob of each token,
        as the trainer reads samples: for comparing the two engines' log-probs of the same
        tokens at one version (``Session.logprob_check``). Nothing when this worker does not
        hold ``version`` (restarted since the last sync): its log-probs would be of other
        weights."""
        if self.engine.version() != version:
            return []
        ids = self.engine.prompt_ids(prompts)
        groups = self.engine.generate(prompts, 1, max_new_tokens, temperature, seed)
        return [
            Sample(list(prompt), c.token_ids, c.logprobs, 0.0)
            for prompt, group in zip(ids, groups, strict=True)
            for c in group
            if c.token_ids
        ]

    def play(
        self,
        problems: list[Problem],
        n: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        tag: str = "eval",
    ) -> dict[str, PartialGroup]:
        """Run ``n`` episodes of each problem to their end (a multi-turn environment's, or
        an agent's): the groups by id (``<prompt id>@<tag>.<its place in problems>``), each
        sample done with its verdict."""
        fault_point("worker.evaluate")  # tests: a worker that dies during an evaluation
        if self.episodes is None and self.agents is None:
            raise RuntimeError(f"environment {self.env.name!r} is not multi-turn, and no agent")
        groups = {}
        for i, (problem, ids) in enumerate(
            zip(problems, self.engine.prompt_ids([p.prompt for p in problems]), strict=True)
        ):
            group_id = f"{problem.prompt_id}@{tag}.{i}"  # a prompt may come twice
            samples = [PartialSample(group_id, j, 0.0, time.time()) for j in range(n)]
            groups[group_id] = PartialGroup(problem, ids, samples, seed + i)
        runner = Play(
            self.engine,
            self.episodes,
            self.limits,
            max_new_tokens,
            temperature,
            self.stream_counters,
            self.agents,
        )
        return runner.run(groups)

    def verdicts(
        self, problems: list[Problem], n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> list[list[RewardResult]]:
        """The verdicts of ``n`` episodes of each problem (held-out evaluation)."""
        played = self.play(problems, n, max_new_tokens, temperature, seed)
        return [[s.result or RewardResult(0.0, False) for s in g.samples] for g in played.values()]

    def rollout(self, problems: list[Problem], shard: BatchShard) -> RolloutStats:
        """Generate, score and put one shard of a batch (``sync``, ``one_step``)."""
        if self.engine.version() < shard.version:  # restarted since the last weight sync
            self.sync_weights(shard.version, shard.pull_timeout_s)
        if self.episodes is not None or self.agents is not None:
            before = dict(self.stream_counters)
            played = self.play(
                problems,
                shard.n,
                shard.max_new_tokens,
                shard.temperature,
                shard.seed,
                shard.tag,
            )
            block, stats = played_block(self.env.name, played, shard.scale_by_std)
            self.store.put(block)
            counts = {k: v - before.get(k, 0.0) for k, v in self.stream_counters.items()}
            return replace(stats, episode_counts=counts)
        prompts = [p.prompt for p in problems]
        groups = self.engine.generate(
            prompts, shard.n, shard.max_new_tokens, shard.temperature, shard.seed
        )
        version = self.engine.version()
        rows, stats = score_groups(
            self.scorer,
            self.env.name,
            problems,
            self.engine.prompt_ids(prompts),
            groups,
            [[[(0, version)] for _ in group] for group in groups],
            [f"{p.prompt_id}@{shard.tag}.{i}" for i, p in enumerate(problems)],
            shard.scale_by_std,
        )
        self.store.put(block_of([rows]))
        return stats

    def sync_weights(self, at_least: int = 0, timeout_s: float = 60.0) -> int:
        """Load the newest published version; returns the version now loaded.

        With ``at_least``, wait (up to ``timeout_s``) until the relay holds that version: a
        publish returns before the relay has taken the version, so a pull right behind it
        can still find the previous one.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            found = self.params.pull(after=self.engine.version(), timeout=max(left, 0.001))
            if found is not None:
                self.engine.load_weights(found, found.version)
                found = None  # the version may go from the object store once the relay drops it
            if self.engine.version() >= at_least:
                return self.engine.version()
            if left <= 0:
                raise ParameterError(
                    f"weight version {at_least} did not reach the parameter relay within "
                    f"{timeout_s:g} s (this worker holds version {self.engine.version()}); is "
                    "the trainer alive?"
                )
            time.sleep(RELAY_POLL_S)

    def stream(self, source: GroupSource, settings: StreamSettings) -> dict[str, float]:
        """Generate continuously until ``source`` says stop; returns this worker's totals.

        Keeps up to ``settings.concurrency`` samples in the engine's running batch, one
        request per sample, refilled from ``source`` as samples finish. A finished group is
        scored and gets its advantages; finished groups go to the store together, at the
        latest ``PUT_EVERY_S`` after the first of them finished. Between engine steps the
        worker checks the parameter service and loads a newer version when there is one:
        with ``partial_rollout`` the samples in flight continue under the new weights and
        their later tokens carry the new version; without it the worker stops taking new
        work until its running samples finish, then loads.
        """
        return _Stream(self, source, settings).loop()


RolloutWorkerActor = ray.remote(RolloutWorker)


class GroupSource(Protocol):
    """Where a streaming worker gets work: the dispatcher's actor handle
    (``engines/rollout/dispatcher.py``). ``take`` answers a ``messages.Work`` (or None: stop),
    ``report`` takes finished groups and counters, ``hand_over`` a repacked worker's groups."""

    take: Any
    report: Any
    hand_over: Any


class _Stream(SampleRunner):
    """The state of one ``stream`` call; a class so the loop reads as its steps."""

    def __init__(
        self, worker: RolloutWorker, source: GroupSource, settings: StreamSettings
    ) -> None:
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
        # Finished groups whose scores are being computed on ``scoring``, oldest first.
        self.being_scored: deque[
            tuple[str, PartialGroup, Future[tuple[ScoredRows, RolloutStats]]]
        ] = deque()
        self.reports: list[GroupDone] = []  # groups the store took, to report
        self.unsent: list[ScoredRows] = []  # finished groups not yet in the store
        self.unsent_done: list[GroupDone] = []  # their reports
        # Reports of groups put but maybe not taken yet, by put number: a group is reported
        # done only once the store holds its rows. Reported sooner, a worker dying with the
        # put in flight would lose them unrecorded (the dispatcher no longer holds them).
        self.unsettled: list[tuple[int, list[GroupDone]]] = []
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
            if not self.decoding():
                if self.newer is not None:
                    self.load_newer()
                    continue
                if self.stopping and not self.groups and not self.being_scored:
                    break
                if self.being_scored:  # nothing to decode: wait for the oldest score
                    wait([self.being_scored[0][2]], timeout=RELAY_POLL_S)
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
        self.report()
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
        self.engine.load_weights(self.newer, version)
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
        work, self.asked = ray.get(self.asked), None
        if work is None:
            self.stopping = True
            return
        self.held_until = work.held_until
        if work.give_to is not None:
            self.give_up(work.give_to)
        for handoff in work.handoffs:
            self.groups[handoff.group_id] = handoff.group
            for sample in handoff.group.samples:
                if sample.done is None:
                    self.begin(handoff.group_id, handoff.group, sample)
        for a in work.assignments:
            ids = self.engine.prompt_ids([a.problem.prompt])[0]
            started = time.time()
            samples = [PartialSample(a.group_id, j, a.predicted, started) for j in range(n)]
            group = PartialGroup(a.problem, ids, samples, a.seed)
            self.groups[a.group_id] = group
            for sample in group.samples:
                self.begin(a.group_id, group, sample)

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
            self.s.scale_by_std,
            [[s.mask for s in group.samples]],
            [[s.prompt_ids for s in group.samples]],
        )
        if self.scoring is None or recorded:
            self.scored(group_id, group, score())
        else:
            self.being_scored.append((group_id, group, self.scoring.submit(score)))

    def take_scored(self) -> None:
        """Move the groups the scoring thread has finished, in order, to the unsent ones."""
        while self.being_scored and self.being_scored[0][2].done():
            group_id, group, future = self.being_scored.popleft()
            self.scored(group_id, group, future.result())

    def scored(
        self, group_id: str, group: PartialGroup, scored: tuple[ScoredRows, RolloutStats]
    ) -> None:
        rows, stats = scored
        if not self.unsent:
            self.unsent_since = time.monotonic()
        self.unsent.append(rows)
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
            self.reports.extend(self.unsettled.pop(0)[1])

    def report(self) -> None:
        self.take_settled()
        in_flight = sum(max(0.0, s.predicted - len(s.token_ids)) for s in self.running.values())
        counters = {
            **self.counters,
            "version": float(self.engine.version()),
            "pid": float(os.getpid()),  # the flow notices a restarted worker by it
            "in_flight_tokens": float(in_flight),
            "free_groups": float(
                max(0, self.s.concurrency - len(self.running)) // self.s.samples_per_prompt
            ),
        }
        if self.read_reply():
            self.held_until = None
        self.reported = self.source.report.remote(self.s.worker, self.reports, counters)
        self.reports = []
        self.next_report = time.monotonic() + self.report_every_s


class RolloutWorkerClient:
    """A rollout worker's actor handle, typed: each call starts the work and returns its
    Ray ref at once (the flow waits on several together, restarting dead workers)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def pid(self) -> ObjectRef[int]:
        return self.handle.pid.remote()

    def devices(self) -> ObjectRef[str]:
        return self.handle.devices.remote()

    def generate(
        self, prompts: list[str], n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> ObjectRef[list[list[Completion]]]:
        return self.handle.generate.remote(prompts, n, max_new_tokens, temperature, seed)

    def sampled(
        self, prompts: list[str], max_new_tokens: int, temperature: float, seed: int, version: int
    ) -> ObjectRef[list[Sample]]:
        return self.handle.sampled.remote(prompts, max_new_tokens, temperature, seed, version)

    def rollout(self, problems: list[Problem], shard: BatchShard) -> ObjectRef[RolloutStats]:
        return self.handle.rollout.remote(problems, shard)

    def verdicts(
        self, problems: list[Problem], n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> ObjectRef[list[list[RewardResult]]]:
        return self.handle.verdicts.remote(problems, n, max_new_tokens, temperature, seed)

    def sync_weights(self, at_least: int, timeout_s: float) -> ObjectRef[int]:
        return self.handle.sync_weights.remote(at_least, timeout_s)

    def stream(self, source: GroupSource, settings: StreamSettings) -> ObjectRef[dict[str, float]]:
        return self.handle.stream.remote(source, settings)


def launch_rollout_workers(
    r: RolloutConfig,
    model_dir: str,
    max_model_len: int | None,
    seed: int,
    env: Environment,
    store: StoreClient | None,
    params: ParameterService | None,
    env_vars: dict[str, str],
    count: int | None = None,
    gpus: float | None = None,
    scorer: Callable[[], Scorer] | None = None,
    limits: EpisodeLimits | None = None,
    agent: AgentSpec | None = None,
    steps: StepSpec | None = None,
    lora: LoraConfig | None = None,
    adapter: str | None = None,
) -> list[RolloutWorkerClient]:
    """``count`` (default ``rollout.workers``) actors, each asking for
    ``rollout.cpus_per_worker`` CPU slots, ``rollout.gpus_per_worker`` GPUs and the custom
    Ray ``rollout.resources``, so it lands only on a node that offers them; Ray restarts one
    whose process dies, ``rollout.max_restarts`` times. ``gpus``: the GPUs each asks for,
    if the caller resolved them (``gpus_each``) already. ``scorer`` builds each worker's
    scorer in its process (default: ``env``'s verifier); ``limits`` bound a multi-turn
    environment's episodes, whose steps run as ``steps`` says; ``agent`` plays them through
    each worker's chat endpoint. ``lora`` (``train.lora``): the workers serve adapters,
    which each weight pull reloads, over the base model in ``model_dir``, starting from the
    adapter folder ``adapter`` if given."""
    extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env_vars}  # vLLM inside this process
    gpus = gpus_each(r.gpus_per_worker, r.tensor_parallel_size) if gpus is None else gpus
    return [
        RolloutWorkerClient(
            RolloutWorkerActor.options(
                num_cpus=r.cpus_per_worker,
                num_gpus=gpus,
                resources=r.resources or None,
                runtime_env=thread_env(r.threads_per_worker, extra, gpus),
                max_restarts=r.max_restarts,
            ).remote(
                partial(
                    VLLMRolloutEngine,
                    model_dir=model_dir,
                    seed=seed + i,
                    kv_cache_gib=r.kv_cache_gib,
                    enforce_eager=r.enforce_eager,
                    max_model_len=max_model_len,
                    dtype=pool_dtype(r.dtype, gpus),
                    gpu_memory_utilization=r.gpu_memory_utilization,
                    lora=lora,
                    adapter=adapter,
                    tensor_parallel_size=r.tensor_parallel_size,
                ),
                env,
                scorer if scorer is not None else partial(VerifierScorer, env),
                store,
                params,
                threads=r.threads_per_worker,
                credentials=Credentials.here(),
                limits=limits,
                agent=agent,
                steps=steps,
            )
        )
        for i in range(r.workers if count is None else count)
    ]
