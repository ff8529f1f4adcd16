"""An OpenEnv environment for the adapter's tests, written with ``openenv-core``'s API and
importable by path (its steps run in a process of their own)."""

from __future__ import annotations

import random
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class WordAction(Action):
    word: str


class WordObservation(Observation):
    prompt: str


class WordLength(Environment[WordAction, WordObservation, State]):
    """Say a word of the asked length: reward 1 and done when it has it, else told the
    length again, at most ``tries`` times (then reward 0)."""

    def __init__(self, tries: int = 3) -> None:
        super().__init__()
        self.tries, self.length, self._state = tries, 0, State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **_: Any):
        self.length = random.Random(seed).randint(2, 6)
        self._state = State(episode_id=episode_id, step_count=0)
        return WordObservation(prompt=f"a word of {self.length} letters")

    def step(self, action: WordAction, timeout_s: float | None = None, **_: Any):
        self._state.step_count += 1
        if len(action.word.strip()) == self.length:
            return WordObservation(prompt="right", done=True, reward=1.0)
        done = self._state.step_count >= self.tries
        return WordObservation(prompt=f"no: {self.length} letters", done=done, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
