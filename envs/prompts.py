"""A stream of training prompts drawn from an environment, with a cursor checkpoints keep."""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

from sluice.envs.base import Environment, Problem


class PromptSource(Protocol):
    """Training prompts, handed out in order; ``cursor`` is JSON data a checkpoint keeps,
    and ``restore`` continues from it."""

    def take(self, count: int) -> list[Problem]: ...

    def cursor(self) -> dict[str, Any]: ...

    def restore(self, cursor: dict[str, Any]) -> None: ...


@runtime_checkable
class StreamsPrompts(Protocol):
    """An environment that streams its own training prompts (a data file, scanned)."""

    def stream(self, seed: int) -> PromptSource: ...


def training_prompts(env: Environment, pool_size: int, seed: int) -> PromptSource:
    """``env``'s own stream if it has one, else a ``PromptStream`` over a drawn pool."""
    if isinstance(env, StreamsPrompts):
        return env.stream(seed)
    return PromptStream(env, pool_size, seed)


class PromptStream:
    """Cycles through a fixed pool of distinct training problems, reshuffled each epoch.

    Duplicates are removed because held-out problems are distinct too: with repeats, small
    problems (``3+5=``) would crowd the training stream while the held-out set, drawn
    without repeats, is mostly large ones, and training would not aim at what is measured.
    """

    def __init__(self, env: Environment, pool_size: int, seed: int) -> None:
        unique = {p.prompt: p for p in env.problems("train", pool_size, seed)}
        self._pool = list(unique.values())
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self.epoch = 0

    def cursor(self) -> dict[str, Any]:
        """Where the stream stands, as JSON data (for checkpoints); ``restore`` resumes it."""
        version, state, gauss = self._rng.getstate()
        return {
            "epoch": self.epoch,
            "order": list(self._order),
            "rng": [version, list(state), gauss],
        }

    def restore(self, cursor: dict[str, Any]) -> None:
        version, state, gauss = cursor["rng"]
        self._rng.setstate((version, tuple(state), gauss))
        self._order = [int(i) for i in cursor["order"]]
        if any(not 0 <= i < len(self._pool) for i in self._order):
            raise ValueError("data cursor does not match this prompt pool (different config?)")
        self.epoch = int(cursor["epoch"])

    def take(self, count: int) -> list[Problem]:
        out = []
        for _ in range(count):
            if not self._order:
                self._order = list(range(len(self._pool)))
                self._rng.shuffle(self._order)
                self.epoch += 1
            out.append(self._pool[self._order.pop()])
        return out
