"""Verifiable environments for RL post-training: seeded problem generators and safe verifiers.

See ``envs.base`` for the shared types and split rules, ``envs.addition`` and
``envs.countdown`` for each task's prompt/answer formats and rewards.
"""

from sluice.envs.addition import AdditionEnv
from sluice.envs.base import ALPHABET, Environment, Problem, RewardResult, score
from sluice.envs.countdown import CountdownEnv
from sluice.envs.registry import ENV_NAMES, make_env

__all__ = [
    "ALPHABET",
    "ENV_NAMES",
    "AdditionEnv",
    "CountdownEnv",
    "Environment",
    "Problem",
    "RewardResult",
    "make_env",
    "score",
]
