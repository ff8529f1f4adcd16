"""The live pools of one attempt at a training segment: opened, waited on, checkpointed,
closed by the flow's tasks (``tasks/job.py``) and stepped by the flow (``flows/rl_job.py``).

A ``Session`` owns the Ray actors the run needs: the trajectory store, the parameter
service, the trainer, the rollout workers and (``async``) the dispatcher. ``open`` starts
them, fresh or from a checkpoint, and ``start`` sets the rollouts going; ``wait`` waits for
Ray refs while restarting dead rollout workers; ``evaluate`` measures held-out accuracy;
``checkpoint`` writes the trainer's state with the data cursor and the ledger watermark;
``close`` kills every actor; ``control_plane``, after each step and before each weight sync,
logs a restart in place of the trajectory store and has the trainer publish again for a
relay 0 that restarted. How rollouts are driven is the mode's (``driver/modes.py``):
``batch`` in ``sync`` and ``one_step``, ``stream`` in ``async``. Nothing here knows about
Prefect.

Resuming from a checkpoint at step S: the ledger is rolled back to the checkpoint's
watermark (events after it describe training whose weights were lost), the store re-offers
what was generated before it and drops what came after (its prompts are drawn again), the
trainer loads the checkpoint and publishes version S, rollout workers pull it, and the
prompt stream continues from the checkpoint's cursor. Sample ids of the new attempt carry
a tag (``a1.``, ``a2.``...) so they never collide with rolled-back ones. In ``async`` the
groups in flight at the checkpoint, saved with it, go on from their tokens
(``engines/rollout/in_flight.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    ObjectLostError,
    RayActorError,
    RayTaskError,
)
from ray.util.placement_group import PlacementGroup, remove_placement_group

from sluice.config.tree import ConfigError, LoraConfig, RunConfig
from sluice.driver.batch import BatchRollouts
from sluice.driver.environment import (
    agent_spec,
    episode_limits,
    eval_tokens,
    fitting,
    make_environment,
    max_model_len,
    plays_episodes,
    scorer_factory,
    step_spec,
)
from sluice.driver.health import LearningHealth
from sluice.driver.held_out import evaluate
from sluice.driver.modes import Rollouts, schedule
from sluice.driver.step_log import StoreMetrics, Totals
from sluice.driver.stream import StreamRollouts
from sluice.driver.tracking import MetricLogger
from sluice.driver.weight_sync import ServedWeights, SyncWatch
from sluice.engines.cluster.placement import wait_placed
from sluice.engines.cluster.ray_cluster import child_env, gpus_each, on_driver_node, pool_dtype
from sluice.engines.reward_models.served import launch_served
from sluice.engines.rollout import in_flight
from sluice.engines.rollout.dispatcher import launch_dispatcher
from sluice.engines.rollout.in_flight import Carried
from sluice.engines.rollout.messages import Handoff
from sluice.engines.rollout.worker import RolloutWorkerClient, launch_rollout_workers
from sluice.engines.train.lora import ADAPTER_FILE
from sluice.engines.train.pool import TrainerPool, launch_trainer
from sluice.engines.train.trainer import MODEL_FILE
from sluice.envs.prompts import training_prompts
from sluice.storage.checkpoints import Checkpoint, CheckpointError, CheckpointStore
from sluice.storage.layout import RunLayout
from sluice.storage.ledger import Ledger
from sluice.storage.params import ParameterService
from sluice.storage.trajectory_index import LeaseGrant
from sluice.storage.trajectory_store import PROGRESS_EVERY_S, StoreClient, create_store

log = logging.getLogger("sluice")

# ray.kill is asynchronous; closing a session waits this long for its actors to be gone.
ACTOR_EXIT_TIMEOUT_S = 30.0
# Mean per-token log-prob differences between the trainer and a rollout engine on the same
# tokens and version that are warned about: float32 engines agree to about 1e-7 here, bf16
# ones to about 1e-2 (docs/results.md); a push that missed one tensor differed by 6e-3.
MISMATCH_FLOAT32, MISMATCH_BF16 = 1e-3, 0.05
# How often a wait looks for dead rollout workers (progress lines come every PROGRESS_EVERY_S).
CHECK_EVERY_S = 1.0
# Times one step leases its batch again after its rows were lost with a restarted store.
RELEASES = 3


@dataclass
class DropWatch:
    """One wait's samples the store dropped, from its ``dropped`` count at the start: says
    once when they reach a batch (``Session.ready``, under dynamic sampling)."""

    batch: int
    start: int
    told: bool = False

    def first_batch(self, dropped: int) -> int:
        """The drops since the start the first time they reach ``batch``, else 0. A store
        restarted in place counts from zero again: the count starts over with it."""
        if dropped < self.start:
            self.start = 0
        if self.told or dropped - self.start < self.batch:
            return 0
        self.told = True
        return dropped - self.start


class Session:
    """The pools of one attempt at training; see the module docstring."""

    # The mode's rollouts, set by ``open``: one batch a step, or streams (``driver/modes.py``).
    batch: BatchRollouts | None = None
    stream: StreamRollouts | None = None

    def __init__(self, cfg: RunConfig, policy_dir: str, tracker: MetricLogger) -> None:
        self.cfg, self.policy_dir, self.tracker = cfg, policy_dir, tracker
        self.layout = RunLayout(cfg.run_dir, cfg.cache_dir)
        self.schedule = schedule(cfg)
        self.env, _ = make_environment(cfg.env, cfg.policy)
        # A judge's or reward model's actors, loading while the other pools start.
        self.reward_models = (
            launch_served(cfg.reward.served, cfg.seed, child_env())
            if cfg.reward.served is not None
            else None
        )
        self.make_scorer = scorer_factory(self.env, cfg.reward, cfg.env, self.reward_models)
        self.scorer = self.make_scorer()  # the driver's, for held-out evaluation
        self.heldout = self.env.problems("heldout", cfg.eval.prompts, cfg.seed + 1)
        self.eval_tokens = eval_tokens(cfg, self.heldout)
        self.batch_size = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
        self.step = 0  # the trainer's version
        self.start_accuracy: float | None = None
        self.end_accuracy: float | None = None
        self.health = LearningHealth(
            cfg.eval.collapse_drop, cfg.eval.entropy_floor, cfg.eval.collapse_patience
        )
        self.totals = Totals()
        self.sync = SyncWatch()  # each weight load's seconds (driver/weight_sync.py)
        self.store_metrics = StoreMetrics()
        self.actors: list[Any] = []
        self.groups: list[PlacementGroup] = []
        self.incarnations = {"store": 0, "relay": 0}  # see ``control_plane``
        # The store's drop counter as last read, and dropped samples not yet credited back
        # to admission as whole groups (``drops_to_credit``).
        self.drops_seen = self.drops_owed = 0

    # -- lifecycle -------------------------------------------------------------------------

    def open(self, checkpoint: Checkpoint | None, again: bool = False) -> None:
        """Start the pools: fresh, or continuing from ``checkpoint``. ``again``: an earlier
        attempt of this run failed before any checkpoint; whatever it recorded is set aside."""
        cfg, tag, carried = self.cfg, "", None
        if checkpoint is not None:
            tag = self._roll_back(int(checkpoint.meta["ledger_watermark"]), checkpoint.step)
            carried = self._kept_in_flight(checkpoint)
        elif again:
            tag = self._roll_back(0, 0)
        reasons = carried.reasons(cfg.max_staleness) if carried else None
        self._launch(
            restore="checkpoint" if checkpoint is not None else False, tag=tag, carried=reasons
        )
        self._wait_placed()
        if self.reward_models is not None:
            self.reward_models.wait_loaded()
        pids = self.trainer.pids()
        trainer = f"the trainer (pid {pids[0]})"
        if len(pids) > 1:
            trainer = f"{len(pids)} trainer ranks (pids {', '.join(map(str, pids))})"
        engine = {
            "torch": "torch DDP" if len(pids) > 1 else "torch",
            "fsdp": "torch FSDP2",
            "deepspeed": f"deepspeed ZeRO-{cfg.train.zero_stage}",
        }[cfg.train.engine]
        live = self.rollouts.live()
        log.info(
            "starting %d rollout worker(s) (pids %s) and %s on %s; vLLM takes ~30 s",
            len(live),
            ", ".join(map(str, ray.get([w.pid() for w in live]))),
            trainer,
            engine,
        )
        self.trainer.start(cfg.rollout.placement_timeout_s)
        seen = ray.get([self.trainer.devices(), *(w.devices() for w in live)])
        if any(d != "cpu" for d in seen):
            log.info(
                "devices (CUDA_VISIBLE_DEVICES): the trainer %s; rollout workers %s",
                seen[0],
                ", ".join(seen[1:]),
            )
        if checkpoint is None:
            held_out = self._held_out(live) | self.logprob_check(live)
            self.start_accuracy = self.end_accuracy = held_out["eval/accuracy"]
            self.health.held_out(0, self.start_accuracy)
            log.info(
                "step    0/%d | held-out %5.1f%% (starting policy)",
                cfg.train.steps,
                100 * self.start_accuracy,
            )
            self.tracker.log_metrics(0, held_out)
        else:
            meta = checkpoint.meta
            self.step = int(ray.get(self.trainer.restore(checkpoint.files, meta)))
            self.start_accuracy = meta.get("start_accuracy")
            self.end_accuracy = meta.get("end_accuracy")
            self.health.restore(meta.get("health") or {})
            self.synced(live)
            held_groups = int(self.store.stats()["held"]) // cfg.rollout.samples_per_prompt
            self.rollouts.restore(meta["data_cursor"], self.step, held_groups)
            if carried is not None:
                self._carry_on(carried)
            log.info("resumed at step %d from %s", self.step, checkpoint.url)

    def start(self) -> None:
        """Start generating (after ``open``; a fresh run checkpoints step 0 in between)."""
        self.rollouts.start()

    def close(self) -> None:
        """Kill every actor this session started, and wait until they are gone: a store
        still flushing its ledger must not write after a resume has rolled the ledger back."""
        self.scorer.close()
        if self.reward_models is not None:
            self.actors += self.reward_models.handles
            self.reward_models = None
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for group in self.groups:
            remove_placement_group(group)  # the trainer ranks' resources, back to the cluster
        self.groups = []
        deadline = time.monotonic() + ACTOR_EXIT_TIMEOUT_S
        for actor in self.actors:
            while time.monotonic() < deadline:
                try:
                    ray.get(actor.__ray_ready__.remote(), timeout=1.0)
                except RayActorError:
                    break
                except GetTimeoutError:
                    continue
                time.sleep(0.1)
        self.actors = []

    def _wait_placed(self) -> None:
        """Wait for Ray to place the trainer and the rollout workers the mode needs; the
        others join when a node has room for them (``StreamRollouts.placed``)."""
        cfg, r = self.cfg, self.cfg.rollout
        names = [f"rollout worker {i}" for i in range(len(self.workers))]
        handles = [w.handle for w in self.workers]
        ranks = self.trainer.handles
        trainers = (
            ["the trainer"] if len(ranks) == 1 else [f"trainer rank {i}" for i in range(len(ranks))]
        )
        train_ask = _ask(cfg.train.cpus, self.train_gpus, cfg.train.resources)
        actors = {
            **dict(zip(trainers, ranks, strict=True)),
            **dict(zip(names, handles, strict=True)),
        }
        asks = {
            **dict.fromkeys(trainers, train_ask),
            **{name: _ask(r.cpus_per_worker, self.worker_gpus, r.resources) for name in names},
        }
        need = self.schedule.min_workers

        def enough(pending: set[str]) -> bool:
            return not pending & set(trainers) and len(set(names) - pending) >= need

        pending = wait_placed(actors, asks, enough, r.placement_timeout_s)
        if self.stream is not None:  # the batch modes waited for every worker
            self.stream.placed({names.index(name) for name in pending})

    def _kept_in_flight(self, checkpoint: Checkpoint) -> Carried | None:
        """The groups ``checkpoint`` kept in flight that an ``async`` run may continue
        (``engines/rollout/in_flight.py``); None when there are none to continue."""
        cfg = self.cfg
        if not self.schedule.streaming or in_flight.FILE not in checkpoint.files:
            return None
        try:
            groups = in_flight.decode(checkpoint.files[in_flight.FILE])
        except in_flight.InFlightError as error:
            log.warning(
                "the groups in flight saved with checkpoint step-%d are not continued (%s); "
                "they start over",
                checkpoint.step,
                error,
            )
            return None
        return in_flight.split_stale(groups, checkpoint.step, cfg.max_staleness, cfg.stale_by)

    def _carry_on(self, carried: Carried) -> None:
        """Continue the kept groups whose old ids the store ended (none of their rows were
        stored before the checkpoint); the prompts of those too stale are drawn again."""
        assert self.stream is not None
        ended = set(ray.get(self.store.handle.carried.remote()))

        def ours(groups: list[Handoff]) -> list[Handoff]:
            return [
                h
                for h in groups
                if all(f"{h.group_id}/{s.index}" in ended for s in h.group.samples)
            ]

        fresh, stale = ours(carried.fresh), ours(carried.stale)
        self.stream.dispatcher.carry_on(fresh, [h.group.problem for h in stale])
        tokens = sum(len(s.token_ids) for h in fresh for s in h.group.samples)
        log.info(
            "%d groups in flight at the checkpoint go on from their %d tokens; %d too stale "
            "to continue start over from their prompts",
            len(fresh),
            tokens,
            len(stale),
        )

    def _roll_back(self, watermark: int, step: int) -> str:
        """Set ledger files after ``watermark`` aside; the new attempt's id tag."""
        attempt, where, moved = Ledger(self.cfg.storage_url).roll_back(watermark, step)
        log.info(
            "resuming from step %d: %d ledger file(s) written after it moved to %s",
            step,
            moved,
            where,
        )
        return f"a{attempt}."

    # -- what a step uses ------------------------------------------------------------------

    @property
    def rollouts(self) -> Rollouts:
        """The mode's rollouts, through what both modes do."""
        found = self.stream or self.batch
        assert found is not None, "the session is not open"
        return found

    def train(self, step: int) -> tuple[dict[str, float], float]:
        """Lease a batch, train on it and acknowledge it: the trainer's metrics, and when the
        lease was granted. The trainer publishes version ``step`` to the parameter service
        before it answers, so a trained sample always has one behind it.

        A batch whose rows were lost before the trainer read them (the trajectory store
        restarted in place: the rows lived in its dead process's objects) is leased again
        from the restarted store, which re-offers them; the trainer had changed nothing."""
        for attempt in range(1, RELEASES + 2):
            lease = self.lease()  # B samples in whole groups, none staler than max_staleness
            leased = time.monotonic()
            try:
                trained: dict[str, float] = self.wait(self.trainer.train(lease), "the trainer")
            except (RayTaskError, ObjectLostError) as error:
                if attempt > RELEASES or not _rows_lost(error):
                    raise
                log.warning(
                    "step %d: the batch's rows were lost before the trainer read them (%s); "
                    "leasing it again from the restarted trajectory store",
                    step,
                    type(getattr(error, "cause", error)).__name__,
                )
                continue
            break
        self.store.ack(lease, step)  # the ledger: these samples were trained at version `step`
        self.control_plane()
        return trained, leased

    def control_plane(self) -> None:
        """Look for restarts in place of the trajectory store and relay 0: log them, and
        have the trainer publish its version again for a relay 0 that lost it."""
        incarnation, restored = ray.get(self.store.handle.restart.remote())
        if restored and incarnation != self.incarnations["store"]:
            log.warning("%s (store.max_restarts=%d)", restored, self.cfg.store.max_restarts)
        self.incarnations["store"] = incarnation
        incarnation = self.params.relay_incarnation()
        if self.incarnations["relay"] and incarnation != self.incarnations["relay"]:
            version = self.wait(self.trainer.republish(), "the trainer to publish again")
            log.warning(
                "relay 0 restarted in place; the trainer published version %d again "
                "(weights.max_restarts=%d)",
                version,
                self.cfg.weights.max_restarts,
            )
        self.incarnations["relay"] = incarnation

    def wait(self, refs: Any, what: str) -> Any:
        """``ray.get(refs)``; meanwhile restarts dead rollout workers, and logs progress."""
        pending = refs if isinstance(refs, list) else [refs]
        self.ready(pending, len(pending), what)
        return ray.get(refs)

    def ready(self, refs: list[Any], need: int, what: str) -> list[Any]:
        """The first ``need`` of ``refs`` that finish (or fail), waited for like ``wait``."""
        started = last_line = time.monotonic()
        drops = None
        if self.cfg.train.dynamic_sampling and self.stream is not None:
            drops = DropWatch(self.batch_size, int(self.store.stats()["dropped"]))
        while len(done := ray.wait(refs, num_returns=need, timeout=CHECK_EVERY_S)[0]) < need:
            if self.stream is not None:  # restart dead workers' streams while waiting
                self.stream.check()
                # A lease that waits drops stale groups: their admission places must come
                # back now, not after the step, or nothing more is let start to fill it.
                if groups := self.drops_to_credit(self.store.stats()):
                    self.stream.dispatcher.credit(groups)
            if time.monotonic() - last_line >= PROGRESS_EVERY_S:
                last_line = time.monotonic()
                stats = self.store.stats()
                log.info(
                    "waiting for %s for %.0f s; trajectory store: %s",
                    what,
                    last_line - started,
                    stats,
                )
                if drops is not None and (dropped := drops.first_batch(int(stats["dropped"]))):
                    log.warning(
                        "the store dropped %d samples while waiting for %s, a batch's worth: "
                        "under train.dynamic_sampling a group whose rewards are all equal is "
                        "dropped, and a policy that always or never solves the task leaves "
                        "nothing to train on (the ledger gives each drop's reason)",
                        dropped,
                        what,
                    )
        return done

    def drops_to_credit(self, stats: dict[str, int]) -> int:
        """Whole groups the store dropped since the last call (from its ``stats``), whose
        places in the admission window go back to the dispatcher (``async``)."""
        dropped = int(stats["dropped"])  # a store restarted in place counts from zero
        self.drops_owed += dropped - self.drops_seen if dropped >= self.drops_seen else dropped
        self.drops_seen = dropped
        groups, self.drops_owed = divmod(self.drops_owed, self.cfg.rollout.samples_per_prompt)
        return groups

    def synced(self, workers: list[RolloutWorkerClient]) -> list[RolloutWorkerClient]:
        """``workers`` after each loaded the trainer's version, less any that died doing so.
        The rollouts hear of a death as it happens, not after the others loaded (those may
        wait on the trainer): Ray restarts the worker, and the new process pulls the newest
        weights before it generates."""
        self.control_plane()  # relay 0 holds the version to load
        timeout = self.cfg.weights.pull_timeout_s
        loading = {w.sync_weights(self.step, timeout): w for w in workers}
        loaded = dict(loading)
        while loading:
            for ref in self.ready(list(loading), 1, "weights"):
                worker = loading.pop(ref)
                try:
                    served = ray.get(ref)
                except RayActorError as error:  # ActorUnavailableError is one
                    self.rollouts.died_loading(worker, self.step, error)
                    del loaded[ref]
                    continue
                for warning in self.served.loaded(self.workers.index(worker), served, self.step):
                    log.warning(warning)
        return list(loaded.values())

    def lease(self) -> LeaseGrant:
        """A training batch from the store: ``batch_size`` samples in whole groups, none
        more than the mode's ``max_staleness`` versions behind the trainer. Only where the
        rows live comes here; the trainer reads them."""
        timeout = self.cfg.store.lease_timeout_s
        ask = self.store.request(
            self.batch_size, self.step, self.schedule.max_staleness, wait_s=timeout
        )
        grant: LeaseGrant | None = self.wait(ask, f"{self.batch_size} ready samples")
        if grant is None:
            raise TimeoutError(
                f"no {self.batch_size} ready samples within {timeout:.0f} s (store: "
                f"{self.store.stats()}); are the rollout workers alive?"
            )
        return grant

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the trainer's current version (``eval/accuracy``, and with
        ``eval.k > 1`` mean@k and pass@k)."""
        self.store.drain(True)  # nothing consumes while paused: puts must not wait for room
        if self.stream is not None:
            self.stream.stop()  # the workers hand vLLM back, then load the version
        workers = self.synced(self.rollouts.live())  # async: one whose node is gone is out
        held_out = self._held_out(workers) | self.logprob_check(workers)
        self.store.drain(False)
        if self.stream is not None:
            self.stream.start()
        return held_out

    def logprob_check(self, workers: list[RolloutWorkerClient]) -> dict[str, float]:
        """The trainer's log-probs of tokens a rollout worker has just sampled against the
        worker's own, with both on the same version (the workers are synced): the mean and
        largest difference per token (``eval/logprob_mismatch``, ``..._max``). Two engines
        that agree differ by rounding (float32: about 1e-7; bf16: about 1e-2); a weight push
        that lost or mangled a tensor, or a precision the config did not ask for, shows here
        before it shows in learning. Peers gate their CI on it; ``make test`` does too."""
        e = self.cfg.eval
        if not e.mismatch_prompts or not workers:
            return {}
        prompts = [p.prompt for p in self.heldout[: e.mismatch_prompts]]
        seed = self.cfg.seed * 1_000_003 + self.step
        temperature, step = self.cfg.rollout.temperature, self.step
        try:
            samples = ray.get(
                workers[0].sampled(prompts, self.eval_tokens, temperature, seed, step)
            )
        except (RayActorError, ActorUnavailableError) as error:
            log.warning("log-prob check skipped: its rollout worker died (%s)", error)
            return {}
        if not samples:  # the worker restarted and does not hold this version yet
            log.warning("log-prob check skipped: its rollout worker is not at version %d", step)
            return {}
        trained = ray.get(self.trainer.logprobs(samples))
        diffs = [
            abs(a - b)
            for sample, theirs in zip(samples, trained, strict=True)
            for a, b in zip(sample.behaviour_logprobs, theirs, strict=True)
        ]
        mean, bound = sum(diffs) / len(diffs), self.mismatch_bound()
        if mean > bound:
            log.warning(
                "the trainer and the rollout engine disagree at version %d: log-probs of the "
                "same tokens differ by %.2e on average (max %.2e; eval.max_logprob_mismatch is "
                "%.2e): check the weight push and both engines' dtype",
                self.step,
                mean,
                max(diffs),
                bound,
            )
        return {"eval/logprob_mismatch": mean, "eval/logprob_mismatch_max": max(diffs)}

    def mismatch_bound(self) -> float:
        """``eval.max_logprob_mismatch``, or what suits the two pools' precision."""
        if self.cfg.eval.max_logprob_mismatch is not None:
            return self.cfg.eval.max_logprob_mismatch
        dtypes = {
            pool_dtype(self.cfg.rollout.dtype, self.worker_gpus),
            pool_dtype(self.cfg.train.dtype, self.train_gpus),
        }
        return MISMATCH_FLOAT32 if dtypes == {"float32"} else MISMATCH_BF16

    def _held_out(self, workers: list[RolloutWorkerClient]) -> dict[str, float]:
        e = self.cfg.eval
        return evaluate(
            workers,
            self.scorer,
            self.heldout,
            self.eval_tokens,
            e.k,
            e.temperature,
            episodes=plays_episodes(self.cfg),
        )

    def checkpoint(self) -> str:
        """Model, optimiser and RNG (written by the trainer) with the data cursor, the
        ledger's watermark and (``async``) the groups in flight as they stand."""
        kept = []
        if self.stream is not None and self.cfg.checkpoint.keep_in_flight:
            kept = self.stream.in_flight()  # before the watermark: see in_flight.py
        watermark = ray.get(self.store.handle.flush.remote())
        meta = {
            "step": self.step,
            "ledger_watermark": watermark,
            "data_cursor": self.rollouts.cursor(),
            "start_accuracy": self.start_accuracy,
            "end_accuracy": self.end_accuracy,
            "health": self.health.state(),
            "mlflow_run_id": self.tracker.run_id,
            # A LoRA checkpoint holds the adapter alone: what it adapts, and how.
            "lora": adapter_meta(self.cfg.train.lora),
            "base_model": self.policy_dir,
            "in_flight_groups": len(kept),
        }
        extra = {in_flight.FILE: in_flight.encode(kept)} if kept else {}
        url: str = ray.get(
            self.trainer.save_checkpoint(
                self.cfg.storage_url, self.cfg.checkpoint.keep, self.step, meta, extra
            )
        )
        log.info("checkpoint %s", url)
        return url

    def save_policy(self, policy_dir: str) -> None:
        """Write the trainer's current policy as a model folder (replaced whole if there)."""
        ray.get(self.trainer.save(policy_dir))

    def finish(self, policy_dir: str) -> int:
        """Stop the rollouts, drop what is left untrained (recorded), save the policy."""
        self.store.drain(True)  # the workers finish what they hold; nothing consumes it
        if self.stream is not None:  # a batch run collected its last batch in its last step
            self.stream.stop()
        left = int(ray.get(self.store.handle.close.remote("the run ended before it was trained")))
        if left:
            log.info("%d generated samples were left untrained (recorded as dropped)", left)
        self.save_policy(policy_dir)
        return left

    # -- wiring ----------------------------------------------------------------------------

    def _launch(self, restore: bool | str, tag: str, carried: dict[str, str] | None) -> None:
        """The trajectory store, the parameter service, the trainer, the rollout workers,
        (``async``) the dispatcher, and the mode's rollouts over them. ``carried``: the
        samples a checkpoint kept in flight, and why their old ids end (``create_store``)."""
        cfg, env_vars, here = self.cfg, child_env(), on_driver_node()
        streaming = self.schedule.streaming
        # Resolved once: the actors and the placement messages ask for the same GPUs.
        self.train_gpus = gpus_each(cfg.train.gpus_per_rank)
        self.worker_gpus = gpus_each(cfg.rollout.gpus_per_worker, cfg.rollout.tensor_parallel_size)
        handle = create_store(
            cfg.storage_url,
            cfg.store_capacity_batches * self.batch_size,
            cfg.store.lease_timeout_s,
            restore=restore,
            scheduling_strategy=here,
            stale_by=cfg.stale_by,
            max_restarts=cfg.store.max_restarts,
            carried=carried,
            drop_uniform=cfg.train.dynamic_sampling,
        )
        self.store = StoreClient(
            handle,
            cfg.storage_url,
            # async: rows reach storage in files of one training batch, not one per put, and
            # a worker goes on generating while the store takes its last two puts.
            persist_rows=self.batch_size if streaming else 0,
            pipeline=2 if streaming else 0,
        )
        self.params = params = ParameterService.create(
            relays=cfg.weights.relays,
            max_restarts=cfg.weights.max_restarts,
            bucket_bytes=cfg.weights.bucket_mib << 20,
            first_at=here,
            # weights travel in the dtype vLLM runs in
            dtype=pool_dtype(cfg.rollout.dtype, self.worker_gpus),
        )
        self.trainer: TrainerPool = launch_trainer(
            cfg.train,
            self.policy_dir,
            cfg.seed,
            params,
            env_vars,
            self.train_gpus,
            temperature=cfg.rollout.temperature,
        )
        self.workers: list[RolloutWorkerClient] = launch_rollout_workers(
            cfg.rollout,
            self.policy_dir,
            max_model_len(cfg.policy),
            cfg.seed,
            self.env,
            self.store,
            params,
            env_vars,
            gpus=self.worker_gpus,
            scorer=self.make_scorer,
            limits=episode_limits(cfg.env),
            agent=agent_spec(cfg),
            steps=step_spec(cfg),
            lora=cfg.train.lora,
        )
        self.actors = [handle, *self.trainer.handles, *(w.handle for w in self.workers)]
        self.groups = [self.trainer.group] if self.trainer.group is not None else []
        self.actors += params.relays
        self.served = ServedWeights(params.published_digest, cfg.weights.pull_timeout_s)
        train_seed = cfg.seed if cfg.env.train_seed is None else cfg.env.train_seed
        prompts, self.heldout = fitting(
            cfg,
            training_prompts(self.env, cfg.env.train_prompts, train_seed),
            self.heldout,
            self.store,
        )
        if streaming:
            dispatcher = launch_dispatcher(cfg, self.store, prompts, self.env.name)
            self.actors.append(dispatcher.handle)
            self.stream = StreamRollouts(cfg, self.workers, dispatcher, self.wait, self.served, tag)
        else:
            lag = self.schedule.max_staleness
            self.batch = BatchRollouts(cfg, self.workers, prompts, self.wait, self.served, tag, lag)


