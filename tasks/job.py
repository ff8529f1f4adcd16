"""The Prefect tasks an RL job's flow (``flows/rl_job.py``) composes, each with its retries.

``prepare-policy`` builds or reuses the starting policy; ``start-ray`` joins or starts Ray;
``train-segment`` takes the flow's step up to the next checkpoint (``Job`` keeps the live
pools, ``driver/session.py``, across a segment's retries, and opens new ones from the newest
valid checkpoint after a failure); ``checkpoint`` writes one; ``finish-run`` stops the
rollouts, saves the policy and writes the summary, plots and ledger check;
``register-policy`` adds the policy to MLflow's model registry.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from sluice.config.tree import RunConfig
from sluice.driver import plots
from sluice.driver.environment import make_environment, scorer_factory, step_spec
from sluice.driver.session import Session, latest_checkpoint
from sluice.driver.tracking import MetricLogger, MlflowLogger
from sluice.engines.cluster import fit, ray_cluster
from sluice.engines.rollout.episodes import EpisodeSteps
from sluice.engines.rollout.vllm_engine import CPU_KV_CACHE_GIB
from sluice.policy.starting import prepare_policy
from sluice.storage.checkpoints import Checkpoint
from sluice.storage.layout import RunLayout, durable_state
from sluice.storage.ledger import Ledger, check_exactly_once, check_versions
from sluice.storage.trajectory_store import check_trajectory_versions
from sluice.storage.urls import redact
from sluice.tasks import registry
from sluice.tasks.failures import retry_may_help

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
    best_accuracy: float | None = None
    best_step: int = 0
    best_policy: str | None = None
    # What collapsed by the end (driver/health.py), one phrase each; empty: nothing.
    collapse: tuple[str, ...] = ()
    model_version: str | None = None
    model_name: str | None = None
    weight_sync: str | None = None  # the trend of the run's weight loads (driver/weight_sync.py)

    def lines(self) -> list[str]:
        gain = 100 * (self.end_accuracy - self.start_accuracy)
        best = []
        if self.best_accuracy is not None and self.best_accuracy > self.end_accuracy:
            where = f": {self.best_policy}" if self.best_policy else ""
            best = [
                f"best held-out {100 * self.best_accuracy:.1f}% at step {self.best_step}{where}"
            ]
        return [
            f"held-out accuracy {100 * self.start_accuracy:.1f}% -> "
            f"{100 * self.end_accuracy:.1f}% ({gain:+.1f} points) in {self.steps} "
            f"{self.mode} steps",
            *(f"COLLAPSED: {what}" for what in self.collapse),
            *best,
            f"throughput {self.samples_per_s:.1f} samples/s, {self.tokens_per_s:.0f} tokens/s; "
            f"wall {self.wall_s:.0f} s",
            *([self.weight_sync] if self.weight_sync else []),
            f"trained policy: {self.policy}",
            f"ledger: sluice ledger {self.storage_url}",
            f"MLflow run {self.mlflow_run_id}: mlflow ui --backend-store-uri "
            f"{shlex.quote(self.mlflow_uri)} "
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
                log.warning(
                    "no checkpoint to retry from under %s (the failure came before the step-0 "
                    "checkpoint): starting again from the beginning",
                    redact(self.cfg.storage_url),
                )
            again = self.opened
            self.opened = True
            session = Session(self.cfg, self.policy_dir, self.tracker)
            self.session = session
            try:
                session.open(start, again=again)
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
    env, signature = make_environment(cfg.env, cfg.policy)
    if cfg.reward.functions:  # the warm start's accuracy is the user's reward's
        signature += json.dumps(cfg.reward.model_dump(), sort_keys=True)
    chat = cfg.env.agent is not None  # the agent's endpoint needs a chat template
    # An agent's verdicts come with its episodes; the warm start, which learns the
    # environment's answers, is judged as a run without the agent would judge them.
    # A judge or reward model would need its actors: the warm start is judged by the
    # environment's verifier, or the user's functions.
    reward = cfg.reward.model_copy(update={"judge": None, "model": None})
    scorer = scorer_factory(env, reward, cfg.env.model_copy(update={"agent": None}))()
    spec = step_spec(cfg)  # a multi-turn environment's warm start plays episodes
    steps = EpisodeSteps(spec, cfg.env.step_timeout_s) if spec is not None else None
    try:
        return str(
            prepare_policy(cfg.policy, env, signature, cfg.seed, cfg.cache_dir, scorer, chat, steps)
        )
    finally:
        scorer.close()
        if steps is not None:
            steps.close()


@task(
    name="start-ray",
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=retry_may_help,
    cache_policy=NO_CACHE,
)
def start_ray(cfg: RunConfig, layout: RunLayout) -> None:
    """Join the cluster at ``RAY_ADDRESS`` if set, else start a local Ray sized for the pools
    (``engines/cluster/ray_cluster.py``)."""
    r, t, served = cfg.rollout, cfg.train, cfg.reward.served
    ray_cluster.start(
        r.workers * r.cpus_per_worker
        + t.ranks * t.cpus
        + (served.workers * served.cpus_per_worker if served else 0.0),
        ray_cluster.summed((r.workers, r.resources), (t.ranks, t.resources)),
        layout.ray_temp,
    )


@task(
    name="checkpoint",
    retries=2,
    retry_delay_seconds=[1, 5],
    retry_condition_fn=retry_may_help,
    cache_policy=NO_CACHE,
)
def checkpoint(session: Session) -> str:
    return session.checkpoint()


@task(name="train-segment", retry_condition_fn=retry_may_help, cache_policy=NO_CACHE)
def train_segment(job: Job, until: int, rl_step: Callable[[Session, MetricLogger], None]) -> int:
    """Take ``rl_step`` (the flow's) up to step ``until`` and checkpoint. On failure the
    pools go, and a retry (``checkpoint.segment_retries``) starts new ones from the newest
    valid checkpoint, unless the error is one a retry meets again (``tasks/failures.py``)."""
    try:
        session = job.ensure_session()
        while session.step < until:
            rl_step(session, job.tracker)
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
    totals, health = session.totals, session.health
    best_policy: str | None = None
    if health.best_step == 0:  # the policy the run started from
        best_policy = session.policy_dir
    elif job.cfg.eval.keep_best and layout.best_policy.is_dir():
        best_policy = str(layout.best_policy)
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
        best_accuracy=health.best_accuracy,
        best_step=health.best_step,
        best_policy=best_policy,
        collapse=tuple(health.warnings(session.end_accuracy)),
        weight_sync=session.sync.trend(),
    )
    if summary.collapse:
        tracker.set_tag("sluice.collapsed", "; ".join(summary.collapse))
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
        {"collapsed": "; ".join(summary.collapse)} if summary.collapse else None,
    )
    log.info("registered %s version %s (alias challenger)", job.cfg.tracking.model_name, version)
    return version


def machine_misfit(cfg: RunConfig) -> str | None:
    """Why the run's pools cannot fit this machine's memory, when it would start the embedded
    Ray cluster here (no ``RAY_ADDRESS``, no GPU); else None. Past it the actors are placed
    and never start, and the run would wait out ``rollout.placement_timeout_s``."""
    if os.environ.get("RAY_ADDRESS") or torch.cuda.is_available():
        return None
    r = cfg.rollout
    folder = Path(cfg.policy.path) if cfg.policy.path else None
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder else 0
    kv = r.kv_cache_gib if r.kv_cache_gib is not None else CPU_KV_CACHE_GIB
    why = fit.misfit(
        fit.Ask(r.workers, kv, cfg.train.ranks, weights), psutil.virtual_memory().total
    )
    return (
        None if why is None else f"run {cfg.name!r} does not fit this machine's Ray cluster: {why}"
    )


def check_start(cfg: RunConfig, resume: bool) -> Checkpoint | None:
    """The checkpoint to resume from; an error when ``resume`` and the run's state disagree.

    A fresh run needs a storage location no run has written to (no ledger, trajectories or
    checkpoint, valid or not): one run per location, so it never appends to another run's
    ledger or prunes its checkpoints. A resumed one needs a valid checkpoint, and trajectory
    files of this schema version. Either needs pools that fit the embedded cluster when it
    starts one (``engines/cluster/fit.py``).
    """
    if (misfit := machine_misfit(cfg)) is not None:  # a deployment's run, not checked by the CLI
        raise JobError(misfit)
    if not resume:
        used = durable_state(cfg.storage_url)
        if used:
            raise JobError(
                f"run {cfg.name!r} already has {', '.join(used)} under "
                f"{redact(cfg.storage_url)}: continue it with `sluice resume {cfg.name}`, or "
                "start a new run with --set name=<new name>"
            )
        return None
    found = latest_checkpoint(cfg)
    if found is None:
        raise JobError(
            f"run {cfg.name!r} has no valid checkpoint under {redact(cfg.storage_url)}; "
            "start it with `sluice run`"
        )
    check_trajectory_versions(cfg.storage_url)  # the store would meet it after Ray started
    return found
