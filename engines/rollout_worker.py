"""The rollout worker: a Ray actor with a vLLM engine, the verifier, and a store producer.

Driven by ``tasks/rollout.py``, in one of two ways:
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
Scoring here, next to the tokens, keeps trajectories off the driver.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc
import ray
import torch

from sluice.engines.protocols import Completion
from sluice.engines.vllm_rollout import Delta, VLLMRolloutEngine
from sluice.envs import Environment, Problem, score
from sluice.rl.advantages import group_advantages
from sluice.rl.dispatch import InFlight
from sluice.storage.block_builder import VersionRuns, trajectory_block
from sluice.storage.params import ParameterError, ParameterService, PendingPull
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


@dataclass(frozen=True)
class RolloutStats:
    """What one ``rollout`` call produced, in counts (the samples went to the store)."""

    samples: int
    groups: int
    tokens: int
    reward_sum: float
    correct: int
    truncated: int
    reward_errors: int
    behaviour_version: int


@dataclass(frozen=True)
class GroupDone:
    """A finished group as a streaming worker reports it to its source."""

    group_id: str
    prompt_id: str
    prompt_len: int
    lengths: list[int]
    reward_sum: float
    correct: int
    truncated: int
    reward_errors: int


def scored_block(
    env: Environment,
    problems: list[Problem],
    prompt_ids: list[list[int]],
    groups: list[list[Completion]],
    version_runs: list[list[VersionRuns]],
    group_ids: list[str],
    scale_by_std: bool,
) -> tuple[pa.RecordBatch, RolloutStats]:
    """Score every completion, compute GRPO advantages, and lay the groups out as rows.

    ``version_runs[g][j]`` gives the policy versions of completion j of group g as runs of
    ``(first token, version)``. Rows of one group are contiguous; sample ids are
    ``<group id>/<j>``. The block is built column by column (``trajectory_block``); the
    store checks it against the schema when it is put.
    """
    results = [
        [score(env, p, c.text) for c in group] for p, group in zip(problems, groups, strict=True)
    ]
    rewards = torch.tensor([[r.reward for r in row] for row in results])
    advantages = group_advantages(rewards, scale_by_std=scale_by_std)
    now = datetime.now(UTC)
    # One entry per sample, group by group: (group index, sample index in its group).
    order = [(g, j) for g, group in enumerate(groups) for j in range(len(group))]
    completions = [groups[g][j] for g, j in order]
    flat_results = [results[g][j] for g, j in order]
    block = trajectory_block(
        sample_ids=[f"{group_ids[g]}/{j}" for g, j in order],
        prompt_ids=[problems[g].prompt_id for g, _ in order],
        group_ids=[group_ids[g] for g, _ in order],
        env=env.name,
        prompts=[prompt_ids[g] for g, _ in order],
        responses=[c.token_ids for c in completions],
        logprobs=[c.logprobs for c in completions],
        version_runs=[version_runs[g][j] for g, j in order],
        rewards=[r.reward for r in flat_results],
        advantages=[float(advantages[g, j]) for g, j in order],
        status="scored",
        reasons=[r.error for r in flat_results],
        generated_at=now,
        scored_at=now,
    )
    oldest = pc.min(pc.list_flatten(block.column("token_versions"))).as_py()
    stats = RolloutStats(
        samples=len(completions),
        groups=len(groups),
        tokens=sum(len(c.token_ids) for c in completions),
        reward_sum=float(rewards.sum()),
        correct=sum(r.correct for r in flat_results),
        truncated=sum(not c.finished for c in completions),
        reward_errors=sum(r.error is not None for r in flat_results),
        behaviour_version=int(oldest) if oldest is not None else 0,
    )
    return block, stats


class RolloutWorkerBase(VLLMRolloutEngine):
    """The engine plus the environment, a store producer and a parameter-service puller."""

    def __init__(
        self,
        threads: int,
        env: Environment | None = None,
        store: StoreClient | None = None,
        params: ParameterService | None = None,
        credentials: Credentials | None = None,
        **engine_args: Any,
    ) -> None:
        if credentials:
            credentials.apply()  # trajectory files under an s3:// url
        torch.set_num_threads(threads)
        super().__init__(**engine_args)
        self._env, self._store, self._params = env, store, params
        self.stream_counters = {"busy_s": 0.0, "idle_s": 0.0, "pull_s": 0.0, "weight_loads": 0.0}

    def rollout(
        self,
        problems: list[Problem],
        n: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        tag: str,
        scale_by_std: bool,
    ) -> RolloutStats:
        if self._env is None or self._store is None:
            raise RuntimeError("this rollout worker was started without an environment and store")
        prompts = [p.prompt for p in problems]
        groups = self.generate(prompts, n, max_new_tokens, temperature, seed)
        version = self.version()
        block, stats = scored_block(
            self._env,
            problems,
            self.prompt_ids(prompts),
            groups,
            [[[(0, version)] for _ in group] for group in groups],
            [f"{p.prompt_id}@{tag}" for p in problems],
            scale_by_std,
        )
        self._store.put(block)
        return stats

    def pid(self) -> int:
        return os.getpid()

    def sync_weights(self, at_least: int = 0, timeout_s: float = 60.0) -> int:
        """Load the newest published version; returns the version now loaded.

        With ``at_least``, wait (up to ``timeout_s``) until the relay holds that version: a
        publish returns before the relay has taken the version, so a pull right behind it
        can still find the previous one.
        """
        if self._params is None:
            raise RuntimeError("this rollout worker was started without a parameter service")
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            found = self._params.pull_blobs(after=self.version(), timeout=max(left, 0.001))
            if found is not None:
                version, blobs = found
                self.load_weights(blobs, version)
            if self.version() >= at_least:
                return self.version()
            if left <= 0:
                raise ParameterError(
                    f"weight version {at_least} did not reach the parameter relay within "
                    f"{timeout_s:g} s (this worker holds version {self.version()}); is the "
                    "trainer alive?"
                )
            time.sleep(RELAY_POLL_S)

    # -- streaming (async mode) ------------------------------------------------------------

    def stream(self, source: GroupSource, settings: StreamSettings) -> dict[str, float]:
        """Generate continuously until ``source`` says stop; returns this worker's totals.

        Keeps up to ``settings.concurrency`` samples in vLLM's running batch, one request
        per sample, refilled from ``source`` as samples finish. A finished group is scored
        and gets its advantages; finished groups go to the store together, at the latest
        ``PUT_EVERY_S`` after the first of them finished. Between engine steps the worker
        checks the parameter service and loads a newer version when there is one: with
        ``partial_rollout`` the samples in flight continue under the new weights and their
        later tokens carry the new version; without it the worker stops taking new work
        until its running samples finish, then loads.
        """
        if self._env is None or self._store is None or self._params is None:
            raise RuntimeError("streaming needs an environment, a store and a parameter service")
        run = _Stream(self, source, settings)
        return run.loop()


class GroupSource(Protocol):
    """Where a streaming worker gets work (``tasks.dispatcher.Dispatcher``, a Ray actor):
    ``take`` returns a ``tasks.dispatcher.Work`` (or None: stop), ``report`` takes finished
    groups and counters, ``hand_over`` takes a repacked worker's groups."""

    take: Any
    report: Any
    hand_over: Any


