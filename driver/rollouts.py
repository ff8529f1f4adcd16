"""How rollouts are driven in each mode (the ``Rollouts`` Protocol), and held-out evaluation.

``BatchRollouts`` (``sync``, ``one_step``): a batch is submitted (the workers start
generating at once) and collected later, so the flow can train on one batch while the
next one generates. ``StreamRollouts`` (``async``): every worker streams from the
dispatcher (``engines/rollout/dispatcher.py``) until told to stop. Either way the workers score
their samples and put them into the trajectory store themselves
(``engines/rollout/worker.py``); what comes back here is counts for the metrics. The flow
drives both through the same calls (``Rollouts``); ``schedule`` is the one place that reads
the config's ``mode``.

A rollout worker whose process dies is restarted by Ray; the call it was running fails
here, and its work is handed out again: a batch shard is resubmitted under a new tag, a
stream's unfinished groups go back to the dispatcher's queue and the stream is restarted.
Training goes on. ``RolloutFailure`` ends the run once a worker has died more often than
``rollout.max_restarts`` allows.

A worker whose node was lost stays restarting until a node with its resources joins,
which may take minutes or never happen; so does a worker no node had room for when the
run started (``engines/cluster/placement.py``). ``async`` goes on with the pool it has: held-out
evaluation and the end of the run use the live workers only (``live``), and the worker
gets a stream again whenever Ray has it back. The batch modes wait for it: each batch is
split over every worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol, cast

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError

from sluice.config.tree import RunConfig
from sluice.engines.protocols import Completion
from sluice.engines.rollout.dispatcher import DispatcherClient
from sluice.engines.rollout.messages import BatchShard, RolloutStats, StreamSettings
from sluice.engines.rollout.worker import RolloutWorkerClient
from sluice.envs import Problem, RewardResult
from sluice.envs.prompts import PromptSource
from sluice.envs.scoring import Scorer

log = logging.getLogger("sluice")

# Waits for Ray refs, restarting dead rollout workers and logging progress meanwhile
# (``Session.wait``).
Waiter = Callable[[Any, str], Any]


# A restarted rollout worker loads vLLM again (~25 s on 2 cores); give up after this.
RESTART_TIMEOUT_S = 300.0


class RolloutFailure(RuntimeError):
    """A rollout worker died more often than ``rollout.max_restarts`` allows."""


class Restarts:
    """Counts each worker's deaths; says what happened, and fails past the limit.

    While Ray restarts a worker, calls to it fail with ``ActorUnavailableError``; ``back``
    probes it without blocking, ``wait_back`` blocks until it answers.
    """

    def __init__(self, workers: list[RolloutWorkerClient], limit: int) -> None:
        self.workers = workers
        self.counts = [0] * len(workers)
        self.limit = limit
        self._probes: dict[int, tuple[Any, Any]] = {}

    def back(self, worker: int) -> bool:
        """True once the restarted ``worker`` answers; raises if it is dead for good."""
        probe = self._probes.get(worker)
        if probe is None:
            client = self.workers[worker]
            self._probes[worker] = (client.pid(), client.devices())
            return False
        if len(ray.wait(list(probe), num_returns=2, timeout=0)[0]) < 2:
            return False
        del self._probes[worker]
        try:
            pid, devices = ray.get(list(probe))
        except ActorUnavailableError:
            return False  # still restarting: the next call probes again
        except RayActorError as error:
            raise RolloutFailure(
                f"rollout worker {worker} could not be restarted: {error}"
            ) from error
        # A worker Ray places late is not in the session's start-up devices line.
        on = "" if devices == "cpu" else f", CUDA_VISIBLE_DEVICES {devices}"
        log.info("rollout worker %d is up (pid %d%s)", worker, pid, on)
        return True

    def wait_back(self, worker: int, timeout_s: float = RESTART_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.back(worker):
            if time.monotonic() > deadline:
                raise RolloutFailure(
                    f"rollout worker {worker} did not come back within {timeout_s:g} s"
                )
            time.sleep(0.2)

    def died(self, worker: int, error: BaseException, handed_back: str) -> None:
        self.counts[worker] += 1
        if self.counts[worker] > self.limit:
            raise RolloutFailure(
                f"rollout worker {worker} died {self.counts[worker]} times, more than "
                f"rollout.max_restarts={self.limit}: {type(error).__name__}"
            ) from error
        cause = getattr(error, "cause", None)  # a RayTaskError: what the worker raised
        log.warning(
            "rollout worker %d died (%s); %s; Ray restarts it (restart %d of at most %d)",
            worker,
            type(error).__name__ + (f": {cause}"[:300] if cause is not None else ""),
            handed_back,
            self.counts[worker],
            self.limit,
        )


class Rollouts(Protocol):
    """How the flow drives generation, whatever the mode."""

    def start(self) -> None:
        """Start generating (after the pools opened, and the step-0 checkpoint)."""

    def check(self) -> None:
        """Restart dead workers' work; raise a worker's error (called while the flow waits)."""

    def before_train(self, step: int) -> None:
        """Return once the groups step ``step`` may train on can be in the store."""

    def after_train(self, step: int) -> None:
        """The trainer published version ``step``: whatever the mode does about it."""

    def drain(self, step: int, dropped_groups: int) -> dict[str, float]:
        """Rollout metrics since the last step; ``dropped_groups`` the store dropped."""

    def live(self) -> list[RolloutWorkerClient]:
        """The workers that answer now (held-out evaluation runs on them)."""

    def died_loading(self, worker: RolloutWorkerClient, step: int, error: RayActorError) -> None:
        """``worker`` died loading version ``step`` outside any rollout call (held-out
        evaluation, a resume): Ray restarts it."""

    def pause(self) -> None:
        """Hand vLLM back (held-out evaluation), until ``resume``."""

    def resume(self) -> None: ...

    def stop(self) -> None:
        """Finish: no more work is given out; running work ends."""

    def placed(self, waiting: set[int]) -> None:
        """The workers in ``waiting`` are not placed yet (``async`` starts without them)."""

    def cursor(self) -> dict[str, Any]:
        """Where the prompt stream stands, for a checkpoint."""

    def restore(self, cursor: dict[str, Any], step: int, held_groups: int) -> None:
        """Continue from a checkpoint's ``cursor`` at ``step``; the restored store re-offers
        ``held_groups`` groups."""


@dataclass(frozen=True)
class Schedule:
    """What the mode decides, read from the config in one place (``schedule``)."""

    max_staleness: int  # versions a trained sample may lag the trainer
    streaming: bool  # async: workers stream; else one batch per step
    min_workers: int  # rollout workers a run waits for before it starts (async: 1)

    def rollouts(
        self,
        cfg: RunConfig,
        workers: list[RolloutWorkerClient],
        prompts: PromptSource,
        wait: Waiter,
        tag: str,
        dispatcher: DispatcherClient | None,
    ) -> Rollouts:
        """The mode's ``Rollouts``; streaming needs the ``dispatcher``."""
        if not self.streaming:
            return BatchRollouts(cfg, workers, prompts, wait, tag)
        assert dispatcher is not None
        return StreamRollouts(cfg, workers, dispatcher, wait, tag)


