"""skyrl-gym environments as multi-turn environments (``env.name: skyrl_gym``; the
``skyrl-gym`` package, ``pip install 'sluice[envs]'``).

    env:
      name: skyrl_gym
      args: {env_class: gsm8k_multi_turn, env_config: {}}   # else the row's; or an import path
      data:
        path: data/gsm8k/train.parquet                       # SkyRL's dataset format
        answer: null
      max_turns: 5

The data file is SkyRL's: a row per problem with ``prompt`` (chat messages), and the
environment's extras beside it (``env_class``, ``reward_spec``, ``extra_info``, ...). As in
SkyRL's generator, each episode builds ``skyrl_gym.make(env_class, env_config=...,
extras=row)``, the model's first prompt is what ``env.init(prompt)`` returns, rendered with
the model's chat template (so a model folder with one is needed), and each model turn is
an ``env.step(action)``: its ``observations`` (messages) become the next message, with the
first one's role. The episode's reward is its last step's (SkyRL's per-turn rewards summed
instead with ``episode_reward: sum``), mapped from ``reward_range`` to [0, 1]
(``envs/games.py``, which also keeps or replays the live environment).

The run reads the data (``driver/environment.py``: local or ``s3://``, held-out rows from
``heldout_path`` or by hash, streamed) and hands it over with ``use_data``; the step
process builds this environment from ``args`` alone, as a problem carries its row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sluice.envs.base import Problem, Split
from sluice.envs.dataset import DatasetEnv
from sluice.envs.games import CHAT, EpisodeReward, GameEnv, GameError, Turn
from sluice.envs.prompts import PromptSource
from sluice.envs.rewards import import_function

ROW = "skyrl_row"
"""A problem field: the data row (the environment's extras), its prompt included."""


def _skyrl_gym() -> Any:
    try:
        import skyrl_gym
    except ImportError as error:
        raise ValueError(
            f"the skyrl_gym environment needs the skyrl-gym package ({error}); install it "
            "with pip install 'sluice[envs]'"
        ) from None
    return skyrl_gym


def _messages(observations: Any) -> tuple[str, str]:
    """skyrl-gym's observation messages as one message: contents joined, the first role."""
    if not observations:
        return "", "user"
    if not isinstance(observations, list) or not all(isinstance(m, dict) for m in observations):
        raise GameError(f"observations must be chat messages, not {observations!r:.80}")
    text = "\n".join(str(m.get("content", "")) for m in observations)
    return text, str(observations[0].get("role", "user"))


class SkyRLGame:
    """One skyrl-gym environment, built from a row."""

    def __init__(self, env_class: str, env_config: dict[str, Any], row: dict[str, Any]) -> None:
        self.row = row
        extras = {k: v for k, v in row.items() if k != "prompt"}
        if ":" in env_class:  # a class of the user's own, by import path
            self.env = import_function(env_class)(env_config=env_config, extras=extras)
        else:
            self.env = _skyrl_gym().make(env_class, env_config=env_config, extras=extras)

    def start(self) -> list[dict[str, str]]:
        messages, _ = self.env.init(list(self.row["prompt"]))
        return list(messages)

    def act(self, action: str) -> Turn:
        out = self.env.step(action)
        text, role = _messages(out.get("observations"))
        return Turn(text, float(out["reward"]), bool(out["done"]), role)

    def close(self) -> None:
        self.env.close()


class SkyRLGymEnv(GameEnv):
    """Episodes of skyrl-gym's ``env_class`` (or each row's), on the run's data."""

    import_args = ("env_class",)  # a class of the user's own: its folder reaches steps

    def __init__(
        self,
        env_class: str | None = None,
        env_config: dict[str, Any] | None = None,
        reward_range: Sequence[float] = (0.0, 1.0),
        episode_reward: EpisodeReward = "last",
        correct_at: float = 1.0,
    ) -> None:
        super().__init__(
            f"skyrl_gym/{env_class or 'rows'}", reward_range, episode_reward, correct_at
        )
        registry = _skyrl_gym().registry
        if env_class is not None and ":" not in env_class and env_class not in registry:
            raise ValueError(
                f"unknown skyrl-gym environment {env_class!r}; registered: "
                f"{', '.join(sorted(registry))}, or an import path 'package.module:Class'"
            )
        self.env_class, self.env_config = env_class, dict(env_config or {})
        self.data: DatasetEnv | None = None

    def use_data(self, data: DatasetEnv) -> None:
        """The run's data file, read with every column as a field."""
        self.data = data

    def new_game(self, problem: Problem) -> SkyRLGame:
        row = dict(problem.fields[ROW])
        env_class = self.env_class or row.get("env_class")
        if not env_class:
            raise GameError("the row has no env_class; set env.args.env_class")
        return SkyRLGame(str(env_class), self.env_config, row)

    def first_prompt(self, problem: Problem) -> Problem:
        """A data row's problem with the prompt its environment's ``init`` makes."""
        fields = {ROW: dict(problem.fields)}
        started = replace(problem, fields=fields)
        with self._serial:
            game = self.new_game(started)
            messages = game.start()
            game.close()
        if self._render is None:
            raise ValueError(
                "skyrl-gym prompts are chat messages: the policy needs a chat template"
            )
        return replace(started, prompt=self._render(messages), fields={**fields, CHAT: True})

    def _rows(self) -> DatasetEnv:
        if self.data is None:
            raise ValueError("skyrl_gym reads its problems from env.data (SkyRL's dataset file)")
        return self.data

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        return [self.first_prompt(p) for p in self._rows().problems(split, n, seed)]

    def stream(self, seed: int) -> PromptSource:
        return _FirstPrompts(self, self._rows().stream(seed))


class _FirstPrompts:
    """The data's training stream, each problem with its environment's first prompt."""

    def __init__(self, env: SkyRLGymEnv, rows: PromptSource) -> None:
        self.env, self.rows = env, rows

    def take(self, count: int) -> list[Problem]:
        return [self.env.first_prompt(p) for p in self.rows.take(count)]

    def cursor(self) -> dict[str, Any]:
        return self.rows.cursor()

    def restore(self, cursor: dict[str, Any]) -> None:
        self.rows.restore(cursor)