@dataclass(frozen=True)
class StreamSettings:
    worker: int
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    scale_by_std: bool
    concurrency: int  # samples in flight at most: vLLM's running batch
    partial_rollout: bool = True
    weight_check_s: float = 0.1
    report_every_s: float = 0.5
    pull_timeout_s: float = 120.0
    # Repack: send the running samples with each ask once at most this many are left
    # (0: never).
    repack_max_stragglers: int = 0


@dataclass
class _Sample:
    group: str
    index: int
    predicted: float
    started_at: float = 0.0  # time.time() when it first started, on whichever worker
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    marks: list[tuple[int, int]] = field(default_factory=list)  # (first token, version)
    done: Completion | None = None


@dataclass
class _Group:
    problem: Problem
    prompt_ids: list[int]
    samples: list[_Sample]
    seed: int


def _as_reported(group: _Group) -> _Group:
    """``group`` cut back to the tokens ``step`` has reported: a version mark taken from
    ``generated`` may lie past them, and the worker that continues the group regenerates
    the rest."""
    samples = [
        replace(s, marks=[(min(first, len(s.token_ids)), v) for first, v in s.marks])
        for s in group.samples
    ]
    return replace(group, samples=samples)


@dataclass(frozen=True)
class Handoff:
    """An unfinished group moved to another worker by repack: its samples as they stood
    (finished ones with their completion, the others with the tokens generated so far)."""

    group_id: str
    group: _Group