def schedule(cfg: RunConfig) -> Schedule:
    """The one place that reads ``mode``: ``sync`` trains each batch on the weights that
    generated it; ``one_step`` generates one version ahead; ``async`` streams within
    ``max_staleness``."""
    workers = cfg.rollout.workers
    return {
        "sync": Schedule(0, False, workers),
        "one_step": Schedule(1, False, workers),
        "async": Schedule(cfg.max_staleness, True, 1),
    }[cfg.mode]


@dataclass(frozen=True)
class RolloutResult:
    samples: int
    mean_reward: float
    accuracy: float
    tokens: int
    mean_length: float
    truncated: float
    reward_errors: int
    behaviour_version: int
    reward_metrics: dict[str, float]  # summed over the samples that scored
    reward_messages: tuple[str, ...]
    episode_counts: dict[str, float] = field(default_factory=dict)  # multi-turn, summed


# Failed rewards whose reasons the console shows; the rest are counted
# (rollout/reward_errors) and their reasons recorded in the ledger.
SHOW_REWARD_FAILURES = 5


class RewardFailures:
    """Shows the first few failed rewards' reasons on the console, once each run."""

    def __init__(self) -> None:
        self.shown = 0

    def show(self, messages: Sequence[str]) -> None:
        for message in messages:
            if self.shown >= SHOW_REWARD_FAILURES:
                return
            self.shown += 1
            log.warning("a sample's reward failed (recorded in the ledger): %s", message)
            if self.shown == SHOW_REWARD_FAILURES:
                log.warning(
                    "further reward failures are counted in rollout/reward_errors and their "
                    "reasons recorded in the ledger (sluice ledger RUN)"
                )


