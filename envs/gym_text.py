"""Gymnasium-style text environments as multi-turn environments (``env.name: gym``).

    env:
      name: gym
      args:
        make: mypkg.games:make_wordle        # import path of a function or class
        make_args: {words: 500}              # its keyword arguments
      max_turns: 6

``make(**make_args)`` builds one environment per episode, with gymnasium's text API:
``reset(seed=...)`` returns the first observation (or ``(observation, info)``), and
``step(action)`` returns ``(observation, reward, terminated, truncated, info)`` or the
older ``(observation, reward, done, info)``. An observation is text, or chat messages
(``[{"role": ..., "content": ...}]``, whose contents are joined). A problem is one
episode started from its own seed (which decides the split); the episode's reward is the
last step's, or the sum of all (``episode_reward: sum``), mapped from ``reward_range`` to
[0, 1] (``envs/games.py``, which also keeps or replays the live environment).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sluice.envs.base import Problem, Split
from sluice.envs.games import SEED, EpisodeReward, GameEnv, Turn
from sluice.envs.rewards import import_function


def observation_text(observation: Any) -> str:
    """Text, or chat messages' contents on lines of their own."""
    if isinstance(observation, str):
        return observation
    if isinstance(observation, list) and all(isinstance(m, dict) for m in observation):
        return "\n".join(str(m.get("content", "")) for m in observation)
    raise TypeError(
        f"an observation must be text or chat messages, not {type(observation).__name__}"
    )


class GymGame:
    """One gymnasium-style environment, reset with ``seed``."""

    def __init__(self, env: Any, seed: int) -> None:
        self.env, self.seed = env, seed

    def start(self) -> str:
        first = self.env.reset(seed=self.seed)
        return observation_text(first[0] if isinstance(first, tuple) else first)

    def act(self, action: str) -> Turn:
        out = self.env.step(action)
        if not isinstance(out, tuple) or len(out) not in (4, 5):
            raise TypeError(
                "step must return (observation, reward, terminated, truncated, info) or "
                f"(observation, reward, done, info), not {type(out).__name__}"
            )
        done = bool(out[2] or out[3]) if len(out) == 5 else bool(out[2])
        return Turn(observation_text(out[0]), float(out[1]), done)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


class GymTextEnv(GameEnv):
    """Episodes of the environment ``make`` builds (see the module's docstring)."""

    import_args = ("make",)  # the user's code: its folder reaches the step process

    def __init__(
        self,
        make: str,
        make_args: dict[str, Any] | None = None,
        reward_range: Sequence[float] = (0.0, 1.0),
        episode_reward: EpisodeReward = "last",
        correct_at: float = 1.0,
    ) -> None:
        super().__init__(f"gym/{make}", reward_range, episode_reward, correct_at)
        self.make: Callable[..., Any] = import_function(make)
        self.make_args = dict(make_args or {})

    def new_game(self, problem: Problem) -> GymGame:
        return GymGame(self.make(**self.make_args), int(problem.fields[SEED]))

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        return self.seeded_problems(split, n, seed)
