"""Scheduled retraining: continue from the champion policy on fresh prompts, and promote
the result only if it is better on the held-out set.

Driven by the ``retrain`` deployment (a cron schedule in ``prefect.yaml``) or called
directly. Each retrain is a new run, ``<name>-<UTC time>``, started from the policy the
registry's ``champion`` alias points at (from the configured starting policy the first
time), with a training prompt pool drawn by a fresh seed (``env.train_seed``; the held-out
set stays the same). The RL job (``flows/rl_job.py``, a subflow) measures the champion's
held-out accuracy at step 0 and the challenger's at the end on the same prompts;
``tasks/registry.py: decide`` turns the two into promote or keep, with the reason, which
is logged and recorded as a tag on the new model version.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from mlflow.tracking import MlflowClient
from prefect import flow

from sluice.flows.rl_job import rl_job
from sluice.rl.config import RunConfig, apply_override, build_config
from sluice.storage.layout import RunLayout
from sluice.tasks import registry
from sluice.tasks.tracking import tracking_uri

log = logging.getLogger("sluice")


def retrain_config(cfg: RunConfig, champion_dir: str | None, now: datetime) -> RunConfig:
    """The run a retrain makes: a new name, a fresh prompt pool, the champion as the start."""
    tree = cfg.model_dump()
    stamp = now.strftime("%Y%m%d-%H%M%S")
    apply_override(tree, f"name={cfg.name}-{stamp}")
    apply_override(tree, f"env.train_seed={int(now.timestamp())}")
    apply_override(tree, "tracking.register_model=true")
    if champion_dir is not None:
        apply_override(tree, f"policy.path={champion_dir}")
    return build_config(tree)


@flow(name="sluice-retrain", log_prints=False)
def retrain(config: dict[str, Any], min_gain: float = 0.0) -> dict[str, Any]:
    """Train a challenger from the champion on fresh prompts; promote it only if better."""
    cfg = build_config(config)
    layout = RunLayout(cfg.run_dir, cfg.cache_dir).create()
    client = MlflowClient(tracking_uri(cfg.tracking.mlflow_uri, layout.mlflow_uri))
    name = cfg.tracking.model_name
    champion = registry.alias_version(client, name, registry.CHAMPION)
    now = datetime.now(UTC)
    champion_dir = None
    if champion is not None:
        into = layout.run_dir.parent / f"{cfg.name}-{now:%Y%m%d-%H%M%S}" / "champion"
        champion_dir = str(registry.download_policy(client, name, champion, into))
        log.info("retraining from %s version %s (champion)", name, champion)
    else:
        log.info("no %s champion yet: retraining from the configured policy", name)
    run = retrain_config(cfg, champion_dir, now)
    result = rl_job(run.model_dump(), resume=False)
    decision = registry.promote_or_keep(
        client,
        name,
        result["model_version"],
        result["start_accuracy"] if champion is not None else None,
        result["end_accuracy"],
        min_gain,
    )
    return {**result, "promoted": decision.promote, "reason": decision.reason}