def reward_function_metrics(sums: dict[str, float], scored: int) -> dict[str, float]:
    """Each user reward function's mean reward and metrics over the samples that scored."""
    return {f"rollout/reward/{name}": total / scored for name, total in sums.items() if scored}


@dataclass(frozen=True)
class ShardCall:
    """One worker's part of a batch: enough to submit it again if the worker dies."""

    worker: int
    problems: list[Problem]
    shard: BatchShard

    def submit(self, workers: list[RolloutWorkerClient], retry: int = 0) -> Any:
        shard = self.shard
        if retry:
            shard = replace(shard, tag=f"{shard.tag}x{retry}")
        return workers[self.worker].rollout(self.problems, shard)


@dataclass(frozen=True)
class PendingRollout:
    refs: list[Any]  # one RolloutStats ref per worker that got prompts
    calls: list[ShardCall]


def _shards(problems: list[Problem], workers: int) -> list[list[int]]:
    return [s for s in (list(range(len(problems)))[i::workers] for i in range(workers)) if s]


def submit(
    workers: list[RolloutWorkerClient],
    problems: list[Problem],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    scale_by_std: bool,
    tag: str = "",
    version: int = 0,
    pull_timeout_s: float = 120.0,
) -> PendingRollout:
    """Spread the problems over the workers and start generating; returns at once.

    ``seed`` also tags the sample ids, so a prompt that comes round again gets new ones.
    ``version``: the policy version to generate with (a restarted worker loads it first).
    """
    shard = BatchShard(
        n,
        max_new_tokens,
        temperature,
        seed,
        f"{tag}r{seed}",
        scale_by_std,
        version,
        pull_timeout_s,
    )
    # Each worker's part is tagged apart, and its groups are numbered within it: a prompt
    # can come twice in one batch (a stream's epoch ends and the next begins in the batch).
    calls = [
        ShardCall(w, [problems[i] for i in part], replace(shard, tag=f"{shard.tag}w{w}"))
        for w, part in enumerate(_shards(problems, len(workers)))
    ]
    return PendingRollout([c.submit(workers) for c in calls], calls)


def summed(parts: list[RolloutStats]) -> RolloutResult:
    """The counts of every worker's part of a batch, added up."""
    samples = sum(p.samples for p in parts)
    tokens = sum(p.tokens for p in parts)
    return RolloutResult(
        samples=samples,
        mean_reward=sum(p.reward_sum for p in parts) / samples,
        accuracy=sum(p.correct for p in parts) / samples,
        tokens=tokens,
        mean_length=tokens / samples,
        truncated=sum(p.truncated for p in parts) / samples,
        reward_errors=sum(p.reward_errors for p in parts),
        behaviour_version=min(p.behaviour_version for p in parts),
        reward_metrics={
            name: sum(p.reward_metrics.get(name, 0.0) for p in parts)
            for name in {name for p in parts for name in p.reward_metrics}
        },
        reward_messages=tuple(m for p in parts for m in p.reward_messages),
        episode_counts={
            name: sum(p.episode_counts.get(name, 0.0) for p in parts)
            for name in {name for p in parts for name in p.episode_counts}
        },
    )


