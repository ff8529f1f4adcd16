"""A gymnasium-style text environment of a user's own, named in the config by import path
(``env.name: gym``, ``env.args.make: my_games:SumWithHints``).

It needs nothing from Sluice: ``reset(seed=...)`` gives the first observation and
``step(action)`` gymnasium's ``(observation, reward, terminated, truncated, info)``. Its
randomness comes from ``reset``'s seed only, so an episode can be replayed.
"""

from __future__ import annotations

import random
import re
from typing import Any


class SumWithHints:
    """Add two numbers of ``digits`` digits, with ``tries`` tries: a wrong answer is told
    whether the sum is higher or lower. Reward 1 for a right first answer, halved for
    each further try; 0 when the tries run out."""

    def __init__(self, digits: int = 2, tries: int = 3) -> None:
        self.digits, self.tries = digits, tries
        self.a = self.b = self.taken = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        self.a, self.b, self.taken = rng.randint(low, high), rng.randint(low, high), 0
        return f"What is {self.a}+{self.b}? Answer with just the number.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.taken += 1
        numbers = re.findall(r"-?\d+", action)
        guess = int(numbers[-1]) if numbers else None
        total = self.a + self.b
        if guess == total:
            return "Right.", 0.5 ** (self.taken - 1), True, False, {}
        if self.taken >= self.tries:
            return f"No: it is {total}.", 0.0, True, False, {}
        hint = "not a number" if guess is None else ("higher" if total > guess else "lower")
        return f"No, the sum is {hint}. Try again: just the number.", 0.0, False, False, {}
