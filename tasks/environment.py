"""Build the configured environment and draw its prompt streams."""

from __future__ import annotations

import json

from envs import Environment, Problem, make_env
from rl.config import EnvConfig


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


class PromptStream:
    """Cycles through a fixed pool of training problems, reshuffled each epoch, from a seed."""

    def __init__(self, env: Environment, pool_size: int, seed: int) -> None:
        import random

        self._pool = env.problems("train", pool_size, seed)
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self.epoch = 0

    def take(self, count: int) -> list[Problem]:
        out = []
        for _ in range(count):
            if not self._order:
                self._order = list(range(len(self._pool)))
                self._rng.shuffle(self._order)
                self.epoch += 1
            out.append(self._pool[self._order.pop()])
        return out
