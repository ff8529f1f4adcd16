"""The multi-turn environment plugin API: an episode alternates model turns and
environment turns and ends with a reward.

A multi-turn environment is a plugin like a single-turn one (import path or entry point,
``envs/registry.py``): it has a ``name``, ``problems(split, n, seed)``, and
``step(problem, history)``, called after every model turn with the episode so far:
``history`` is the model's turns and the environment's observations, alternating, first
and last a model turn (text, as decoded from the sampled tokens). It answers an
``EnvStep``: an observation to show the model (tool results, a user's reply, feedback),
or ``done`` with the episode's reward. ``step`` may be ``async``; it must not keep state
between calls that ``history`` does not hold, so an episode can continue on another worker
(repack, a worker that died). ``MultiTurn`` marks such an environment (``multi_turn =
True``); the rollout worker runs its episodes (``engines/rollout/episodes.py``).

A problem's ``answer`` may hold a reference episode (``reference_episode``), which the
built-in policy's warm start learns from: each model turn followed by the end of its turn
(EOS), each observation as the environment would give it.

Token-exact: the observation is tokenized once, as text, and appended after the tokens the
model sampled; earlier turns are never re-tokenized. A plain observation should therefore
start with whatever separates it from the model's turn (a newline, a tag) and end with
whatever invites the next model turn; with a chat model, an observation with a ``role`` is
rendered by the model's chat template instead (``engines/agents/chat_template.py``).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from sluice.envs.base import Problem, RewardResult, Split

TURN_SEPARATOR = "\x1e"
"""Separates the turns of a reference episode in ``Problem.answer`` (model turns first and
last, observations between); ASCII's record separator, never part of a turn's text."""


def reference_turns(answer: str) -> list[str]:
    """The turns of a reference episode: model, observation, model, ..."""
    return answer.split(TURN_SEPARATOR)


def reference_episode(turns: list[str]) -> str:
    return TURN_SEPARATOR.join(turns)


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one model turn."""

    observation: str = ""
    """Text appended after the model's turn when the episode goes on."""
    done: bool = False
    reward: float = 0.0
    """The episode's reward in [0, 1], read when ``done``."""
    correct: bool = False
    """The episode succeeded (what accuracy counts), read when ``done``."""
    tool_calls: int = 0
    """Tool calls this turn made (metrics)."""
    tool_errors: Mapping[str, int] = field(default_factory=dict)
    """Failed tool calls of this turn by kind (metrics)."""
    role: str | None = None
    """With a chat model: the observation is a message of this role (``"user"``,
    ``"tool"``), which the model's chat template renders after the model's turn. None: the
    observation is appended as it is."""


@dataclass(frozen=True)
class EpisodeLimits:
    """How far an episode may go (``env`` in the config): model turns, tokens of one model
    turn (None: the episode's whole budget, ``rollout.max_new_tokens``, which counts the
    environment's tokens too), and the seconds one environment step may take."""

    max_turns: int = 4
    max_turn_tokens: int | None = None
    step_timeout_s: float = 30.0


@runtime_checkable
class MultiTurn(Protocol):
    """What a multi-turn environment provides."""

    name: str
    multi_turn: bool

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]: ...

    def step(self, problem: Problem, history: list[str]) -> EnvStep | Awaitable[EnvStep]: ...


def is_multi_turn(env: object) -> bool:
    return bool(getattr(env, "multi_turn", False)) and callable(getattr(env, "step", None))


def check_step(step: Any) -> EnvStep:
    """``step`` if it is a valid ``EnvStep``, else ``TypeError``/``ValueError`` saying why."""
    if not isinstance(step, EnvStep):
        raise TypeError(f"step returned {type(step).__name__}, not EnvStep")
    if not isinstance(step.observation, str):
        raise TypeError(f"observation is {type(step.observation).__name__}, not str")
    if step.role is not None and not isinstance(step.role, str):
        raise TypeError(f"role is {type(step.role).__name__}, not str or None")
    reward = step.reward
    if step.done and not (
        isinstance(reward, int | float) and math.isfinite(reward) and 0 <= reward <= 1
    ):
        raise ValueError(f"reward {reward!r} is not a number in [0, 1]")
    return step


def episode_result(step: EnvStep) -> RewardResult:
    """A finished episode's verdict, as a single-turn sample's would be."""
    return RewardResult(float(step.reward), bool(step.correct))
