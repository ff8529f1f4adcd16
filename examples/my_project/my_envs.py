"""A user's environment, named in the config by import path (``env.name:
my_envs:Reverse``, with ``env.args`` passed to its constructor).

An environment makes problems (``problems(split, n, seed)``) and scores completions
(``reward(problem, completion)``); ``sluice.Problem`` and ``sluice.RewardResult`` are the
types. ``sluice.envs.base.split_of`` keeps the training and held-out problems apart.
"""

from __future__ import annotations

import random

from sluice import Problem, RewardResult
from sluice.envs.base import split_of

LETTERS = "abcdefghij"


class Reverse:
    """Write a word backwards: ``"reverse abc:"`` -> ``"cba"``."""

    name = "reverse"

    def __init__(self, shortest: int = 2, longest: int = 5) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError(f"need 1 <= shortest <= longest, got {shortest}, {longest}")
        self.shortest, self.longest = shortest, longest

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        rng, out = random.Random(seed), []
        while len(out) < n:
            size = rng.randint(self.shortest, self.longest)
            word = "".join(rng.choice(LETTERS) for _ in range(size))
            if split_of(self.name, word) != split:
                continue
            out.append(
                Problem(
                    f"{self.name}/{split}/{seed}/{len(out)}",
                    self.name,
                    f"reverse {word}:",
                    word[::-1],
                    split,
                )
            )
        return out

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        want, got = problem.answer, completion.strip()
        right = got == want
        # partial credit: the share of letters in place
        close = sum(a == b for a, b in zip(got, want, strict=False)) / len(want)
        return RewardResult(1.0 if right else 0.5 * close, right)
