"""A guessing game with "higher"/"lower" feedback: a multi-turn environment without tools.

The model guesses a secret number in ``1..high``; after each wrong guess the environment
answers ``" higher\\n"`` or ``" lower\\n"`` (or ``" not a number\\n"``) and the model guesses
again, until it is right or runs out of turns (``env.max_turns``):

* prompt ``"guess 1-32\\n"``
* model turn ``"16"``, observation ``" higher\\n"``, model turn ``"24"``, ...

Reward on the right guess: ``1 - (guesses - 1) / search_turns`` (fewer guesses, more reward,
never below 0.1), correct. ``answer`` is the binary-search episode, which the built-in
policy's warm start learns from (``multi_turn.reference_episode``). Every prompt reads the
same (the secret is never shown), so each draw is a problem of its own and the split is
drawn with it.
"""

from __future__ import annotations

import math
import random

from sluice.envs.base import (
    Draft,
    Problem,
    RewardResult,
    Split,
    check_positive_int,
    draw_problems,
    parse_nonneg_int,
)
from sluice.envs.multi_turn import TURN_SEPARATOR, EnvStep, reference_episode, reference_turns


class GuessingEnv:
    """Find a secret in ``1..high`` from higher/lower feedback."""

    multi_turn = True

    def __init__(self, high: int = 32) -> None:
        self.high = check_positive_int("high", high)
        if self.high < 2:
            raise ValueError(f"high must be at least 2, got {high}")
        self.name = "guessing"
        self.search_turns = math.ceil(math.log2(self.high + 1))

    def _draft(self, rng: random.Random) -> Draft:
        secret = rng.randint(1, self.high)
        low, high, turns = 1, self.high, []
        while True:
            guess = (low + high) // 2
            turns.append(str(guess))
            if guess == secret:
                break
            turns.append(self.feedback(guess, secret))
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
        draft_id = f"{secret}:{rng.random()}"
        return Draft(draft_id, f"guess 1-{self.high}\n", reference_episode(turns))

    @staticmethod
    def feedback(guess: int, secret: int) -> str:
        return " higher\n" if guess < secret else " lower\n"

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        return draw_problems(self.name, split, n, seed, self._draft)

    @staticmethod
    def secret(problem: Problem) -> int:
        return int(reference_turns(problem.answer)[-1])

    def step(self, problem: Problem, history: list[str]) -> EnvStep:
        guesses = (len(history) + 1) // 2
        guess = parse_nonneg_int(history[-1].strip(), max_digits=6)
        secret = self.secret(problem)
        if guess == secret:
            reward = max(0.1, 1.0 - (guesses - 1) / self.search_turns)
            return EnvStep(done=True, reward=reward, correct=True)
        if guess is None:
            return EnvStep(" not a number\n")
        return EnvStep(self.feedback(guess, secret))

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        """A whole episode's text: right if its last guess is the secret."""
        last = completion.replace(TURN_SEPARATOR, "\n").strip().rsplit("\n", 1)[-1]
        guess = parse_nonneg_int(last.split(" ")[0], max_digits=6)
        correct = guess == self.secret(problem)
        return RewardResult(float(correct), correct)
