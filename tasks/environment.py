"""Build the configured environment (``env`` in the config), and check a run against it
before anything starts."""

from __future__ import annotations

import json

from sluice.envs import Environment, make_env
from sluice.rl.config import ConfigError, EnvConfig, PolicyConfig, RunConfig


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


def max_model_len(policy: PolicyConfig) -> int | None:
    """vLLM's context: the built-in policy's ``policy.max_positions``; for a model folder
    (``policy.path``) None, and vLLM takes the context from the folder's config.json."""
    return None if policy.path is not None else policy.max_positions


def check_context(cfg: RunConfig) -> None:
    """Every prompt the run draws, plus ``rollout.max_new_tokens``, fits the built-in
    policy's context (``policy.max_positions``); a ConfigError naming the longest if not.

    The built-in policy has one token per character and a BOS token. A model folder
    (``policy.path``) is checked by vLLM when it starts.
    """
    if cfg.policy.path is not None:
        return
    env, _ = make_environment(cfg.env)
    seed = cfg.seed if cfg.env.train_seed is None else cfg.env.train_seed
    prompts = [
        *env.problems("train", cfg.env.train_prompts, seed),
        *env.problems("heldout", cfg.eval.prompts, cfg.seed + 1),
    ]
    longest = max(prompts, key=lambda p: len(p.prompt))
    need = len(longest.prompt) + 1 + cfg.rollout.max_new_tokens
    if need > cfg.policy.max_positions:
        raise ConfigError(
            f"the longest prompt ({len(longest.prompt) + 1} tokens, {longest.prompt!r}) plus "
            f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) is {need} tokens, more "
            f"than policy.max_positions ({cfg.policy.max_positions}); raise max_positions or "
            "lower max_new_tokens"
        )
