"""``sluice.run``: one RL job from Python, as ``sluice run`` runs it from the shell.

Process settings (Prefect's home, caches) must be in place before Prefect is imported, so
the flow module is imported inside :func:`run`, after
:func:`sluice.flows.runtime.configure_process`.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.config.tree import ConfigError, RunConfig, apply_override, build_config, load_config
from sluice.driver.environment import (
    check_agent,
    check_environment,
    check_lora,
    check_model_folder,
    check_prompts,
    check_rewards,
)
from sluice.flows.runtime import configure_process
from sluice.storage.layout import RunLayout
from sluice.tasks.job import machine_misfit

if TYPE_CHECKING:
    from sluice.flows.rl_job import RunSummary

__all__ = ["RunSummary", "run"]


def run(
    config: RunConfig | dict[str, Any] | str | Path | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
) -> RunSummary:
    """Train a policy as the config says; ``config`` is a RunConfig, a config tree, a YAML
    file, or None for the defaults. ``overrides`` are ``--set`` assignments
    (``["train.steps=50"]``). ``resume``: continue the run from its newest checkpoint."""
    if isinstance(config, RunConfig | dict):
        tree = config.model_dump() if isinstance(config, RunConfig) else copy.deepcopy(config)
        for assignment in overrides or []:
            apply_override(tree, assignment)
        cfg = build_config(tree)
    else:
        cfg = load_config(config, overrides or [])
    check_run(cfg)
    configure_process(RunLayout(cfg.run_dir, cfg.cache_dir))
    from sluice.flows.rl_job import RunSummary, rl_job
    from sluice.tasks.job import check_start

    if not cfg.storage.credentials_block:  # else storage is readable only inside the flow
        check_start(cfg, resume)  # before Prefect's server and Ray start; the flow checks too

    logging.getLogger("sluice").info("run %s: writing to %s", cfg.name, cfg.run_dir)
    return RunSummary(**rl_job(cfg.model_dump(), resume=resume))


def check_run(cfg: RunConfig) -> None:
    """What a run needs that the config tree alone cannot say, checked before anything
    starts: its folders can be made, its model folder holds safetensors weights (and can
    carry ``train.lora``'s adapters), the environment supplies its prompts and they fit the
    context, its reward functions import and take what the run passes them, and its pools
    fit this machine when the run starts Ray here."""
    for what, folder in (("root", cfg.run_dir), ("cache", cfg.cache_dir)):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                f"{what}: cannot create {str(folder)!r} ({error.strerror}); set {what}= to a "
                "folder you can write"
            ) from None
    check_model_folder(cfg)
    check_lora(cfg)
    check_environment(cfg)
    check_prompts(cfg)
    check_rewards(cfg)
    check_agent(cfg)
    if (misfit := machine_misfit(cfg)) is not None:
        raise ConfigError(misfit)
