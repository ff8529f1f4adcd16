"""What the game adapters' tests import by path (their steps may run in a process of their
own): a fixed TextArena opponent and small gymnasium-style text environments."""

from __future__ import annotations

import random
import re
from typing import Any


def first_available(observation: str) -> str:
    """A TextArena board game's first available move (``Available Moves: '[3]', ...``)."""
    moves = re.findall(r"'(\[\d+\])'", observation.rsplit("Available Moves:", 1)[-1])
    return moves[0] if moves else "[0]"


class Countdown:
    """Say the numbers from a seeded start down to 1, one a turn: gymnasium's five-tuple
    API, reward 1 when the model reaches 1 without a mistake, 0 at the first mistake."""

    def __init__(self, highest: int = 5) -> None:
        self.highest, self.next = highest, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.next = random.Random(seed).randint(2, self.highest)
        return f"count down from {self.next}", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action.strip() != str(self.next):
            return "wrong", 0.0, True, False, {}
        self.next -= 1
        if self.next == 0:
            return "done", 1.0, True, False, {}
        return "next", 0.0, False, False, {}


class Tally:
    """The older four-tuple API and chat-message observations: every turn scores the
    length of the model's reply, and the episode ends after ``turns``."""

    def __init__(self, turns: int = 2) -> None:
        self.turns, self.taken = turns, 0

    def reset(self, seed: int | None = None) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"say anything ({seed % 7})"}]

    def step(self, action: str) -> tuple[list[dict[str, str]], float, bool, dict[str, Any]]:
        self.taken += 1
        observation = [{"role": "user", "content": "again"}, {"role": "user", "content": "!"}]
        return observation, float(len(action)), self.taken >= self.turns, {}


class Drifting(Countdown):
    """Countdown whose start ignores the seed: not replayable."""

    draws = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        Drifting.draws += 1
        self.next = 2 + Drifting.draws % 3
        return "count down", {}
