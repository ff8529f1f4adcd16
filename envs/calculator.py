"""Multiplication that needs the calculator: a multi-turn environment with one tool.

Problems multiply two numbers of ``digits`` digits each, too large for the tiny policy to
multiply unaided. The model calls the calculator in the Hermes format, then answers:

* prompt ``"482*37?\\n"``
* model turn 1: ``<tool_call>{"name":"calculator","arguments":{"expression":"482*37"}}</tool_call>``
* observation: ``"\\n<tool_response>\\n17834\\n</tool_response>\\n"``
* model turn 2: ``"17834"``: the final answer, a turn without a tool call.

A turn with tool calls gets their results (``envs/tools.py``; a malformed call or an unknown
tool gets an error message, never an exception); a turn without one is the answer: reward 1.0
if it is the product as a canonical decimal integer, else 0.0. ``answer`` holds the
reference episode (``multi_turn.reference_episode``), which the built-in policy's warm
start learns from. The split is decided from ``"min*max"`` of the operands. With
``latency_s > 0`` each tool call answers after a log-normal wait of that median (sigma
``latency_sigma``: 1.3 puts p99 at ~20x the median), a remote tool's heavy tail, for the
agentic benchmark.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections import Counter
from collections.abc import Awaitable

from sluice.envs.base import (
    Draft,
    Problem,
    RewardResult,
    Split,
    check_positive_int,
    draw_problems,
    parse_nonneg_int,
)
from sluice.envs.multi_turn import TURN_SEPARATOR, EnvStep, reference_episode
from sluice.envs.tool_calls import CLOSE, OPEN, parse_tool_calls, tool_response
from sluice.envs.tools import Calculator, Tool, call_tool

RESPONSE_END = "</tool_response>"


def tool_call(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return OPEN + json.dumps(call, separators=(",", ":")) + CLOSE


def observation(results: list[str]) -> str:
    """The environment's turn: each tool's answer, on lines of their own."""
    return "\n" + "\n".join(tool_response(r) for r in results) + "\n"


class CalculatorEnv:
    """``a*b`` with ``digits``-digit operands, answered with the calculator's help."""

    multi_turn = True

    def __init__(
        self,
        digits: int = 3,
        max_calls: int = 4,
        latency_s: float = 0.0,
        latency_sigma: float = 1.3,
    ) -> None:
        self.digits = check_positive_int("digits", digits)
        self.max_calls = check_positive_int("max_calls", max_calls)
        if not (latency_s >= 0 and latency_sigma >= 0):
            raise ValueError(
                f"latency_s and latency_sigma must be >= 0, got {latency_s}, {latency_sigma}"
            )
        self.latency_s, self.latency_sigma = latency_s, latency_sigma
        self.name = "calculator"
        self.tools: dict[str, Tool] = {"calculator": Calculator()}

    def _draft(self, rng: random.Random) -> Draft:
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        product = str(a * b)
        episode = reference_episode([tool_call(f"{a}*{b}"), observation([product]), product])
        return Draft(f"{min(a, b)}*{max(a, b)}", f"{a}*{b}?\n", episode)

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        return draw_problems(self.name, split, n, seed, self._draft)

    @staticmethod
    def product(problem: Problem) -> int:
        a, b = problem.prompt.rstrip("?\n").split("*")
        return int(a) * int(b)

    def step(self, problem: Problem, history: list[str]) -> EnvStep | Awaitable[EnvStep]:
        calls = parse_tool_calls(history[-1], self.max_calls)
        if calls:
            results = [call_tool(call, self.tools) for call in calls]
            errors = Counter(r.error for r in results if r.error is not None)
            texts = [r.text for r in results]
            answer = EnvStep(observation(texts), tool_calls=len(calls), tool_errors=errors)
            return self._after_latency(answer, problem, history) if self.latency_s else answer
        correct = parse_nonneg_int(history[-1].strip()) == self.product(problem)
        return EnvStep(done=True, reward=float(correct), correct=correct)

    async def _after_latency(
        self, answer: EnvStep, problem: Problem, history: list[str]
    ) -> EnvStep:
        """``answer`` after a log-normal wait (median ``latency_s``), as a remote tool's
        would come: the wait costs no CPU, and is the same for the same call."""
        await asyncio.sleep(self.latency(problem, history))
        return answer

    def latency(self, problem: Problem, history: list[str]) -> float:
        rng = random.Random(f"{problem.prompt_id}|{len(history)}|{history[-1]}")
        return self.latency_s * math.exp(self.latency_sigma * rng.gauss(0.0, 1.0))

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        """A whole episode's text (turns and observations, in any separation): its final
        answer is what follows the last tool response."""
        answer = completion.rsplit(RESPONSE_END, 1)[-1].strip(TURN_SEPARATOR + " \n")
        correct = parse_nonneg_int(answer) == self.product(problem)
        return RewardResult(float(correct), correct)
