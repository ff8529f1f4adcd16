"""The RL job: a Prefect flow that trains a policy with verifiable rewards, in segments.

Components, each in its own folder, wired by ``tasks/session.py`` and driven from here:
- ``envs/``: the verifiable environment (prompts + verifier);
- ``engines/policy.py``: the starting policy (a tiny llama built offline, or a local folder);
- ``engines/pools.py``: Ray actors: rollout workers (vLLM + verifier, ``rollout_worker.py``)
  and the torch trainer;
- ``storage/trajectory_store.py``: scored groups as Arrow blocks in Ray's object store; the
  trainer leases whole groups, acknowledges them after its step; the ledger records it all;
- ``storage/params.py``: the parameter service: the trainer publishes each version once,
  rollout workers pull the newest when they choose;
- ``storage/checkpoints.py``: atomic checkpoints (model, optimiser, RNG, data cursor,
  ledger watermark) at step 0 and every ``checkpoint.every`` steps;
- ``tasks/tracking.py``, ``tasks/registry.py``, ``tasks/plots.py``: MLflow (metrics in
  batches, config and plots as artifacts, the policy as a registered model version).

The flow is a chain of Prefect tasks: start Ray, then one ``train-segment`` task per
``checkpoint.every`` steps (each ends with a ``checkpoint`` task), then
``finish-run`` and ``register-policy``. Per-step metrics go to MLflow, not to Prefect. A
segment that fails (a trainer died, a weight pull timed out) is retried
``checkpoint.segment_retries`` times, each time with fresh pools restored from the newest
valid checkpoint; a rollout worker that dies is restarted inside the segment without
stopping training (``tasks/rollout.py``). A job whose process died is resumed with
``sluice resume RUN``, or by retrying its flow run: it continues from the newest
checkpoint and the ledger, at the same version, with no sample trained twice.

Modes (``mode``): ``sync`` generates a batch with the current weights, trains on it, then
rollout workers pull the new weights; ``one_step`` submits the next batch before training
on this one (one version stale); ``async`` streams (``tasks/dispatcher.py``), every sample
at most ``max_staleness`` versions old when trained. The driver holds only handles and
counts: trajectories and weights move between actors through Ray's object store.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import ray
import yaml
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from sluice.engines import cluster
from sluice.engines.policy import prepare_policy
from sluice.flows.runtime import use_credentials_block
from sluice.rl.config import RunConfig, build_config
from sluice.storage.checkpoints import Checkpoint
from sluice.storage.layout import RunLayout
from sluice.storage.ledger import Ledger, check_exactly_once, check_versions
from sluice.storage.urls import redact
from sluice.tasks import plots, registry
from sluice.tasks.environment import make_environment
from sluice.tasks.session import Session, latest_checkpoint
from sluice.tasks.tracking import MlflowLogger, tracking_uri

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
    model_version: str | None = None
    model_name: str | None = None

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
            *(
                [f"registered as {self.model_name} version {self.model_version} (challenger)"]
                if self.model_version
                else []
            ),
        ]


class JobError(RuntimeError):
    """The job cannot start as asked (resume without a checkpoint, a run name already used)."""


@dataclass
class Job:
    """What the tasks of one flow run share: the config, the tracker and the live pools."""

    cfg: RunConfig
    layout: RunLayout
    policy_dir: str
    tracker: MlflowLogger
    resume_from: Checkpoint | None
    session: Session | None = None
    opened: bool = False  # a session was opened before: a new one starts from a checkpoint

    def ensure_session(self) -> Session:
        """The live pools; new ones (from the newest checkpoint after a failure) if needed."""
        if self.session is None:
            start = self.resume_from if not self.opened else latest_checkpoint(self.cfg)
            if self.opened and start is None:
                raise JobError(
                    f"no valid checkpoint under {redact(self.cfg.storage_url)} to retry from "
                    "(the step-0 checkpoint never completed); start the run again"
                )
            self.opened = True
            session = Session(self.cfg, self.policy_dir, self.tracker)
            self.session = session
            try:
                session.open(start)
                if start is None:
                    checkpoint(session)  # step 0: a failure before step N resumes from here
                session.start()
            except BaseException:
                self.drop_session()
                raise
        return self.session

    def drop_session(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


@task(name="prepare-policy", cache_policy=NO_CACHE)
def prepare_policy_task(cfg: RunConfig) -> str:
    env, signature = make_environment(cfg.env)
    return str(prepare_policy(cfg.policy, env, signature, cfg.seed, cfg.cache_dir))


@task(name="start-ray", retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def start_ray(cfg: RunConfig, layout: RunLayout) -> None:
    """Join the cluster at ``RAY_ADDRESS`` if set, else start a local Ray sized for the pools
    (``engines/cluster.py``)."""
    r, t = cfg.rollout, cfg.train
    cluster.start(
        r.workers * r.cpus_per_worker + t.cpus,
        cluster.summed((r.workers, r.resources), (1, t.resources)),
        layout.ray_temp,
    )


@task(name="checkpoint", retries=2, retry_delay_seconds=[1, 5], cache_policy=NO_CACHE)
def checkpoint(session: Session) -> str:
    return session.checkpoint()


@task(name="train-segment", cache_policy=NO_CACHE)
def train_segment(job: Job, until: int) -> int:
    """Train up to step ``until`` and checkpoint; on failure the pools go, and a retry
    starts new ones from the newest valid checkpoint."""
    try:
        session = job.ensure_session()
        while session.step < until:
            session.train_step()
        checkpoint(session)
        return session.step
    except BaseException:
        job.drop_session()
        raise


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(job: Job, started: float) -> RunSummary:
    """Stop the rollouts, save the policy, write the summary, plots and ledger check."""
    session, layout, tracker = job.ensure_session(), job.layout, job.tracker
    session.finish(str(layout.final_policy))
    table = Ledger(job.cfg.storage_url).read()
    problems = check_exactly_once(table, finished=True) + check_versions(table)
    if problems:
        log.warning("ledger check found %d problem(s): %s", len(problems), "; ".join(problems[:5]))
    else:
        log.info("ledger check: every sample trained exactly once or dropped with a reason")
    totals = session.totals
    summary = RunSummary(
        run_dir=str(layout.run_dir),
        storage_url=redact(job.cfg.storage_url),
        mode=job.cfg.mode,
        steps=session.step,
        start_accuracy=float(session.start_accuracy or 0.0),
        end_accuracy=float(session.end_accuracy or 0.0),
        samples_per_s=totals.samples / totals.loop_s if totals.loop_s else 0.0,
        tokens_per_s=totals.tokens / totals.loop_s if totals.loop_s else 0.0,
        wall_s=time.monotonic() - started,
        mlflow_uri=tracker.tracking_uri,
        mlflow_run_id=tracker.run_id,
        policy=str(layout.final_policy),
    )
    layout.summary.write_text(json.dumps(asdict(summary), indent=2))
    tracker.log_artifact(str(layout.summary))
    tracker.flush()
    folder = layout.run_dir / "plots"
    folder.mkdir(exist_ok=True)
    plots.training_curves(tracker.client, tracker.run_id, folder / "reward_accuracy.png")
    plots.staleness(tracker.client, tracker.run_id, folder / "staleness.png")
    tracker.log_artifacts(str(folder), "plots")
    return summary


@task(name="register-policy", retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def register_policy(job: Job, summary: RunSummary) -> str:
    version = registry.register_policy(
        job.tracker.client,
        job.cfg.tracking.model_name,
        job.tracker.run_id,
        Path(summary.policy),
        summary.end_accuracy,
    )
    log.info("registered %s version %s (alias challenger)", job.cfg.tracking.model_name, version)
    return version


def _check_start(cfg: RunConfig, resume: bool) -> Checkpoint | None:
    found = latest_checkpoint(cfg)
    if resume and found is None:
        raise JobError(
            f"run {cfg.name!r} has no valid checkpoint under {redact(cfg.storage_url)}; "
            "start it with `sluice run`"
        )
    if not resume and found is not None:
        raise JobError(
            f"run {cfg.name!r} already has checkpoints under {redact(cfg.storage_url)}: "
            f"continue it with `sluice resume {cfg.name}`, or start a new run with "
            "--set name=<new name>"
        )
    return found


@flow(name="sluice-rl-job", log_prints=False)
def rl_job(config: dict[str, Any], resume: bool | None = None) -> dict[str, Any]:
    """Train a policy with RL on a verifiable environment; ``config`` is a RunConfig tree.

    ``resume``: continue the run from its newest checkpoint. Default: only when this flow
    run is a retry (a retried flow run picks up where the failed one stopped).
    """
    cfg = build_config(config)
    layout = RunLayout(cfg.run_dir, cfg.cache_dir).create()
    if cfg.storage.credentials_block:
        use_credentials_block(cfg.storage.credentials_block)
    if resume is None:
        resume = (flow_run.run_count or 1) > 1
    found = _check_start(cfg, resume)
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
        while step < cfg.train.steps:
            step = segment(job, min((step // every + 1) * every, cfg.train.steps))
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
