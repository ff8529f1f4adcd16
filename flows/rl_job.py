"""The RL job: a Prefect flow that trains a policy with verifiable rewards, in segments.

Components, each in its own folder, opened by ``driver/session.py`` and driven from here:
- ``envs/``: the environment (prompts + verifier);
- ``engines/rollout/worker.py``: rollout workers, Ray actors holding vLLM and the verifier;
  what ``sync``, ``one_step`` and ``async`` do with them in a step is ``driver/modes.py``;
- ``storage/trajectory_store.py``: scored groups as Arrow blocks in Ray's object store;
  the flow leases whole groups, the trainer reads them, the flow acknowledges them after
  the step; the ledger records every sample's life;
- ``engines/train/pool.py``: the trainer, a Ray actor holding a torch or DeepSpeed
  engine; it publishes each version once to ``storage/params.py``, the parameter service
  rollout workers pull the newest weights from when they choose;
- ``storage/checkpoints.py``: atomic checkpoints (model, optimiser, RNG, data cursor,
  ledger watermark) at step 0 and every ``checkpoint.every`` steps;
- ``driver/tracking.py``, ``tasks/registry.py``, ``driver/plots.py``: MLflow.

The flow is a chain of Prefect tasks (``tasks/job.py``): start Ray, then one
``train-segment`` per ``checkpoint.every`` steps, each taking ``rl_step`` below and ending
in a ``checkpoint``, then ``finish-run`` and ``register-policy``. A segment that fails (a
trainer died, a weight pull timed out) is retried ``checkpoint.segment_retries`` times with
fresh pools from the newest valid checkpoint; a rollout worker that dies is restarted
inside the segment without stopping training. ``sluice resume RUN``, or retrying the flow
run, continues a job whose process died from the newest checkpoint and the ledger.
Trajectories and weights move between actors through Ray's object store, never through
this process: the flow holds handles, leases and counts.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace
from typing import Any

import ray
import yaml
from prefect import flow
from prefect.runtime import flow_run

from sluice.config.tree import build_config, cautions
from sluice.driver.modes import batch_step, stream_step
from sluice.driver.session import Session
from sluice.driver.step_log import step_line, step_metrics
from sluice.driver.tracking import MetricLogger, MlflowLogger, tracking_uri
from sluice.flows.runtime import use_credentials_block
from sluice.storage.layout import RunLayout
from sluice.tasks.job import (
    Job,
    RunSummary,
    check_start,
    finish_run,
    prepare_policy_task,
    register_policy,
    start_ray,
    train_segment,
)

__all__ = ["RunSummary", "rl_job", "rl_step"]

log = logging.getLogger("sluice")


def rl_step(s: Session, tracker: MetricLogger) -> None:
    """One RL step in the run's mode (``driver/modes.py``): lease a batch, train on it and
    publish the new version, acknowledge; then log it, and evaluate every ``eval.every``."""
    cfg, step = s.cfg, s.step + 1
    if s.stream is not None:  # async: the workers stream on their own
        trained, times = stream_step(s.stream, step, s.train)
    else:  # sync, one_step: the batch generated for this step
        assert s.batch is not None
        trained, times = batch_step(s.batch, step, cfg.train.steps, s.schedule.overlap, s.train)
    s.step = step
    s.totals.samples += int(trained["samples"])
    s.totals.tokens += int(trained["tokens"])
    stats = s.store.stats()  # groups the store dropped go back to admission (async)
    metrics = s.rollouts.drain(step, s.drops_to_credit(stats))
    metrics.update(step_metrics(trained, times) | s.store_metrics.update(stats))
    was_collapsed = s.health.collapsed
    if step % cfg.eval.every == 0 or step == cfg.train.steps:
        evaluating = time.monotonic()
        metrics.update(s.evaluate())
        s.end_accuracy = metrics["eval/accuracy"]
        if s.health.held_out(step, s.end_accuracy) and cfg.eval.keep_best:
            s.save_policy(str(s.layout.best_policy))
        # How long training paused for it: benchmarks take it off the run's wall clock.
        metrics["eval/seconds"] = time.monotonic() - evaluating
    for slow in s.sync.observe(step, metrics):
        log.warning("weight sync: %s", slow)
    if (median := s.sync.median()) is not None:
        metrics["perf/weight_load_median_s"] = median
    s.health.entropy(metrics["train/entropy"])
    metrics.update(s.health.metrics())
    warnings = s.health.warnings(s.end_accuracy)
    tracker.log_metrics(step, metrics)
    log.info(step_line(step, cfg.train.steps, metrics, warnings))
    s.totals.clock(times.start, metrics.get("eval/seconds", 0.0))
    if warnings and not was_collapsed:
        log.warning("the run collapsed at step %d: %s", step, "; ".join(warnings))


@flow(name="sluice-rl-job", log_prints=False)
def rl_job(config: dict[str, Any], resume: bool | None = None) -> dict[str, Any]:
    """Train a policy with RL on a verifiable environment; ``config`` is a RunConfig tree.

    ``resume``: continue the run from its newest checkpoint. Default: only when this flow
    run is a retry (a retried flow run picks up where the failed one stopped).
    """
    cfg = build_config(config)
    for caution in cautions(cfg):
        log.warning("config: %s", caution)
    layout = RunLayout(cfg.run_dir, cfg.cache_dir).create()
    if cfg.storage.credentials_block:
        use_credentials_block(cfg.storage.credentials_block)
    if resume is None:
        resume = (flow_run.run_count or 1) > 1
    found = check_start(cfg, resume)
    started = time.monotonic()
    (layout.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    policy_dir = prepare_policy_task(cfg)
    tracker = MlflowLogger(
        tracking_uri(cfg.tracking.mlflow_uri, layout.mlflow_uri),
        layout.mlflow_artifacts.as_uri(),
        cfg.tracking.experiment,
        cfg.name,
        continue_run=found.meta.get("mlflow_run_id") if found else None,
    )
    tracker.log_params(cfg.model_dump())
    tracker.log_artifact(str(layout.run_dir / "config.yaml"))
    job = Job(cfg, layout, policy_dir, tracker, found)
    status = "FAILED"
    try:
        start_ray(cfg, layout)
        segment = train_segment.with_options(
            retries=cfg.checkpoint.segment_retries, retry_delay_seconds=2
        )
        every, step = cfg.checkpoint.every, found.step if found else 0
        while step < cfg.train.steps:  # each segment ends in a checkpoint
            step = segment(job, min((step // every + 1) * every, cfg.train.steps), rl_step)
        summary = finish_run(job, started)
        if cfg.tracking.register_model:
            version = register_policy(job, summary)
            summary = replace(summary, model_version=version, model_name=cfg.tracking.model_name)
            layout.summary.write_text(json.dumps(asdict(summary), indent=2))
        status = "FINISHED"
        return asdict(summary)
    finally:
        job.drop_session()
        tracker.close(status)
        ray.shutdown()
