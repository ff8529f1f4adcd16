"""Verifiable environments for RL post-training: seeded problem generators and safe verifiers.

See ``envs.base`` for the shared types and split rules, ``envs.addition`` and
``envs.countdown`` for each task's prompt/answer formats and rewards.
"""

from envs.addition import AdditionEnv
from envs.base import ALPHABET, Environment, Problem, RewardResult, score
from envs.countdown import CountdownEnv
from envs.registry import ENV_NAMES, make_env

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
