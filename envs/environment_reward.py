"""An environment plugin's ``reward`` method as a reward function, so that it runs where a
user's reward functions run: in the isolated processes of a ``RewardPool``
(``envs/rewards.py``). ``envs/scoring.py`` picks it for an environment named by import path
or entry point; the built-in environments keep their in-process verifiers.

Each pool process builds the environment once, from its name and constructor arguments, and
scores each problem (sent whole, as JSON) with it.
"""

from __future__ import annotations

import json
from typing import Any

from sluice.envs.base import Environment, Problem, score
from sluice.envs.registry import make_env

PATH = "sluice.envs.environment_reward:environment"

_built: dict[str, Environment] = {}


def environment(
    problem: dict[str, Any], completion: str, env_name: str, env_args: dict[str, Any]
) -> dict[str, Any]:
    """``env_name``'s verdict on ``completion``, with the result's own metrics; raises with
    the verifier's reason when it failed (the pool records that sample as failed)."""
    key = json.dumps([env_name, env_args], sort_keys=True, default=str)
    env = _built.get(key)
    if env is None:
        env = _built[key] = make_env(env_name, **env_args)
    # No in-process time budget: the pool's per-call timeout bounds the call.
    result = score(env, Problem(**problem), completion, timeout_s=0)
    if result.error is not None:
        raise RuntimeError(result.error)
    return {"reward": result.reward, "correct": result.correct, **result.metrics}