def evaluate(
    workers: list[RolloutWorkerClient],
    scorer: Scorer,
    problems: list[Problem],
    max_new_tokens: int,
    k: int = 1,
    temperature: float = 1.0,
    episodes: bool = False,
) -> dict[str, float]:
    """Held-out metrics (completions come back here, not to the store): ``eval/accuracy``
    with greedy decoding, and with ``k > 1`` also ``eval/mean_at_<k>`` (the share of right
    samples) and ``eval/pass_at_<k>`` (the share of prompts with a right one) over ``k``
    samples per prompt at ``temperature``.

    A worker that dies meanwhile is left out (Ray restarts it; the next call the rollouts
    make to it waits for the new process): its prompts run again on the workers still
    there. Fails only when none is left. ``episodes``: the environment is multi-turn; the
    workers play each episode to its end and its environment's verdict counts.
    """
    live = list(workers)
    correct = partial(_correct, live, None if episodes else scorer, problems)
    greedy = correct(1, max_new_tokens, 0.0)
    metrics = {"eval/accuracy": sum(c[0] for c in greedy) / len(problems)}
    if k > 1:
        sampled = correct(k, max_new_tokens, temperature)
        metrics[f"eval/mean_at_{k}"] = sum(sum(c) for c in sampled) / (k * len(problems))
        metrics[f"eval/pass_at_{k}"] = sum(any(c) for c in sampled) / len(problems)
    return metrics


def _correct(
    live: list[RolloutWorkerClient],
    scorer: Scorer | None,
    problems: list[Problem],
    n: int,
    max_new_tokens: int,
    temperature: float,
) -> list[list[bool]]:
    """Whether each of ``n`` completions of each problem is correct (without a ``scorer``:
    each of ``n`` episodes); ``live`` loses the workers that die meanwhile."""
    out: list[list[bool]] = [[] for _ in problems]
    left = list(range(len(problems)))
    while left:
        if not live:
            raise RolloutFailure("every rollout worker died during the held-out evaluation")
        asked = [
            (
                w,
                shard,
                w.generate([problems[i].prompt for i in shard], n, max_new_tokens, temperature, 0)
                if scorer is not None
                else w.verdicts([problems[i] for i in shard], n, max_new_tokens, temperature, 0),
            )
            for w, shard in zip(live, (left[j :: len(live)] for j in range(len(live))), strict=True)
            if shard
        ]
        left = []
        for w, shard, ref in asked:
            try:
                got = ray.get(ref)
            except (RayActorError, ActorUnavailableError) as error:
                log.warning(
                    "a rollout worker died during the held-out evaluation (%s); its %d "
                    "prompts run on the others",
                    type(error).__name__,
                    len(shard),
                )
                live.remove(w)
                left += shard
                continue
            results = cast(list[list[RewardResult]], got)  # episodes: their verdicts
            if scorer is not None:  # completions, scored here
                groups = cast(list[list[Completion]], got)
                results = scorer.score(
                    [problems[i] for i in shard],
                    [[c.text for c in g] for g in groups],
                    [[len(c.token_ids) for c in g] for g in groups],
                )
            for i, row in zip(shard, results, strict=True):
                out[i] = [r.correct for r in row]
    return out


def rollout_metrics(result: RolloutResult) -> dict[str, float]:
    return {
        "rollout/reward": result.mean_reward,
        "rollout/accuracy": result.accuracy,
        "rollout/response_length": result.mean_length,
        "rollout/truncated": result.truncated,
        "rollout/reward_errors": float(result.reward_errors),
        **reward_function_metrics(result.reward_metrics, result.samples - result.reward_errors),
        **episode_metrics(result.episode_counts, result.samples),
    }