def _rows_lost(error: Exception) -> bool:
    """Whether the trainer failed because a leased block's object was gone."""
    return isinstance(error, ObjectLostError) or isinstance(
        getattr(error, "cause", None), ObjectLostError
    )


def _ask(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    """What an actor asks Ray for, as the placement messages show it (GPUs when any)."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **resources}


def latest_checkpoint(cfg: RunConfig) -> Checkpoint | None:
    """The newest valid checkpoint of this run (older ones if the newest is broken), once
    it is known to fit the config's ``train.lora``."""
    found = CheckpointStore(cfg.storage_url, cfg.checkpoint.keep).load_latest(check_meta)
    if found is not None:
        check_lora(found, cfg)
    return found


def adapter_meta(lora: LoraConfig | None) -> dict[str, Any] | None:
    """What fixes an adapter's shape, as a checkpoint records it (None: full weights)."""
    return None if lora is None else {"rank": lora.rank, "target_modules": lora.target_modules}


def check_lora(found: Checkpoint, cfg: RunConfig) -> None:
    """Raise a ConfigError when the checkpoint's kind (adapter or full weights, and the
    adapter's shape) is not the one ``cfg.train.lora`` trains: before any pool starts."""
    want = adapter_meta(cfg.train.lora)
    has = found.meta.get("lora") if ADAPTER_FILE in found.files else None
    where = f"checkpoint step-{found.step} of run {cfg.name!r}"
    if want is None and ADAPTER_FILE in found.files:
        raise ConfigError(
            f"{where} holds a LoRA adapter ({has}) over {found.meta.get('base_model')}: resume "
            f"it with train.lora set as that run had it"
        )
    if want is not None and has is None:
        raise ConfigError(
            f"{where} holds full weights (a run without train.lora): resume it without "
            "train.lora, or start a LoRA run under a new name"
        )
    if want is not None and has != want:
        raise ConfigError(
            f"{where} holds an adapter of {has}, but train.lora asks for {want}: set "
            "train.lora.rank and train.lora.target_modules as that run had them"
        )


def check_meta(found: Checkpoint) -> None:
    """What a resume reads of a checkpoint's meta is there and of the right kind: the
    session's step, watermark and data cursor, the trainer's version and schedule."""
    meta = found.meta

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"its meta {why}")

    for key in ("step", "version", "ledger_watermark"):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad(f"has no non-negative integer {key!r} (got {value!r})")
    if meta["step"] != found.step or meta["version"] != found.step:
        raise bad(f"says step {meta['step']} and version {meta['version']}, not {found.step}")
    if not isinstance(meta.get("data_cursor"), dict):
        raise bad("has no data cursor")
    if not isinstance(meta.get("scheduler"), dict):
        raise bad("has no learning-rate schedule state")
    if MODEL_FILE not in found.files and ADAPTER_FILE not in found.files:
        raise bad(f"lists no {MODEL_FILE} (nor a LoRA {ADAPTER_FILE})")
