"""A stream of training prompts drawn from an environment, with a cursor checkpoints keep."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from sluice.envs.base import Environment, Problem

# A stream that has gone round this many times without one prompt that fits is all too long.
EPOCHS_WITHOUT_A_FIT = 2


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
    A duplicate is the same prompt with the same answer: problems whose prompts read the
    same can still differ (a guessing game's secret is in its answer, never in its prompt).
    """

    def __init__(self, env: Environment, pool_size: int, seed: int) -> None:
        unique = {(p.prompt, p.answer): p for p in env.problems("train", pool_size, seed)}
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


class PromptsTooLong(ValueError):
    """No training prompt fits the model's context with room for the response."""


class SkipSink(Protocol):
    """Where a passed-over prompt is recorded (the ledger, through the trajectory store)."""

    def skipped(self, problem: Problem, reason: str) -> None: ...


class FittingPrompts:
    """The prompts of ``inner`` whose ``length`` (in tokens) is at most ``limit``; each one
    longer is passed over and recorded with ``sink``, with the reason. ``PromptsTooLong``
    names the count and the longest when the stream goes round ``EPOCHS_WITHOUT_A_FIT``
    times without a prompt that fits."""

    def __init__(
        self,
        inner: PromptSource,
        length: Callable[[str], int],
        limit: int,
        sink: SkipSink,
        why: str,
    ) -> None:
        self.inner, self.length, self.limit, self.sink, self.why = inner, length, limit, sink, why
        self.passed_over = 0
        self._longest = 0
        self._since_fit = 0

    def take(self, count: int) -> list[Problem]:
        out: list[Problem] = []
        start = getattr(self.inner, "epoch", 0)
        while len(out) < count:
            for problem in self.inner.take(count - len(out)):
                tokens = self.length(problem.prompt)
                if tokens <= self.limit:
                    out.append(problem)
                    self._since_fit = 0
                    continue
                self.passed_over += 1
                self._since_fit += 1
                self._longest = max(self._longest, tokens)
                self.sink.skipped(problem, f"the prompt is {tokens} tokens: {self.why}")
            if not out and getattr(self.inner, "epoch", 0) - start >= EPOCHS_WITHOUT_A_FIT:
                raise PromptsTooLong(
                    f"every training prompt is too long: {self._since_fit} in a row passed "
                    f"over, the longest {self._longest} tokens ({self.why})"
                )
        return out

    def cursor(self) -> dict[str, Any]:
        return self.inner.cursor()

    def restore(self, cursor: dict[str, Any]) -> None:
        self.inner.restore(cursor)