class BatchRollouts:
    """``sync`` and ``one_step``: one batch per step, generated with one policy version.

    ``sync`` submits batch i+1 after the workers loaded the weights of step i; ``one_step``
    submits it before training on batch i, so it is generated one version behind.
    """

    def __init__(
        self,
        cfg: RunConfig,
        workers: list[RolloutWorkerClient],
        prompts: PromptSource,
        wait: Waiter,
        tag: str = "",
    ) -> None:
        self.cfg, self.r = cfg, cfg.rollout
        self.workers, self.prompts, self.wait, self.tag = workers, prompts, wait, tag
        self.overlap = cfg.mode == "one_step"
        self.pending: PendingRollout | None = None
        self.result: RolloutResult | None = None
        self.restarts = Restarts(workers, cfg.rollout.max_restarts)
        self.failures = RewardFailures()
        self.step = 0  # the trainer's version when ``start`` is called

    def _submit(self, step: int) -> None:
        self.pending = submit(
            self.workers,
            self.prompts.take(self.r.prompts_per_step),
            self.r.samples_per_prompt,
            self.r.max_new_tokens,
            self.r.temperature,
            seed=self.cfg.seed * 1_000_003 + step,
            scale_by_std=self.cfg.train.scale_adv_by_std,
            tag=self.tag,
            # sync: the version of the step before; one_step: one more behind
            version=max(0, step - 1 - int(self.overlap)),
            pull_timeout_s=self.cfg.weights.pull_timeout_s,
        )

    def start(self) -> None:
        self._submit(self.step + 1)

    def check(self) -> None:
        """Failures surface from the calls ``before_train`` and ``after_train`` wait for."""

    def _each(self, refs: list[Any], again: Callable[[int, int], Any], what: str) -> list[Any]:
        """Wait for one call per worker; a worker that died gets ``again(worker, retry)``."""
        out = []
        for w, ref in enumerate(refs):
            retry = 0
            while True:
                try:
                    out.append(self.wait(ref, what))
                    break
                except RayActorError as error:
                    retry += 1
                    self.restarts.died(w, error, f"its {what} call is made again")
                    self.restarts.wait_back(w)
                    ref = again(w, retry)
        return out

    def before_train(self, step: int) -> None:
        pending = self.pending
        assert pending is not None
        # This step's groups are scored and in the store once every shard came back.
        self.result = summed(
            self._each(
                pending.refs,
                lambda w, retry: pending.calls[w].submit(self.workers, retry),
                "rollouts",
            )
        )
        if self.overlap and step < self.cfg.train.steps:
            self._submit(step + 1)  # generates with the previous weights while we train

    def after_train(self, step: int) -> None:
        timeout = self.cfg.weights.pull_timeout_s

        def pull(w: int, retry: int = 0) -> Any:
            return self.workers[w].sync_weights(step, timeout)

        # Queued behind each worker's generation: `one_step` keeps its overlap.
        self._each([pull(w) for w in range(len(self.workers))], pull, "weights")
        if not self.overlap and step < self.cfg.train.steps:
            self._submit(step + 1)

    def drain(self, step: int, dropped_groups: int = 0) -> dict[str, float]:
        if self.result is None:
            return {}
        self.failures.show(self.result.reward_messages)
        return rollout_metrics(self.result)

    def live(self) -> list[RolloutWorkerClient]:
        """The workers that evaluate: all of them (a dead one was waited for)."""
        return self.workers

    def died_loading(self, worker: RolloutWorkerClient, step: int, error: RayActorError) -> None:
        """Counted when its next batch call fails and waits for Ray to bring it back."""
        log.warning(
            "rollout worker %d died loading version %d (%s); its next batch waits for it",
            self.workers.index(worker),
            step,
            type(error).__name__,
        )

    def pause(self) -> None:
        """Nothing runs between steps except what ``one_step`` submitted: let it be."""

    def resume(self) -> None:
        """Nothing was paused."""

    def stop(self) -> None:
        """Every submitted batch was collected by the last step."""

    def placed(self, waiting: set[int]) -> None:
        """The batch modes start with every worker placed: nothing waits here."""

    def cursor(self) -> dict[str, Any]:
        return {"prompts": self.prompts.cursor()}

    def restore(self, cursor: dict[str, Any], step: int, held_groups: int) -> None:
        self.prompts.restore(cursor["prompts"])
        self.step = step


