"""The RL job: a Prefect flow that trains a policy with verifiable rewards.

Components, each in its own folder, wired here and driven by the loop below:
- ``envs/``: the verifiable environment (prompts + verifier);
- ``engines/policy.py``: the starting policy (a tiny llama built offline, or a local folder);
- ``engines/pools.py``: Ray actors: rollout workers (vLLM + verifier, ``rollout_worker.py``)
  and the torch trainer;
- ``storage/trajectory_store.py``: scored groups as Arrow blocks in Ray's object store; the
  trainer leases whole groups, acknowledges them after its step; the ledger records it all;
- ``storage/params.py``: the parameter service: the trainer publishes each version once,
  rollout workers pull the newest when they choose;
- ``storage/checkpoints.py``: atomic checkpoints (model, optimiser, RNG, data cursor,
  ledger watermark) every ``storage.checkpoint_every`` steps;
- ``rl/``: the config tree, advantages and the PPO-clip loss the trainer applies;
- ``tasks/tracking.py``: parameters and per-step metrics to MLflow (sqlite in the run folder).

Mode ``sync``: generate a batch with the current weights, train one step on it, workers
pull the new weights, repeat. Mode ``one_step``: the same, but the next batch is submitted
before training on this one, so generation and training overlap and each batch is one
version stale (the store's staleness bound is 0 and 1 respectively). Held-out accuracy is
measured with greedy decoding every ``eval.every`` steps. The driver holds only handles
and counts: trajectories and weights move between actors through Ray's object store.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import ray
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from engines.policy import prepare_policy
from engines.pools import launch_rollout_workers, launch_trainer
from engines.rollout_worker import StreamSettings
from envs import Environment
from flows.runtime import child_env
from rl.config import RunConfig, build_config
from storage.layout import RunLayout
from storage.params import ParameterService
from storage.trajectory_store import PROGRESS_EVERY_S, StoreClient, create_store
from storage.urls import redact
from tasks.dispatcher import Dispatcher
from tasks.environment import PromptStream, make_environment
from tasks.rollout import (
    BatchRollouts,
    BatchSettings,
    StreamRollouts,
    evaluate,
)
from tasks.tracking import MlflowLogger

log = logging.getLogger("sluice")


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    storage_url: str
    mode: str
    steps: int
    start_accuracy: float
    end_accuracy: float
    samples_per_s: float
    tokens_per_s: float
    wall_s: float
    mlflow_uri: str
    mlflow_run_id: str
    policy: str

    def lines(self) -> list[str]:
        gain = 100 * (self.end_accuracy - self.start_accuracy)
        return [
            f"held-out accuracy {100 * self.start_accuracy:.1f}% -> "
            f"{100 * self.end_accuracy:.1f}% ({gain:+.1f} points) in {self.steps} "
            f"{self.mode} steps",
            f"throughput {self.samples_per_s:.1f} samples/s, {self.tokens_per_s:.0f} tokens/s; "
            f"wall {self.wall_s:.0f} s",
            f"trained policy: {self.policy}",
            f"ledger: sluice ledger {self.storage_url}",
            f"MLflow run {self.mlflow_run_id}: mlflow ui --backend-store-uri {self.mlflow_uri} "
            "--host 127.0.0.1",
        ]


@task(name="prepare-policy", cache_policy=NO_CACHE)
def prepare_policy_task(cfg: RunConfig) -> str:
    env, signature = make_environment(cfg.env)
    return str(prepare_policy(cfg.policy, env, signature, cfg.seed, cfg.cache_dir))


def _start_ray(cfg: RunConfig, layout: RunLayout) -> None:
    needed = cfg.rollout.workers * cfg.rollout.cpus_per_worker + cfg.train.cpus
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return
    ray.init(
        num_cpus=max(int(needed + 0.999), 1),
        include_dashboard=False,
        _temp_dir=str(layout.ray_temp),
        log_to_driver=False,
        configure_logging=False,
    )


def _wait(refs: Any, what: str, store: StoreClient) -> Any:
    """``ray.get(refs)``, with a progress line every ``PROGRESS_EVERY_S`` while it waits."""
    pending = refs if isinstance(refs, list) else [refs]
    started = time.monotonic()
    while len(ray.wait(pending, num_returns=len(pending), timeout=PROGRESS_EVERY_S)[0]) < len(
        pending
    ):
        log.info(
            "waiting for %s for %.0f s; trajectory store: %s",
            what,
            time.monotonic() - started,
            store.stats(),
        )
    return ray.get(refs)


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


@flow(name="sluice-rl-job", log_prints=False)
def rl_job(config: dict[str, Any]) -> dict[str, Any]:
    """Train a policy with RL on a verifiable environment; ``config`` is a RunConfig tree."""
    cfg = build_config(config)
    layout = RunLayout(cfg.run_dir, cfg.cache_dir).create()
    started = time.monotonic()
    policy_dir = prepare_policy_task(cfg)
    env, _ = make_environment(cfg.env)
    heldout = env.problems("heldout", cfg.eval.prompts, cfg.seed + 1)
    eval_tokens = max(len(p.answer) for p in heldout) + 4
    tracker = MlflowLogger(layout.mlflow_uri, layout.mlflow_artifacts.as_uri(), "sluice", cfg.name)
    tracker.log_params(cfg.model_dump())
    batch_size = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    max_staleness = {"sync": 0, "one_step": 1, "async": cfg.max_staleness}[cfg.mode]
    _start_ray(cfg, layout)
    status = "FAILED"
    try:
        store, trainer, workers = _launch(cfg, env, policy_dir, batch_size)
        rollouts = _rollouts(cfg, env, workers)

        def wait(refs: Any, what: str) -> Any:
            return _wait(refs, what, store)

        def evaluate_now(step: int) -> float:
            rollouts.pause(wait)  # async: workers hand vLLM back, then load version `step`
            wait([w.sync_weights.remote(step) for w in workers], "weights")
            accuracy = evaluate(workers, env, heldout, eval_tokens)
            rollouts.resume()
            return accuracy

        log.info("starting %d rollout worker(s) and the trainer (vLLM takes ~30 s)", len(workers))
        start_acc = end_acc = evaluate(workers, env, heldout, eval_tokens)
        ray.get(trainer.version.remote())  # the trainer actor has loaded the policy
        log.info(
            "step    0/%d | held-out %5.1f%% (starting policy)", cfg.train.steps, 100 * start_acc
        )
        tracker.log_metrics(0, {"eval/accuracy": start_acc})
        loop_start, samples_seen, tokens_seen = time.monotonic(), 0, 0
        store_metrics = _StoreMetrics()
        rollouts.start()
        for step in range(1, cfg.train.steps + 1):
            t0 = time.monotonic()
            rollouts.before_train(step, wait)  # batch modes: this step's groups are in the store
            t1 = time.monotonic()
            train = wait(  # lease -> one step -> publish the new version -> acknowledge
                trainer.train_from_store.remote(
                    store, batch_size, max_staleness, cfg.storage.lease_timeout_s
                ),
                "the trainer",
            )
            t2 = time.monotonic()
            rollouts.after_train(step, wait)  # batch modes: workers load version `step`
            t3 = time.monotonic()
            samples_seen += int(train["samples"])
            tokens_seen += int(train["tokens"])
            metrics = {
                **rollouts.drain(step),
                **_step_metrics(train, (t0, t1, t2, t3)),
                **store_metrics.update(store.stats()),
            }
            if step % cfg.eval.every == 0 or step == cfg.train.steps:
                end_acc = metrics["eval/accuracy"] = evaluate_now(step)
            if step % cfg.storage.checkpoint_every == 0 or step == cfg.train.steps:
                _checkpoint(cfg, trainer, store, step, rollouts.cursor())
            tracker.log_metrics(step, metrics)
            log.info(_step_line(step, cfg.train.steps, metrics))
        loop_s = time.monotonic() - loop_start
        rollouts.stop(wait)
        left = ray.get(store.handle.close.remote("the run ended before it was trained"))
        if left:
            log.info("%d generated samples were left untrained (recorded as dropped)", left)
        ray.get(trainer.save.remote(str(layout.final_policy)))
        summary = RunSummary(
            run_dir=str(layout.run_dir),
            storage_url=redact(cfg.storage_url),
            mode=cfg.mode,
            steps=cfg.train.steps,
            start_accuracy=start_acc,
            end_accuracy=end_acc,
            samples_per_s=samples_seen / loop_s,
            tokens_per_s=tokens_seen / loop_s,
            wall_s=time.monotonic() - started,
            mlflow_uri=layout.mlflow_uri,
            mlflow_run_id=tracker.run_id,
            policy=str(layout.final_policy),
        )
        layout.summary.write_text(json.dumps(asdict(summary), indent=2))
        tracker.log_artifact(str(layout.summary))
        status = "FINISHED"
        return asdict(summary)
    finally:
        tracker.close(status)
        ray.shutdown()


def _launch(
    cfg: RunConfig, env: Environment, policy_dir: str, batch_size: int
) -> tuple[StoreClient, Any, list[Any]]:
    """The trajectory store, the parameter service, the trainer and the rollout workers."""
    env_vars = child_env()
    streaming = cfg.mode == "async"
    store = StoreClient(
        create_store(
            cfg.storage_url, cfg.storage.capacity_batches * batch_size, cfg.storage.lease_timeout_s
        ),
        cfg.storage_url,
        # async: rows reach storage in files of one training batch, not one per put, and a
        # worker goes on generating while the store takes its last two puts.
        persist_rows=batch_size if streaming else 0,
        pipeline=2 if streaming else 0,
    )
    params = ParameterService.create(
        relays=cfg.storage.param_relays, bucket_bytes=cfg.storage.bucket_mib << 20
    )
    trainer = launch_trainer(
        cfg.train.cpus,
        cfg.train.threads,
        env_vars,
        params=params,
        model_dir=policy_dir,
        lr=cfg.train.lr,
        clip_eps=cfg.train.clip_eps,
        warmup_steps=cfg.train.warmup_steps,
        entropy_coef=cfg.train.entropy_coef,
        grad_clip=cfg.train.grad_clip,
        micro_batch=cfg.train.micro_batch,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        loss=cfg.train.loss,
        is_cap=cfg.train.is_cap,
        seed=cfg.seed,
    )
    workers = launch_rollout_workers(
        cfg.rollout.workers,
        cfg.rollout.cpus_per_worker,
        cfg.rollout.threads_per_worker,
        env_vars,
        env=env,
        store=store,
        params=params,
        model_dir=policy_dir,
        seed=cfg.seed,
        kv_cache_gib=cfg.rollout.kv_cache_gib,
        enforce_eager=cfg.rollout.enforce_eager,
        max_model_len=cfg.policy.max_positions,
    )
    return store, trainer, workers


def _rollouts(
    cfg: RunConfig, env: Environment, workers: list[Any]
) -> BatchRollouts | StreamRollouts:
    prompts = PromptStream(env, cfg.env.train_prompts, cfg.seed)
    r = cfg.rollout
    if cfg.mode != "async":
        settings = BatchSettings(
            steps=cfg.train.steps,
            prompts_per_step=r.prompts_per_step,
            samples_per_prompt=r.samples_per_prompt,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            seed=cfg.seed,
            scale_by_std=cfg.train.scale_adv_by_std,
            weight_pull_timeout_s=cfg.storage.weight_pull_timeout_s,
        )
        return BatchRollouts(workers, prompts, settings, overlap=cfg.mode == "one_step")
    dispatcher = Dispatcher.remote(  # type: ignore[attr-defined]
        prompts,
        env.name,
        r.prompts_per_step,
        r.samples_per_prompt,
        cfg.max_staleness,
        cfg.seed,
        long_first=r.long_first,
        balance=r.balance,
        prior_length=float(r.max_new_tokens),
    )
    streams = [
        StreamSettings(
            worker=i,
            samples_per_prompt=r.samples_per_prompt,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            scale_by_std=cfg.train.scale_adv_by_std,
            concurrency=r.concurrency or r.prompts_per_step * r.samples_per_prompt,
            partial_rollout=r.partial_rollout,
            pull_timeout_s=cfg.storage.weight_pull_timeout_s,
        )
        for i in range(len(workers))
    ]
    return StreamRollouts(workers, dispatcher, streams)


def _checkpoint(
    cfg: RunConfig, trainer: Any, store: StoreClient, step: int, cursor: dict[str, Any]
) -> None:
    """Model, optimiser and RNG (written by the trainer) with the data cursor and watermark."""
    watermark = ray.get(store.handle.flush.remote())
    meta = {"step": step, "ledger_watermark": watermark, "data_cursor": cursor}
    url = ray.get(
        trainer.save_checkpoint.remote(cfg.storage_url, cfg.storage.keep_checkpoints, step, meta)
    )
    log.info("checkpoint %s", url)
