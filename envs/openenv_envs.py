"""OpenEnv environments as multi-turn environments (``env.name: openenv``; the
``openenv-core`` package, ``pip install 'sluice[envs]'``).

    env:
      name: openenv
      args:
        environment: my_env.server:WordGameEnvironment   # an openenv Environment class
        environment_args: {words: 200}
      max_turns: 8

An OpenEnv environment is a class with ``reset(seed=...)`` and ``step(action)``, both
answering an ``Observation`` (pydantic: ``done``, ``reward``, and the environment's own
fields), and a pydantic ``Action`` type. It runs in the environment's step process, one
instance per episode (``envs/games.py`` keeps it live or replays it), not behind OpenEnv's
HTTP server: the step process is already the isolation the server would give.

A problem is one episode reset with its own seed (which decides the split); its prompt is
the first observation's text. Each model turn becomes the action: the action type is the
one the class declares (``Environment[MyAction, MyObservation, MyState]``, or ``action``),
with the turn's text in its one text field (or ``action_field``). An observation's text
is its one text field besides ``done``, ``reward`` and ``metadata`` (or
``observation_field``), else those fields as JSON. The episode's reward is the last
observation's (``episode_reward: sum`` adds every step's), mapped from ``reward_range`` to
[0, 1].
"""

from __future__ import annotations

import json
import typing
from collections.abc import Sequence
from typing import Any

from sluice.envs.base import Problem, Split
from sluice.envs.games import SEED, EpisodeReward, GameEnv, Turn
from sluice.envs.rewards import import_function

BASE_FIELDS = ("done", "reward", "metadata")


def _openenv_base() -> tuple[type, type, type]:
    try:
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.types import Action, Observation
    except ImportError as error:
        raise ValueError(
            f"the openenv environment needs the openenv-core package ({error}); install it "
            "with pip install 'sluice[envs]'"
        ) from None
    return Environment, Action, Observation


def declared_action(environment: type) -> type | None:
    """The action type an OpenEnv environment class declares as its first type argument."""
    _, action_base, _ = _openenv_base()
    for klass in environment.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            for arg in typing.get_args(base):
                if isinstance(arg, type) and issubclass(arg, action_base):
                    return arg
    return None


def _text_fields(model: type) -> list[str]:
    fields = getattr(model, "model_fields", {})
    return [n for n, f in fields.items() if n not in BASE_FIELDS and f.annotation is str]


class OpenEnvGame:
    """One OpenEnv environment instance, reset with ``seed``."""

    def __init__(self, env: Any, seed: int, action: type, action_field: str, shown: str | None):
        self.env, self.seed = env, seed
        self.action, self.action_field, self.shown = action, action_field, shown

    def text(self, observation: Any) -> str:
        if self.shown is not None:
            return str(getattr(observation, self.shown))
        data = observation.model_dump(exclude=set(BASE_FIELDS))
        if len(data) == 1:
            return str(next(iter(data.values())))
        return json.dumps(data, default=str)

    def start(self) -> str:
        return self.text(self.env.reset(seed=self.seed))

    def act(self, action: str) -> Turn:
        observation = self.env.step(self.action(**{self.action_field: action}))
        reward = observation.reward
        return Turn(self.text(observation), float(reward or 0.0), bool(observation.done))

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


class OpenEnvEnv(GameEnv):
    """Episodes of the OpenEnv ``environment`` class (see the module's docstring)."""

    import_args = ("environment", "action")  # the user's code: its folder reaches steps

    def __init__(
        self,
        environment: str,
        environment_args: dict[str, Any] | None = None,
        action: str | None = None,
        action_field: str | None = None,
        observation_field: str | None = None,
        reward_range: Sequence[float] = (0.0, 1.0),
        episode_reward: EpisodeReward = "last",
        correct_at: float = 1.0,
    ) -> None:
        super().__init__(f"openenv/{environment}", reward_range, episode_reward, correct_at)
        env_base, action_base, _ = _openenv_base()
        self.environment = import_function(environment)
        if not (isinstance(self.environment, type) and issubclass(self.environment, env_base)):
            raise ValueError(f"{environment!r} is not an OpenEnv Environment class")
        found = import_function(action) if action else declared_action(self.environment)
        if not (isinstance(found, type) and issubclass(found, action_base)):
            raise ValueError(
                f"{environment!r} declares no Action type; name it with env.args.action"
            )
        self.action: type = found
        texts = _text_fields(found)
        if action_field is None and len(texts) != 1:
            raise ValueError(
                f"{found.__name__} has {len(texts)} text fields ({', '.join(texts) or 'none'}); "
                "name the one that takes the model's turn with env.args.action_field"
            )
        self.action_field = action_field or texts[0]
        if self.action_field not in getattr(found, "model_fields", {}):
            raise ValueError(f"{found.__name__} has no field {self.action_field!r}")
        self.observation_field = observation_field
        self.environment_args = dict(environment_args or {})

    def new_game(self, problem: Problem) -> OpenEnvGame:
        return OpenEnvGame(
            self.environment(**self.environment_args),
            int(problem.fields[SEED]),
            self.action,
            self.action_field,
            self.observation_field,
        )

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        return self.seeded_problems(split, n, seed)
