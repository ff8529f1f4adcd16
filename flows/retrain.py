"""Scheduled retraining: continue from the champion policy on fresh prompts, and promote
the result only if it is better on the held-out set.

Driven by the ``retrain`` deployment (a cron schedule in ``prefect.yaml``) or called
directly. Each retrain is a new run, ``<name>-<UTC time>``, started from the policy the
registry's ``champion`` alias points at (from the configured starting policy the first
time), with a training prompt pool drawn by a fresh seed (``env.train_seed``; the held-out
set stays the same). The RL job (``flows/rl_job.py``, a subflow) measures the champion's
held-out accuracy at step 0 and the challenger's at the end on the same prompts. With a
data set (``env.name: dataset``) the training pool is the rows no earlier run of the job
trained on (its ledgers say which: new files in the data's folder, or rows the runs never
reached); with none, the retrain does nothing and says so. ``tasks/registry.py: decide``
turns the two accuracies into promote or keep, with the reason, which is logged and
recorded as a tag on the new model version.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from prefect import flow

from sluice.config.tree import ConfigError, RunConfig, apply_override, build_config
from sluice.driver.environment import dataset_environment
from sluice.driver.tracking import tracking_uri
from sluice.engines.train.lora import is_adapter
from sluice.flows.rl_job import rl_job
from sluice.storage.layout import RunLayout
from sluice.tasks import registry

log = logging.getLogger("sluice")


def retrain_config(
    cfg: RunConfig, champion_dir: str | None, now: datetime, trained_in: Sequence[str] = ()
) -> RunConfig:
    """The run a retrain makes: a new name, a fresh prompt pool, the champion as the start;
    for a data set, the rows the runs at ``trained_in`` trained on left out. A LoRA
    champion starts the run from its merged export (new adapters then train over it)."""
    if champion_dir is not None and is_adapter(Path(champion_dir)):
        merged = Path(champion_dir) / "merged"
        if not (merged / "config.json").is_file():
            raise ConfigError(
                f"the champion in {champion_dir} is a LoRA adapter without a merged export, "
                "which a retrain starts from: set train.lora.merged_export: true in the run "
                "that trains the champion"
            )
        champion_dir = str(merged)
    tree = cfg.model_dump()
    stamp = now.strftime("%Y%m%d-%H%M%S")
    apply_override(tree, f"name={cfg.name}-{stamp}")
    apply_override(tree, f"env.train_seed={int(now.timestamp())}")
    apply_override(tree, "tracking.register_model=true")
    if champion_dir is not None:
        apply_override(tree, f"policy.path={champion_dir}")
    if trained_in:
        tree["env"]["data"]["skip_trained_in"] = list(trained_in)
    return build_config(tree)


def earlier_runs(cfg: RunConfig) -> list[str]:
    """Storage URLs of this job's runs so far: ``<name>`` and each retrain's
    ``<name>-<UTC time>``, found as run folders under ``root``."""
    stamped = re.compile(re.escape(cfg.name) + r"-\d{8}-\d{6}")
    root = cfg.run_dir.parent
    names = sorted(
        d.name
        for d in (root.iterdir() if root.is_dir() else [])
        if d.is_dir() and (d.name == cfg.name or stamped.fullmatch(d.name))
    )
    return [cfg.model_copy(update={"name": n}).storage_url for n in names]


def fresh_rows(cfg: RunConfig, trained_in: list[str]) -> int:
    """Training rows of the data set that the runs at ``trained_in`` never trained on."""
    assert cfg.env.data is not None
    data = cfg.env.data.model_copy(update={"skip_trained_in": trained_in})
    env = dataset_environment(data, None)
    return sum(1 for _ in env.rows("train"))


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
    trained_in: list[str] = []
    if cfg.env.name == "dataset":
        assert cfg.env.data is not None
        trained_in = earlier_runs(cfg)
        fresh = fresh_rows(cfg, trained_in)
        if fresh == 0:
            reason = (
                f"no new rows in {cfg.env.data.path}: its {len(trained_in)} run(s) so far "
                "trained on every training row; nothing to retrain"
            )
            log.info(reason)
            return {"promoted": False, "reason": reason, "new_rows": 0}
        log.info(
            "%d new rows in %s that %d earlier run(s) did not train on: retraining on those",
            fresh,
            cfg.env.data.path,
            len(trained_in),
        )
    run = retrain_config(cfg, champion_dir, now, trained_in)
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
