"""The live pools of one RL job, and the step they take: driven by the flow's segment tasks.

A ``Session`` owns, for one attempt at a segment of training, the Ray actors the run
needs: the trajectory store, the parameter service, the trainer, the rollout workers and
(``async``) the dispatcher. ``open`` starts them, fresh or from a checkpoint, and ``start``
sets the rollouts going; ``train_step``
is one RL step; ``checkpoint`` writes the trainer's state with the data cursor and the
ledger watermark; ``close`` kills every actor. The flow (``flows/rl_job.py``) composes these
into Prefect tasks; nothing here knows about Prefect.

Resuming from a checkpoint at step S: the ledger is rolled back to the checkpoint's
watermark (events after it describe training whose weights were lost), the store re-offers
what was generated before it and drops what came after (its prompts are drawn again), the
trainer loads the checkpoint and publishes version S, rollout workers pull it, and the
prompt stream continues from the checkpoint's cursor. Sample ids of the new attempt carry
a tag (``a1.``, ``a2.``...) so they never collide with rolled-back ones.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from sluice.engines.pools import child_env, launch_rollout_workers, launch_trainer, on_driver_node
from sluice.engines.rollout_worker import StreamSettings
from sluice.rl.config import RunConfig
from sluice.storage.checkpoints import Checkpoint, CheckpointStore
from sluice.storage.ledger import Ledger
from sluice.storage.params import ParameterService
from sluice.storage.trajectory_store import PROGRESS_EVERY_S, StoreClient, create_store
from sluice.tasks.dispatcher import Dispatcher
from sluice.tasks.environment import PromptStream, make_environment
from sluice.tasks.placement import wait_placed
from sluice.tasks.rollout import BatchRollouts, BatchSettings, StreamRollouts, evaluate
from sluice.tasks.tracking import MetricLogger

log = logging.getLogger("sluice")

# ray.kill is asynchronous; closing a session waits this long for its actors to be gone.
ACTOR_EXIT_TIMEOUT_S = 30.0
# How often a wait looks for dead rollout workers (progress lines come every PROGRESS_EVERY_S).
CHECK_EVERY_S = 1.0


@dataclass
class Totals:
    """Throughput counters of the steps this process ran."""

    samples: int = 0
    tokens: int = 0
    loop_s: float = 0.0


class Session:
    """The pools of one attempt at training; see the module docstring."""

    def __init__(self, cfg: RunConfig, policy_dir: str, tracker: MetricLogger) -> None:
        self.cfg, self.policy_dir, self.tracker = cfg, policy_dir, tracker
        self.env, _ = make_environment(cfg.env)
        self.heldout = self.env.problems("heldout", cfg.eval.prompts, cfg.seed + 1)
        self.eval_tokens = max(len(p.answer) for p in self.heldout) + 4
        self.batch_size = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
        self.max_staleness = {"sync": 0, "one_step": 1, "async": cfg.max_staleness}[cfg.mode]
        self.step = 0
        self.start_accuracy: float | None = None
        self.end_accuracy: float | None = None
        self.totals = Totals()
        self.actors: list[Any] = []
        self._store_stats = _StoreMetrics()

    # -- lifecycle -------------------------------------------------------------------------

    def open(self, checkpoint: Checkpoint | None) -> None:
        """Start the pools: fresh, or continuing from ``checkpoint``."""
        cfg, tag = self.cfg, ""
        if checkpoint is not None:
            tag = self._roll_back(checkpoint)
        self.store, self.trainer, self.workers = self._launch(
            restore="checkpoint" if checkpoint is not None else False
        )
        self.rollouts = self._rollouts(tag)
        self._wait_placed()
        engine = cfg.train.engine
        if engine == "deepspeed":
            engine += f" ZeRO-{cfg.train.zero_stage}"
        live = self.rollouts.live()
        log.info(
            "starting %d rollout worker(s) (pids %s) and the trainer (pid %d) on %s; "
            "vLLM takes ~30 s",
            len(live),
            ", ".join(map(str, ray.get([w.pid.remote() for w in live]))),
            ray.get(self.trainer.pid.remote()),
            engine,
        )
        if checkpoint is None:
            self.start_accuracy = self.end_accuracy = evaluate(
                live, self.env, self.heldout, self.eval_tokens
            )
            log.info(
                "step    0/%d | held-out %5.1f%% (starting policy)",
                cfg.train.steps,
                100 * self.start_accuracy,
            )
            self.tracker.log_metrics(0, {"eval/accuracy": self.start_accuracy})
        else:
            meta = checkpoint.meta
            self.step = int(ray.get(self.trainer.restore.remote(checkpoint.files, meta)))
            self.start_accuracy = meta.get("start_accuracy")
            self.end_accuracy = meta.get("end_accuracy")
            timeout = cfg.weights.pull_timeout_s
            self.wait([w.sync_weights.remote(self.step, timeout) for w in live], "weights")
            self._restore_cursor(meta["data_cursor"])
            log.info("resumed at step %d from %s", self.step, checkpoint.url)

    def start(self) -> None:
        """Start generating (after ``open``; a fresh run checkpoints step 0 in between)."""
        self.rollouts.start()

    def close(self) -> None:
        """Kill every actor this session started, and wait until they are gone: a store
        still flushing its ledger must not write after a resume has rolled the ledger back."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
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
        """Wait for Ray to place the actors; async starts without rollout workers that no
        node has room for yet (they join like a restarted worker), the batch modes do not."""
        cfg, r = self.cfg, self.cfg.rollout
        names = [f"rollout worker {i}" for i in range(len(self.workers))]
        actors = {"the trainer": self.trainer, **dict(zip(names, self.workers, strict=True))}
        asks = {
            "the trainer": {"CPU": cfg.train.cpus, **cfg.train.resources},
            **{name: {"CPU": r.cpus_per_worker, **r.resources} for name in names},
        }
        # async starts with the trainer and one worker; the others join when placed.
        need = 1 if cfg.mode == "async" else len(names)

        def enough(pending: set[str]) -> bool:
            return "the trainer" not in pending and len(set(names) - pending) >= need

        pending = wait_placed(actors, asks, enough, r.placement_timeout_s)
        if isinstance(self.rollouts, StreamRollouts):
            self.rollouts.restarting |= {names.index(name) for name in pending}

    def _roll_back(self, checkpoint: Checkpoint) -> str:
        watermark = int(checkpoint.meta["ledger_watermark"])
        attempt, where, moved = Ledger(self.cfg.storage_url).roll_back(watermark, checkpoint.step)
        log.info(
            "resuming from checkpoint step %d: %d ledger file(s) written after it moved to %s",
            checkpoint.step,
            moved,
            where,
        )
        return f"a{attempt}."

    def _restore_cursor(self, cursor: dict[str, Any]) -> None:
        if isinstance(self.rollouts, BatchRollouts):
            self.rollouts.prompts.restore(cursor["prompts"])
            self.rollouts.step = self.step
            return
        held = int(self.store.stats()["held"])
        groups = self.step * self.cfg.rollout.prompts_per_step
        admitted = groups + held // self.cfg.rollout.samples_per_prompt
        ray.get(self.rollouts.dispatcher.restart_at.remote(cursor, admitted, self.rollouts.tag))

    # -- one step --------------------------------------------------------------------------

    def wait(self, refs: Any, what: str) -> Any:
        """``ray.get(refs)``; meanwhile restarts dead rollout workers, and logs progress."""
        pending = refs if isinstance(refs, list) else [refs]
        started = last_line = time.monotonic()
        while len(ray.wait(pending, num_returns=len(pending), timeout=CHECK_EVERY_S)[0]) < len(
            pending
        ):
            self.rollouts.check()
            if time.monotonic() - last_line >= PROGRESS_EVERY_S:
                last_line = time.monotonic()
                log.info(
                    "waiting for %s for %.0f s; trajectory store: %s",
                    what,
                    last_line - started,
                    self.store.stats(),
                )
        return ray.get(refs)

    def train_step(self) -> dict[str, float]:
        """One RL step; returns its metrics (already logged to the tracker and console)."""
        cfg, step = self.cfg, self.step + 1
        t0 = time.monotonic()
        self.rollouts.before_train(step, self.wait)  # batch modes: the step's groups are in
        t1 = time.monotonic()
        train = self.wait(  # lease -> one step -> publish the new version -> acknowledge
            self.trainer.train_from_store.remote(
                self.store, self.batch_size, self.max_staleness, cfg.store.lease_timeout_s
            ),
            "the trainer",
        )
        t2 = time.monotonic()
        self.rollouts.after_train(step, self.wait)  # batch modes: workers load version `step`
        t3 = time.monotonic()
        self.step = step
        self.totals.samples += int(train["samples"])
        self.totals.tokens += int(train["tokens"])
        self.totals.loop_s += t3 - t0
        store = self._store_stats.update(self.store.stats())
        dropped = int(store["store/dropped"]) // cfg.rollout.samples_per_prompt
        metrics = {
            **self.rollouts.drain(step, dropped),
            **_step_metrics(train, (t0, t1, t2, t3)),
            **store,
        }
        if step % cfg.eval.every == 0 or step == cfg.train.steps:
            self.end_accuracy = metrics["eval/accuracy"] = self.evaluate_now()
        self.tracker.log_metrics(step, metrics)
        log.info(_step_line(step, cfg.train.steps, metrics))
        return metrics

    def evaluate_now(self) -> float:
        """Held-out accuracy of the trainer's current version."""
        self.rollouts.pause(self.wait)  # async: workers hand vLLM back, then load the version
        timeout = self.cfg.weights.pull_timeout_s
        workers = self.rollouts.live()  # async: a worker whose node is gone is left out
        self.wait([w.sync_weights.remote(self.step, timeout) for w in workers], "weights")
        accuracy = evaluate(workers, self.env, self.heldout, self.eval_tokens)
        self.rollouts.resume()
        return accuracy

    def checkpoint(self) -> str:
        """Model, optimiser and RNG (written by the trainer) with the data cursor and watermark."""
        watermark = ray.get(self.store.handle.flush.remote())
        meta = {
            "step": self.step,
            "ledger_watermark": watermark,
            "data_cursor": self.rollouts.cursor(),
            "start_accuracy": self.start_accuracy,
            "end_accuracy": self.end_accuracy,
            "mlflow_run_id": self.tracker.run_id,
        }
        url: str = ray.get(
            self.trainer.save_checkpoint.remote(
                self.cfg.storage_url, self.cfg.checkpoint.keep, self.step, meta
            )
        )
        log.info("checkpoint %s", url)
        return url

    def finish(self, policy_dir: str) -> int:
        """Stop the rollouts, drop what is left untrained (recorded), save the policy."""
        self.rollouts.stop(self.wait)
        left = int(ray.get(self.store.handle.close.remote("the run ended before it was trained")))
        if left:
            log.info("%d generated samples were left untrained (recorded as dropped)", left)
        ray.get(self.trainer.save.remote(policy_dir))
        return left

    # -- wiring ----------------------------------------------------------------------------

    def _launch(self, restore: bool | str) -> tuple[StoreClient, Any, list[Any]]:
        """The trajectory store, the parameter service, the trainer and the rollout workers."""
        cfg, env_vars, here = self.cfg, child_env(), on_driver_node()
        streaming = cfg.mode == "async"
        handle = create_store(
            cfg.storage_url,
            cfg.store_capacity_batches * self.batch_size,
            cfg.store.lease_timeout_s,
            restore=restore,
            scheduling_strategy=here,
        )
        store = StoreClient(
            handle,
            cfg.storage_url,
            # async: rows reach storage in files of one training batch, not one per put, and
            # a worker goes on generating while the store takes its last two puts.
            persist_rows=self.batch_size if streaming else 0,
            pipeline=2 if streaming else 0,
        )
        params = ParameterService.create(
            relays=cfg.weights.relays,
            bucket_bytes=cfg.weights.bucket_mib << 20,
            first_at=here,
        )
        t = cfg.train
        trainer = launch_trainer(
            t.cpus,
            t.threads,
            env_vars,
            engine=t.engine,
            zero_stage=t.zero_stage,
            resources=t.resources,
            params=params,
            model_dir=self.policy_dir,
            lr=t.lr,
            clip_eps=t.clip_eps,
            warmup_steps=t.warmup_steps,
            entropy_coef=t.entropy_coef,
            grad_clip=t.grad_clip,
            betas=t.betas,
            weight_decay=t.weight_decay,
            micro_batch=t.micro_batch,
            micro_batch_tokens=t.micro_batch_tokens,
            loss=t.loss,
            is_cap=t.is_cap,
            seed=cfg.seed,
        )
        r = cfg.rollout
        workers = launch_rollout_workers(
            r.workers,
            r.cpus_per_worker,
            r.threads_per_worker,
            env_vars,
            max_restarts=r.max_restarts,
            resources=r.resources,
            env=self.env,
            store=store,
            params=params,
            model_dir=self.policy_dir,
            seed=cfg.seed,
            kv_cache_gib=r.kv_cache_gib,
            enforce_eager=r.enforce_eager,
            max_model_len=cfg.policy.max_positions,
        )
        self.actors = [handle, trainer, *workers, *params.relays]
        return store, trainer, workers

    def _rollouts(self, tag: str) -> BatchRollouts | StreamRollouts:
        cfg, r = self.cfg, self.cfg.rollout
        train_seed = cfg.seed if cfg.env.train_seed is None else cfg.env.train_seed
        prompts = PromptStream(self.env, cfg.env.train_prompts, train_seed)
        if cfg.mode != "async":
            settings = BatchSettings(
                steps=cfg.train.steps,
                prompts_per_step=r.prompts_per_step,
                samples_per_prompt=r.samples_per_prompt,
                max_new_tokens=r.max_new_tokens,
                temperature=r.temperature,
                seed=cfg.seed,
                scale_by_std=cfg.train.scale_adv_by_std,
                weight_pull_timeout_s=cfg.weights.pull_timeout_s,
                max_restarts=r.max_restarts,
                tag=tag,
            )
            return BatchRollouts(self.workers, prompts, settings, overlap=cfg.mode == "one_step")
        dispatcher = Dispatcher.options(  # type: ignore[attr-defined]
            scheduling_strategy=on_driver_node()
        ).remote(
            prompts,
            self.env.name,
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
        self.actors.append(dispatcher)
        streams = [
            StreamSettings(
                worker=i,
                samples_per_prompt=r.samples_per_prompt,
                max_new_tokens=r.max_new_tokens,
                temperature=r.temperature,
                scale_by_std=cfg.train.scale_adv_by_std,
                concurrency=r.concurrency or r.prompts_per_step * r.samples_per_prompt,
                partial_rollout=r.partial_rollout,
                pull_timeout_s=cfg.weights.pull_timeout_s,
                repack_max_stragglers=r.repack_max_stragglers if r.repack else 0,
            )
            for i in range(len(self.workers))
        ]
        return StreamRollouts(self.workers, dispatcher, streams, r.max_restarts, tag)


def latest_checkpoint(cfg: RunConfig) -> Checkpoint | None:
    """The newest valid checkpoint of this run (older ones if the newest is broken)."""
    return CheckpointStore(cfg.storage_url, cfg.checkpoint.keep).load_latest()


def _step_line(step: int, total: int, metrics: dict[str, float]) -> str:
    acc = metrics.get("eval/accuracy")
    shown = f" | held-out {100 * acc:5.1f}%" if acc is not None else ""
    reward = metrics.get("rollout/reward")  # async: no group may have finished this step
    rewarded = "  -  " if reward is None else f"{reward:.3f}"
    return (
        f"step {step:>4}/{total} | reward {rewarded}{shown} | "
        f"loss {metrics['train/loss']:+.4f} | kl {metrics['train/kl_behaviour']:.2e} | "
        f"entropy {metrics['train/entropy']:.3f} | {metrics['perf/tokens_per_s']:6.0f} tok/s | "
        f"{metrics['perf/step_s']:.2f} s"
    )


class _StoreMetrics:
    """The trajectory store's gauges, and its counters as per-step increments."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def update(self, stats: dict[str, int]) -> dict[str, float]:
        out = {f"store/{k}": float(stats[k]) for k in ("held", "ready", "leased")}
        for k in ("dropped", "expired_leases"):
            out[f"store/{k}"] = float(stats[k] - self.last.get(k, 0))
        self.last = stats
        return out


def _step_metrics(
    train: dict[str, float], marks: tuple[float, float, float, float]
) -> dict[str, float]:
    t0, t1, t2, t3 = marks
    step_s = t3 - t0
    return {
        **{f"train/{k}": v for k, v in train.items()},
        # Time the trainer sat waiting for a full batch in the store, over the step.
        "perf/trainer_idle_fraction": min(1.0, (t1 - t0 + train["lease_s"]) / step_s),
        "perf/rollout_s": t1 - t0,
        "perf/train_s": t2 - t1,
        "perf/weight_sync_s": t3 - t2,
        "perf/step_s": step_s,
        "perf/tokens_per_s": train["tokens"] / step_s,
        "perf/samples_per_s": train["samples"] / step_s,
    }
