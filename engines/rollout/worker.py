"""The rollout worker: a Ray actor holding a rollout engine (vLLM), a scorer (the
environment's verifier, or user code in a reward pool), a trajectory-store producer and a
parameter-service puller.

The flow's rollouts (``driver/batch.py``, ``driver/stream.py``) drive it through
``RolloutWorkerClient``, in one of two ways:
- ``rollout`` (modes ``sync`` and ``one_step``): generate n completions for each prompt of
  a batch with the weights it holds, score them with the environment's verifier, compute
  group-relative advantages and put the groups into the trajectory store as one Arrow
  block, every token tagged with the policy version; only counts come back.
  ``sync_weights`` then loads the version the flow names from the parameter service.
- ``stream`` (mode ``async``): run until told to stop (``engines/rollout/stream_loop.py``),
  keeping vLLM's running batch full, taking prompt groups from the dispatcher as samples
  finish and loading newer weights between engine steps, never waiting on the trainer.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

import ray
import torch
from ray import ObjectRef

from sluice.config.tree import LoraConfig, RolloutConfig
from sluice.engines.agents.episodes import AgentEpisodes, AgentSpec
from sluice.engines.cluster.ray_cluster import gpus_each, pool_dtype, thread_env, visible_gpus
from sluice.engines.protocols import Completion, StreamingRolloutEngine
from sluice.engines.rollout.episodes import EpisodeSteps, StepSpec
from sluice.engines.rollout.messages import (
    BatchShard,
    PartialGroup,
    PartialSample,
    RolloutStats,
    Served,
    StreamSettings,
)
from sluice.engines.rollout.sample_runner import Play
from sluice.engines.rollout.scored import block_of, played_block, score_groups
from sluice.engines.rollout.stream_loop import RELAY_POLL_S, GroupSource, StreamLoop
from sluice.engines.rollout.vllm_engine import VLLMRolloutEngine
from sluice.envs import Environment, Problem, RewardResult
from sluice.envs.multi_turn import EpisodeLimits, is_multi_turn
from sluice.envs.scoring import Scorer, VerifierScorer
from sluice.rl.batching import Sample
from sluice.storage.faults import fault_point
from sluice.storage.params import ParameterError, ParameterService, Weights
from sluice.storage.trajectory_store import StoreClient
from sluice.storage.urls import Credentials

SCORING_THREADS = 8  # groups a stream scores at once with an isolated scorer


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
        # An isolated scorer waits on its processes: a stream scores on these threads while
        # the engine goes on decoding, several groups at once, so that a group whose reward
        # hangs holds back no other.
        self.scoring = (
            ThreadPoolExecutor(SCORING_THREADS, thread_name_prefix="score")
            if self.scorer.isolated
            else None
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
        # The digest of what the engine loaded of its version ("": none pulled yet).
        self.served_digest = ""
        # Running totals kept on the worker, so they survive a pause of the stream.
        self.stream_counters = {
            "busy_s": 0.0,
            "idle_s": 0.0,
            "pull_s": 0.0,
            "weight_loads": 0.0,
            "weight_pull_failures": 0.0,
        }

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
            block, stats = played_block(self.env.name, played, shard.credit)
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
            shard.credit,
        )
        self.store.put(block_of([rows]))
        return stats

    def load(self, weights: Weights) -> None:
        """Load a pulled version into the engine; the digest of what the engine read of it
        (all of it, checked bucket by bucket against the trainer's, or less) becomes the
        one this worker reports it serves."""
        self.engine.load_weights(weights, weights.version)
        self.served_digest = weights.loaded or ""

    def sync_weights(self, at_least: int = 0, timeout_s: float = 60.0) -> Served:
        """Load the newest published version; returns the version now loaded and the
        digest of what the engine loaded (the driver compares it with the published one).

        With ``at_least``, wait (up to ``timeout_s``) until the relay holds that version: a
        publish returns before the relay has taken the version, so a pull right behind it
        can still find the previous one.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            found = self.params.pull(after=self.engine.version(), timeout=max(left, 0.001))
            if found is not None:
                self.load(found)
                found = None  # the version may go from the object store once the relay drops it
            if self.engine.version() >= at_least:
                return Served(self.engine.version(), self.served_digest)
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
        return StreamLoop(self, source, settings).loop()


RolloutWorkerActor = ray.remote(RolloutWorker)


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

    def sync_weights(self, at_least: int, timeout_s: float) -> ObjectRef[Served]:
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
