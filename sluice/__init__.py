"""Sluice: asynchronous, streaming RL post-training for language models.

The one import name of an installed Sluice. Its parts are the repository's top-level
folders, mapped into this namespace by ``pyproject.toml``: ``sluice.flows`` (the Prefect
flows and the CLI), ``sluice.tasks`` (the Prefect tasks they compose), ``sluice.driver``
(what those tasks wire together and step), ``sluice.policy`` (the starting policy),
``sluice.engines`` (rollout, training and agent serving, and the Ray actors that host them),
``sluice.storage`` (the data planes and records), ``sluice.rl`` (pure algorithm code),
``sluice.envs`` (environments) and ``sluice.sim`` (the simulator); ``sluice.config`` (the run
configuration) lives in this folder. The benchmarks (``benchmarks/``) run from a checkout
and are not part of it.

What a user's own code is written against is re-exported here: the environment types,
``batched`` for reward functions that take a whole group, the config tree and its loader,
and :func:`run`, which runs one RL job as the ``sluice run`` command does. Importing
``sluice`` imports neither Ray, Prefect nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sluice.config.tree import ConfigError, RunConfig, build_config, load_config
from sluice.envs import Environment, Problem, RewardResult, make_env, score
from sluice.envs.rewards import batched

if TYPE_CHECKING:
    from sluice.flows.api import RunSummary

__all__ = [
    "ConfigError",
    "Environment",
    "Problem",
    "RewardResult",
    "RunConfig",
    "batched",
    "build_config",
    "load_config",
    "make_env",
    "run",
    "score",
]


def run(config: Any = None, overrides: list[str] | None = None, resume: bool = False) -> RunSummary:
    """Run one RL job and return its summary; see :func:`sluice.flows.api.run`."""
    from sluice.flows.api import run as run_job  # Prefect must be configured before import

    return run_job(config, overrides, resume=resume)
