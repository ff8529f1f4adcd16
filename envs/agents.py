"""A user's agent function, named by import path, run isolated: many episodes at once in a
process of its own (``envs/isolated.py``, ``envs/call_child.py``).

The contract (``docs/environments.md``): ``agent(base_url, prompt, **fields)`` plays one
episode against the OpenAI-compatible endpoint at ``base_url`` (an ``openai`` client made
with ``base_url=base_url`` and any api key) and returns the episode's reward, a number or a
mapping with ``reward`` and an optional ``correct`` bool and further numbers. It may be
``async``. ``AgentPool.run`` starts one run and returns a future of its ``AgentOutcome``.
A run that raises, runs past ``timeout_s``, returns something else, or whose process dies
or stops answering, fails with the reason; the pool starts a new process for later runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.envs.isolated import GRACE_S, IsolatedCalls
from sluice.envs.rewards import _check_value

_ERROR_CHARS = 300


@dataclass(frozen=True)
class AgentOutcome:
    reward: float
    correct: bool
    metrics: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None


class AgentPool(IsolatedCalls[AgentOutcome]):
    """Runs ``agent`` (an import path) with fixed ``args`` for each episode it is given."""

    def __init__(
        self,
        agent: str,
        args: Mapping[str, Any] | None = None,
        timeout_s: float = 120.0,
        memory_mib: int | None = 4096,
        correct_at: float = 1.0,
        roots: Sequence[str] = (),
        grace_s: float = GRACE_S,
    ) -> None:
        super().__init__(agent, args, timeout_s, memory_mib, roots, grace_s)
        self.correct_at = correct_at

    def outcome(self, value: Any) -> AgentOutcome:
        reward, metrics, correct = _check_value(value)
        verdict = correct if correct is not None else reward >= self.correct_at
        return AgentOutcome(reward, verdict, metrics)

    def failed(self, why: str) -> AgentOutcome:
        return AgentOutcome(0.0, False, {}, f"agent {self.function}: {why}"[:_ERROR_CHARS])