class _Stream:
    """The state of one ``stream`` call; a class so the loop reads as its steps."""

    def __init__(
        self, worker: RolloutWorkerBase, source: GroupSource, settings: StreamSettings
    ) -> None:
        self.w, self.source, self.s = worker, source, settings
        self.running: dict[str, _Sample] = {}
        self.groups: dict[str, _Group] = {}
        self.reports: list[GroupDone] = []
        self.unsent: list[pa.RecordBatch] = []  # finished groups not yet in the store
        self.unsent_since = 0.0
        # Running totals kept on the worker, so they survive a pause of the stream.
        self.counters = worker.stream_counters
        self.stopping = False
        self.newer: tuple[int, list[bytes]] | None = None
        self.next_check = self.next_report = 0.0
        self.asked: ray.ObjectRef | None = None  # a `take` sent, not yet answered
        self.weights_asked: PendingPull | None = None  # a relay asked, not yet answered

    def loop(self) -> dict[str, float]:
        while True:
            now = time.monotonic()
            if self.weights_asked is not None or now >= self.next_check:
                self.check_weights()
            if not self.stopping and self.newer is None:
                self.refill()
            if not self.running:
                if self.newer is not None:
                    self.load_newer()
                    continue
                if self.stopping and not self.groups:
                    break
                time.sleep(RELAY_POLL_S)  # admission holds us back: idle
                self.counters["idle_s"] += time.monotonic() - now
            else:
                for delta in self.w.step():
                    self.advance(delta)
                self.counters["busy_s"] += time.monotonic() - now
            if self.unsent and (
                len(self.unsent) >= PUT_GROUPS or time.monotonic() - self.unsent_since > PUT_EVERY_S
            ):
                self.send()
            if time.monotonic() >= self.next_report:
                self.report()
        self.send()
        self.report()
        self.w._store.flush()  # type: ignore[union-attr]
        return dict(self.counters)

    def check_weights(self) -> None:
        """Ask the parameter service for a newer version; load it once answered.

        Like ``refill``, the question is sent ahead and its answer read when it is there,
        so a running batch never waits for the relay (those waits cost ~1% of a worker).
        """
        started = time.monotonic()
        if self.weights_asked is None:
            after = max(self.w.version(), self.newer[0] if self.newer else -1)
            self.weights_asked = self.w._params.ask(after)  # type: ignore[union-attr]
            self.next_check = started + self.s.weight_check_s
        if self.running and not self.weights_asked.answered():
            return
        asked, self.weights_asked = self.weights_asked, None
        found = self.w._params.collect(asked, timeout=self.s.pull_timeout_s)  # type: ignore[union-attr]
        self.counters["pull_s"] += time.monotonic() - started
        if found is not None:
            self.newer = found
        if self.newer is not None and (self.s.partial_rollout or not self.running):
            self.load_newer()

    def load_newer(self) -> None:
        assert self.newer is not None
        version, blobs = self.newer
        self.w.load_weights(blobs, version)
        self.newer = None
        self.counters["weight_loads"] += 1
        for request, sample in self.running.items():  # tokens from here on: `version`
            generated = self.w.generated(request)
            sample.marks.append(
                (len(sample.token_ids) if generated is None else generated, version)
            )

    def refill(self) -> None:
        """Ask the dispatcher for groups once there is room, and start what it sends.

        The ask is sent ahead and read once answered: while samples are running the worker
        goes on stepping instead of waiting for the dispatcher, which on a busy machine must
        first be scheduled (the waits cost ~1% of a worker on 2 cores).
        """
        n = self.s.samples_per_prompt
        if self.asked is None:
            room = (self.s.concurrency - len(self.running)) // n
            # Ask in chunks: an actor call per finished group cost ~5% of the worker.
            if room <= 0 or (self.running and room * n < REFILL_AT * self.s.concurrency):
                return
            stragglers = None
            if 0 < len(self.running) <= self.s.repack_max_stragglers:
                stragglers = [
                    InFlight(request, s.group, s.started_at, len(s.token_ids), s.predicted)
                    for request, s in self.running.items()
                ]
            self.asked = self.source.take.remote(self.s.worker, room, self.w.version(), stragglers)
        if self.running and not ray.wait([self.asked], timeout=0)[0]:
            return  # not answered yet: keep generating
        work, self.asked = ray.get(self.asked), None
        if work is None:
            self.stopping = True
            return
        if work.give_to is not None:
            self.give_up(work.give_to)
        for handoff in work.handoffs:
            self.groups[handoff.group_id] = handoff.group
            for sample in handoff.group.samples:
                if sample.done is None:
                    self.begin(handoff.group_id, handoff.group, sample)
        for a in work.assignments:
            ids = self.w.prompt_ids([a.problem.prompt])[0]
            started = time.time()
            samples = [_Sample(a.group_id, j, a.predicted, started) for j in range(n)]
            group = _Group(a.problem, ids, samples, a.seed)
            self.groups[a.group_id] = group
            for sample in group.samples:
                self.begin(a.group_id, group, sample)

    def begin(self, group_id: str, group: _Group, sample: _Sample) -> None:
        """Start ``sample`` in vLLM, or continue it from the tokens it has (a repacked one)."""
        request, done = f"{group_id}/{sample.index}", len(sample.token_ids)
        version = self.w.version()
        if not sample.marks or sample.marks[-1][1] != version:
            sample.marks.append((done, version))
        self.running[request] = sample
        self.w.start(
            request,
            group.prompt_ids + sample.token_ids,
            self.s.max_new_tokens - done,
            self.s.temperature,
            group.seed * 131 + sample.index + done,
        )

    def give_up(self, target: int) -> None:
        """Repack: hand every unfinished group to worker ``target``, as the dispatcher
        planned, and drop their requests here; this worker is then free for fresh work."""
        handoffs = [
            Handoff(group_id, _as_reported(group)) for group_id, group in self.groups.items()
        ]
        if not ray.get(self.source.hand_over.remote(self.s.worker, target, handoffs)):
            return  # the dispatcher stopped or the target is gone: keep them
        self.w.abort(list(self.running))
        self.running.clear()
        self.groups.clear()

    def advance(self, delta: Delta) -> None:
        sample = self.running.get(delta.request_id)
        if sample is None:
            return  # handed to another worker by repack (vLLM may report it once more)
        sample.token_ids.extend(delta.token_ids)
        sample.logprobs.extend(delta.logprobs)
        if not delta.finished:
            return
        del self.running[delta.request_id]
        sample.done = Completion(
            sample.token_ids,
            sample.logprobs,
            self.w.decode(sample.token_ids),
            delta.finish_reason == "stop",
        )
        group = self.groups[sample.group]
        if all(s.done is not None for s in group.samples):
            self.finish(sample.group, group)

    def finish(self, group_id: str, group: _Group) -> None:
        del self.groups[group_id]
        if not self.unsent:
            self.unsent_since = time.monotonic()
        completions = [s.done for s in group.samples if s.done is not None]
        block, stats = scored_block(
            self.w._env,  # type: ignore[arg-type]
            [group.problem],
            [group.prompt_ids],
            [completions],
            [[s.marks for s in group.samples]],
            [group_id],
            self.s.scale_by_std,
        )
        self.unsent.append(block)
        self.reports.append(
            GroupDone(
                group_id=group_id,
                prompt_id=group.problem.prompt_id,
                prompt_len=len(group.problem.prompt),
                lengths=[len(c.token_ids) for c in completions],
                reward_sum=stats.reward_sum,
                correct=stats.correct,
                truncated=stats.truncated,
                reward_errors=stats.reward_errors,
            )
        )

    def send(self) -> None:
        """Put the finished groups into the store as one block."""
        if self.unsent:
            self.w._store.put(pa.concat_batches(self.unsent))  # type: ignore[union-attr]
            self.unsent = []

    def report(self) -> None:
        in_flight = sum(max(0.0, s.predicted - len(s.token_ids)) for s in self.running.values())
        counters = {
            **self.counters,
            "version": float(self.w.version()),
            "pid": float(os.getpid()),  # the flow notices a restarted worker by it
            "in_flight_tokens": float(in_flight),
            "free_groups": float(
                max(0, self.s.concurrency - len(self.running)) // self.s.samples_per_prompt
            ),
        }
        self.source.report.remote(self.s.worker, self.reports, counters)
        self.reports = []
        self.next_report = time.monotonic() + self.s.report_every_s