class StreamRollouts:
    """``async``: workers stream continuously from a dispatcher, bounded by max_staleness."""

    def __init__(
        self,
        cfg: RunConfig,
        workers: list[RolloutWorkerClient],
        dispatcher: DispatcherClient,
        wait: Waiter,
        tag: str = "",
    ) -> None:
        self.cfg, self.workers, self.dispatcher, self.wait = cfg, workers, dispatcher, wait
        self.settings = [stream_settings(cfg, i) for i in range(len(workers))]
        self.tag = tag  # group ids of a resumed run (the dispatcher applies it)
        self.refs: list[Any] = []  # one stream per worker while streaming (None: restarting)
        self.last: dict[int, dict[str, float]] = {}  # each worker's counters at the last drain
        self.restarts = Restarts(workers, cfg.rollout.max_restarts)
        self.restarting: set[int] = set()  # died; its stream resumes once Ray has it back
        self.failures = RewardFailures()
        self.requeued = 0  # groups (episodes) a dead worker held, since the last drain

    def start(self) -> None:
        self.dispatcher.resume()
        self.refs = [
            None if i in self.restarting else w.stream(self.dispatcher.handle, s)
            for i, (w, s) in enumerate(zip(self.workers, self.settings, strict=True))
        ]

    def live(self) -> list[RolloutWorkerClient]:
        """The workers that answer now; with none left, waits for the first one back."""
        if len(self.restarting) == len(self.workers):
            first = min(self.restarting)
            self.restarts.wait_back(first)
            self.restarting.discard(first)
        return [w for i, w in enumerate(self.workers) if i not in self.restarting]

    def died_loading(self, worker: RolloutWorkerClient, step: int, error: RayActorError) -> None:
        """Its stream was stopped; it streams again once Ray has it back (``check``)."""
        handed_back = f"it was loading version {step}; {{lost}} groups go back to the queue"
        self._lost(self.workers.index(worker), error, handed_back)

    def check(self) -> None:
        """Restart the stream of a worker that died or whose stream failed.

        A stream that raised counts as its worker's failure too: a node that goes away can
        fail the call with the worker's own error (a broken connection to its raylet)
        before Ray reports the actor dead. Its groups go back to the queue and the stream
        starts again; each counts against ``rollout.max_restarts``, so an error that
        repeats fails the run, named."""
        for i in sorted(self.restarting):
            if self.restarts.back(i):  # it pulls the newest weights before generating
                self.restarting.discard(i)
                self._hand_back_stale(i)
                if self.refs:  # streaming; between stop and start, start gives it one
                    self.refs[i] = self.workers[i].stream(self.dispatcher.handle, self.settings[i])
        live = [r for i, r in enumerate(self.refs) if i not in self.restarting]
        done, _ = ray.wait(live, num_returns=len(live), timeout=0)
        for ref in done:
            try:
                ray.get(ref)  # a stream that ended early: its worker died or it raised
            except (RayActorError, RayTaskError) as error:
                i = self.refs.index(ref)
                self._lost(i, error, "its {lost} unfinished groups go back to the queue")

    def _lost(self, i: int, error: RayError, handed_back: str) -> None:
        """Worker ``i`` died: its groups go back to the queue and Ray restarts it. Counted
        once per death: ``check``, called while ``stop`` waits, can see the same one first.
        ``handed_back`` may name ``{lost}``, the number of groups requeued."""
        if i in self.restarting:
            return
        lost = self.dispatcher.requeue(i)
        self.requeued += lost
        self.restarts.died(i, error, handed_back.format(lost=lost))
        self.restarting.add(i)

    def _hand_back_stale(self, i: int) -> None:
        """A ``take`` the dead worker ``i`` sent before it died can reach the dispatcher
        after its groups were requeued, and is answered with groups nobody will run:
        hand those back too (recorded dropped, prompts requeued) before ``i`` streams again
        or the run ends."""
        lost = self.dispatcher.requeue(i)
        self.requeued += lost
        if lost:
            log.info(
                "rollout worker %d: %d groups given to it after it died go back to the queue",
                i,
                lost,
            )

    def before_train(self, step: int) -> None:
        self.check()

    def after_train(self, step: int) -> None:
        """Workers pull new weights on their own schedule: nothing to do."""

    def drain(self, step: int, dropped_groups: int = 0) -> dict[str, float]:
        """Rollout metrics since the last step; ``step`` is the trainer's version now.

        ``dropped_groups``: groups the store dropped since the last step; their admission
        places go back to the dispatcher.
        """
        if dropped_groups:
            self.dispatcher.credit(dropped_groups)
        state = self.dispatcher.drain()
        t = state["totals"]
        metrics: dict[str, float] = {}
        if t.samples:
            metrics.update(
                {
                    "rollout/reward": t.reward_sum / t.samples,
                    "rollout/accuracy": t.correct / t.samples,
                    "rollout/response_length": t.tokens / t.samples,
                    "rollout/truncated": t.truncated / t.samples,
                    "rollout/reward_errors": float(t.reward_errors),
                    "rollout/groups": float(t.groups),
                    **reward_function_metrics(t.reward_metrics, t.samples - t.reward_errors),
                }
            )
        self.failures.show(t.reward_messages)
        metrics["rollout/repacked_groups"] = float(t.repacked)
        # Groups a dead worker held, started again from their prompt on another (episodes
        # of a multi-turn environment or an agent included).
        metrics["rollout/requeued_groups"], self.requeued = float(self.requeued), 0
        episodes: dict[str, float] = {}  # multi-turn counters, summed over the workers
        for w, c in state["workers"].items():
            before = self.last.get(w, {})
            if before.get("pid") != c["pid"]:  # a restarted worker counts from zero again
                log.info("rollout worker %d streams in process %d", w, int(c["pid"]))
                before = {}
            delta = {k: v - before.get(k, 0.0) for k, v in c.items()}
            busy, idle = delta["busy_s"], delta["idle_s"]
            if busy + idle > 0:
                metrics[f"rollout/worker{w}/idle_fraction"] = idle / (busy + idle)
            metrics[f"rollout/worker{w}/version_lag"] = step - c["version"]
            metrics[f"rollout/worker{w}/weight_pull_s"] = delta["pull_s"]
            metrics[f"rollout/worker{w}/weight_loads"] = delta["weight_loads"]
            for name, value in delta.items():
                if name in EPISODE_COUNTERS or name.startswith("tool_errors/"):
                    episodes[name] = episodes.get(name, 0.0) + value
            self.last[w] = c
        metrics.update(episode_metrics(episodes, t.samples))
        return metrics

    def pause(self) -> None:
        """Let every worker finish what it holds and return (held-out eval needs vLLM)."""
        self.stop()

    def resume(self) -> None:
        self.start()

    def stop(self) -> None:
        self.dispatcher.stop()
        for i, ref in enumerate(self.refs):
            if i in self.restarting:
                self._hand_back_stale(i)
                continue  # `check` or the next `start` gives it a stream once it is back
            try:
                self.wait(ref, "rollout workers to finish their running samples")
            except (RayActorError, RayTaskError) as error:  # no more work is given out
                self._lost(i, error, "no new work was being handed out")
        self.refs = []

    def placed(self, waiting: set[int]) -> None:
        """Workers no node has room for yet join like restarted ones once Ray places them."""
        self.restarting |= waiting

    def cursor(self) -> dict[str, Any]:
        return self.dispatcher.cursor()

    def restore(self, cursor: dict[str, Any], step: int, held_groups: int) -> None:
        admitted = step * self.cfg.rollout.prompts_per_step + held_groups
        self.dispatcher.restart_at(cursor, admitted, self.tag)


