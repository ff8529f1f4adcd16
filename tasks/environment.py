"""Build the configured environment (``env`` in the config)."""

from __future__ import annotations

import json

from sluice.envs import Environment, make_env
from sluice.rl.config import EnvConfig


def make_environment(cfg: EnvConfig) -> tuple[Environment, str]:
    """The environment and a signature string that changes whenever its problems would."""
    if cfg.name == "addition":
        env = make_env("addition", digits=cfg.digits, long_tail=cfg.long_tail, scratch=cfg.scratch)
        knobs = {"digits": cfg.digits, "long_tail": cfg.long_tail, "scratch": cfg.scratch}
    else:
        env = make_env(
            "countdown", count=cfg.count, max_number=cfg.max_number, long_tail=cfg.long_tail
        )
        knobs = {"count": cfg.count, "max_number": cfg.max_number, "long_tail": cfg.long_tail}
    return env, json.dumps({"name": cfg.name, **knobs}, sort_keys=True)
