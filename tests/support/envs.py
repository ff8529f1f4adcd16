"""Multi-turn environments for the episode tests, importable by path (``tests.support.envs:
Echo``) because their steps run in a process of their own (``engines/rollout/episodes.py``)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

from sluice.engines.rollout.episodes import StepSpec
from sluice.envs import Problem, RewardResult
from sluice.envs.multi_turn import EnvStep

ROOT = str(Path(__file__).parents[2])
OBSERVATION = " answer 12+34=46 plus {turn}\n"


def spec(env: object, memory_mib: int | None = None, **args: object) -> StepSpec:
    """How the step process builds an environment of this module."""
    return StepSpec(f"{__name__}:{type(env).__name__}", args, (ROOT,), memory_mib)


class _Episodes:
    """What these environments share: problems ``p0``, ``p1``, ... that read ``Q``, and a
    ``reward`` for the registry's check that is never what scores them (their steps end
    each episode with its reward)."""

    name, multi_turn = "episodes", True

    def problems(self, split, n, seed):
        return [Problem(f"p{i}", self.name, "Q", "", split) for i in range(n)]

    def reward(self, problem, completion):
        return RewardResult(0.0, False)


class Echo(_Episodes):
    """Three model turns; the environment answers with text a BPE tokenizer merges."""

    name = "echo"

    def problems(self, split, n, seed):
        return [
            Problem(f"echo/{i}", self.name, f"what is the sum of {i}+7", "", split)
            for i in range(n)
        ]

    def step(self, problem, history):
        if len(history) < 5:
            return EnvStep(OBSERVATION.format(turn=len(history)))
        return EnvStep(done=True, reward=1.0, correct=True)


class ChatEcho(Echo):
    """The same episodes, its answers chat messages that the model's template renders."""

    def step(self, problem, history):
        step = super().step(problem, history)
        return EnvStep(step.observation.strip(), step.done, step.reward, step.correct, role="user")


class TwoTurns(_Episodes):
    """Answers the first model turn with ``obs``, ends the episode at the second."""

    name = "two-turns"

    def __init__(self, obs: str = "ok!") -> None:
        self.obs = obs

    def step(self, problem, history):
        if len(history) == 1:
            # A Counter, as the calculator's: it crosses from the step process as a dict.
            return EnvStep(self.obs, tool_calls=1, tool_errors=Counter(["error"]))
        return EnvStep(done=True, reward=1.0, correct=True)


class Endless(_Episodes):
    """Never ends the episode."""

    name = "endless"

    async def step(self, problem, history):
        await asyncio.sleep(0)
        return EnvStep("more")


class Broken(_Episodes):
    """Problem 0's step fails as ``how`` says (raise, hang, nan, junk, memory, exit);
    problem 1's ends well."""

    name = "broken"

    def __init__(self, how: str) -> None:
        self.how = how

    def step(self, problem, history):
        if problem.prompt_id == "p1":
            return EnvStep(done=True, reward=0.5)
        if self.how == "raise":
            raise KeyError("no such state")
        if self.how == "hang":
            time.sleep(30)
        if self.how == "nan":
            return EnvStep(done=True, reward=float("nan"))
        if self.how == "memory":
            hog = bytearray(8 << 30)  # past the step process's address space
            return EnvStep(str(len(hog)))
        return "not an EnvStep"
