"""Registry of environments by name: ``make_env("addition", digits=3)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sluice.envs.addition import AdditionEnv
from sluice.envs.base import Environment
from sluice.envs.countdown import CountdownEnv

ENV_NAMES: tuple[str, ...] = ("addition", "countdown")

_FACTORIES: dict[str, Callable[..., Environment]] = {
    "addition": AdditionEnv,
    "countdown": CountdownEnv,
}


def make_env(name: str, **kwargs: Any) -> Environment:
    """Build the environment called ``name`` with ``kwargs``; raise ``ValueError`` if unknown."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown environment {name!r}; allowed: {', '.join(ENV_NAMES)}")
    return factory(**kwargs)
