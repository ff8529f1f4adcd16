"""A user's agent function, named by import path, run isolated: many episodes at once in a
process of its own (``envs/isolated.py``).

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
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sluice.envs.isolated import GRACE_S, Answer, IsolatedPool, outcomes
from sluice.envs.rewards import _check_value

_ERROR_CHARS = 300


@dataclass(frozen=True)
class AgentOutcome:
    reward: float
    correct: bool
    metrics: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None


class AgentPool:
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
        self.agent, self.correct_at = agent, correct_at
        self.pool = IsolatedPool(
            [(agent, args or {})], 1, timeout_s, memory_mib, roots, grace_s=grace_s
        )

    def run(self, args: Mapping[str, Any]) -> Future[AgentOutcome]:
        """Start one episode's run; its outcome comes on the future."""
        return outcomes(self.pool.run(0, args), self._outcome)

    def _outcome(self, answer: Answer) -> AgentOutcome:
        why = answer.error
        if why is None:
            try:
                reward, metrics, correct = _check_value(answer.value)
            except ValueError as bad:
                why = str(bad)
            else:
                verdict = correct if correct is not None else reward >= self.correct_at
                return AgentOutcome(reward, verdict, metrics)
        return AgentOutcome(0.0, False, {}, f"agent {self.agent}: {why}"[:_ERROR_CHARS])

    def close(self) -> None:
        self.pool.close()