# What a worker counts of multi-turn episodes (``engines/rollout/sample_runner.py``).
EPISODE_COUNTERS = ("env_steps", "env_s", "env_tokens", "tool_calls", "episodes_cut")


def episode_metrics(counts: dict[str, float], episodes: int) -> dict[str, float]:
    """``rollout/episode/*`` from the summed counters of a multi-turn run (none otherwise):
    turns per episode, environment seconds per turn, the environment's (masked) tokens and
    tool calls per episode, tool errors by kind, episodes cut at a limit."""
    if not counts.get("env_steps") or not episodes:
        return {}
    steps = counts["env_steps"]
    out = {
        "rollout/episode/turns": steps / episodes,
        "rollout/episode/env_s_per_turn": counts.get("env_s", 0.0) / steps,
        "rollout/episode/env_tokens": counts.get("env_tokens", 0.0) / episodes,
        "rollout/episode/tool_calls": counts.get("tool_calls", 0.0) / episodes,
        "rollout/episode/cut": counts.get("episodes_cut", 0.0),
    }
    for name, value in counts.items():
        if name.startswith("tool_errors/"):
            out[f"rollout/episode/{name}"] = value
    return out


def stream_settings(cfg: RunConfig, worker: int) -> StreamSettings:
    """What worker ``worker``'s stream is told, from the ``rollout`` section."""
    r = cfg.rollout
    return StreamSettings(
        worker=worker,
        samples_per_prompt=r.samples_per_prompt,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        scale_by_std=cfg.train.scale_adv_by_std,
        concurrency=r.concurrency or r.prompts_per_step * r.samples_per_prompt,
        partial_rollout=r.partial_rollout,
        pull_timeout_s=cfg.weights.pull_timeout_s,
        repack_max_stragglers=r.repack_max_stragglers if r.repack else 0,
    )
