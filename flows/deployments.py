"""Entry points of the deployments in ``prefect.yaml``: train, retrain (on a schedule), eval.

A Prefect worker starts each in its own process, in the folder ``sluice deploy`` ran
from. Parameters are what a person fills in from the UI: a config file (relative to that
folder) and ``--set``-style overrides. Each loads and validates the config, points caches
at the run's folders, then runs the flow that does the work as a subflow
(``flows/rl_job.py``, ``flows/retrain.py``, ``flows/evaluate.py``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from sluice.config.tree import RunConfig, load_config
from sluice.flows.evaluate import eval_flow
from sluice.flows.retrain import retrain as retrain_flow
from sluice.flows.rl_job import rl_job
from sluice.flows.runtime import configure_process
from sluice.storage.layout import RunLayout


def _prepare(config: str, overrides: list[str] | None) -> RunConfig:
    cfg = load_config(config, overrides or [])
    configure_process(RunLayout(cfg.run_dir, cfg.cache_dir), prefect=False)
    return cfg


@flow(name="sluice-train", log_prints=False)
def train(
    config: str = "configs/default.yaml",
    overrides: list[str] | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """An RL job from a config file. A retried flow run resumes from its checkpoint."""
    cfg = _prepare(config, overrides)
    retried = (flow_run.run_count or 1) > 1
    return rl_job(cfg.model_dump(), resume=resume or retried)


@flow(name="sluice-retrain-scheduled", log_prints=False)
def retrain(
    config: str = "configs/default.yaml",
    overrides: list[str] | None = None,
    min_gain: float = 0.0,
) -> dict[str, Any]:
    """Retrain from the champion on fresh prompts; promote only if held-out improves."""
    return retrain_flow(_prepare(config, overrides).model_dump(), min_gain=min_gain)


@flow(name="sluice-evaluate", log_prints=False)
def evaluate(
    config: str = "configs/default.yaml",
    overrides: list[str] | None = None,
    model: str = "sluice-policy@champion",
) -> dict[str, Any]:
    """Held-out accuracy of a registered policy (NAME@ALIAS or NAME/VERSION)."""
    return eval_flow(_prepare(config, overrides).model_dump(), model=model)
