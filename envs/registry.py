"""Registry of environments by name: ``make_env("addition", digits=3)``.

A name is one of the built-ins, a name a pip-installed package registers under the
``sluice.environments`` entry point group (``[project.entry-points."sluice.environments"]
sorting = "mypkg.envs:Sorting"``), or an import path ``package.module:Class`` of the user's
own. Whatever it names is called with the keyword arguments and must give an
``Environment``. (``dataset`` is built by ``driver/environment.py``, which owns the storage
it reads from.)
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from sluice.envs.addition import AdditionEnv
from sluice.envs.base import Environment
from sluice.envs.calculator import CalculatorEnv
from sluice.envs.countdown import CountdownEnv
from sluice.envs.guessing import GuessingEnv
from sluice.envs.gym_text import GymTextEnv
from sluice.envs.openenv_envs import OpenEnvEnv
from sluice.envs.reasoning_gym import ReasoningGymEnv
from sluice.envs.rewards import import_function
from sluice.envs.skyrl_gym_envs import SkyRLGymEnv
from sluice.envs.textarena_games import TextArenaEnv
from sluice.envs.verifiers_tasksets import VerifiersEnv

ENTRY_POINTS = "sluice.environments"

BUILTIN: dict[str, Callable[..., Environment]] = {
    "addition": AdditionEnv,
    "countdown": CountdownEnv,
    "reasoning_gym": ReasoningGymEnv,
    "calculator": CalculatorEnv,  # multi-turn, with a tool
    "guessing": GuessingEnv,  # multi-turn
    "textarena": TextArenaEnv,  # multi-turn: TextArena's games (envs/textarena_games.py)
    "gym": GymTextEnv,  # multi-turn: gymnasium-style text environments (envs/gym_text.py)
    "skyrl_gym": SkyRLGymEnv,  # multi-turn: skyrl-gym's, on SkyRL's data (envs/skyrl_gym_envs.py)
    "openenv": OpenEnvEnv,  # multi-turn: OpenEnv's, in the step process (envs/openenv_envs.py)
    "verifiers": VerifiersEnv,  # tasksets, played by their agent (envs/verifiers_tasksets.py)
}
ENV_NAMES: tuple[str, ...] = tuple(BUILTIN)


def registered() -> dict[str, str]:
    """Entry-point names -> what they load (``module:attr``), from installed packages."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}


def env_factory(name: str) -> Callable[..., Environment]:
    """What ``name`` builds; ``ValueError`` naming the allowed names if nothing."""
    if name in BUILTIN:
        return BUILTIN[name]
    for ep in entry_points(group=ENTRY_POINTS):
        if ep.name == name:
            try:
                factory = ep.load()
            except Exception as error:
                raise ValueError(
                    f"environment {name!r} (entry point {ep.value!r}) does not load: "
                    f"{type(error).__name__}: {error}"
                ) from error
            if not callable(factory):
                raise ValueError(f"environment {name!r} ({ep.value!r}) is not callable")
            return factory
    if ":" in name:
        return import_function(name)
    known = [*ENV_NAMES, "dataset", *sorted(registered())]
    raise ValueError(
        f"unknown environment {name!r}; allowed: {', '.join(known)}, or an import path "
        "'package.module:Class'"
    )


def make_env(name: str, **kwargs: Any) -> Environment:
    """Build the environment called ``name`` with ``kwargs``; ``ValueError`` if it cannot be
    built (unknown name, or a constructor that raised: its message is kept)."""
    factory = env_factory(name)
    try:
        env = factory(**kwargs)
    except Exception as error:
        raise ValueError(
            f"environment {name!r} raised in its constructor: {type(error).__name__}: {error}"
        ) from error
    for needed in ("name", "problems", "reward"):
        if not hasattr(env, needed):
            raise ValueError(
                f"environment {name!r} built a {type(env).__name__} without {needed!r}: an "
                "environment has name, problems(split, n, seed) and reward(problem, completion)"
            )
    return env
