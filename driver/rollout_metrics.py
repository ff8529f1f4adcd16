"""What the rollouts of a step log: the ``rollout/*`` metrics of a batch, the multi-turn
episodes' counters, and the first few failed rewards' reasons on the console. Used by
``driver/batch.py`` and ``driver/stream.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger("sluice")


@dataclass(frozen=True)
class RolloutResult:
    samples: int
    mean_reward: float
    accuracy: float
    tokens: int
    mean_length: float
    truncated: float
    reward_errors: int
    behaviour_version: int
    reward_metrics: dict[str, float]  # summed over the samples that scored
    reward_messages: tuple[str, ...]
    episode_counts: dict[str, float] = field(default_factory=dict)  # multi-turn, summed


# Failed rewards whose reasons the console shows; the rest are counted
# (rollout/reward_errors) and their reasons recorded in the ledger.
SHOW_REWARD_FAILURES = 5


class RewardFailures:
    """Shows the first few failed rewards' reasons on the console, once each run."""

    def __init__(self) -> None:
        self.shown = 0

    def show(self, messages: Sequence[str]) -> None:
        for message in messages:
            if self.shown >= SHOW_REWARD_FAILURES:
                return
            self.shown += 1
            log.warning("a sample's reward failed (recorded in the ledger): %s", message)
            if self.shown == SHOW_REWARD_FAILURES:
                log.warning(
                    "further reward failures are counted in rollout/reward_errors and their "
                    "reasons recorded in the ledger (sluice ledger RUN)"
                )


def reward_function_metrics(sums: dict[str, float], scored: int) -> dict[str, float]:
    """Each user reward function's mean reward and metrics over the samples that scored."""
    return {f"rollout/reward/{name}": total / scored for name, total in sums.items() if scored}


def rollout_metrics(result: RolloutResult) -> dict[str, float]:
    return {
        "rollout/reward": result.mean_reward,
        "rollout/accuracy": result.accuracy,
        "rollout/response_length": result.mean_length,
        "rollout/truncated": result.truncated,
        "rollout/reward_errors": float(result.reward_errors),
        **reward_function_metrics(result.reward_metrics, result.samples - result.reward_errors),
        **episode_metrics(result.episode_counts, result.samples),
    }


# What a worker counts of multi-turn episodes (``engines/rollout/sample_runner.py``).
EPISODE_COUNTERS = ("env_steps", "env_s", "env_tokens", "tool_calls", "episodes_cut")


def episode_metrics(counts: dict[str, float], episodes: int) -> dict[str, float]:
    """``rollout/episode/*`` from the summed counters of a multi-turn run (none otherwise):
    turns per episode, environment seconds per turn, the environment's (masked) tokens and
    tool calls per episode, tool errors by kind, episodes cut at a limit."""
    if not counts.get("env_steps") or not episodes:
        return {}
    steps = counts["env_steps"]
    out = {
        "rollout/episode/turns": steps / episodes,
        "rollout/episode/env_s_per_turn": counts.get("env_s", 0.0) / steps,
        "rollout/episode/env_tokens": counts.get("env_tokens", 0.0) / episodes,
        "rollout/episode/tool_calls": counts.get("tool_calls", 0.0) / episodes,
        "rollout/episode/cut": counts.get("episodes_cut", 0.0),
    }
    for name, value in counts.items():
        if name.startswith("tool_errors/"):
            out[f"rollout/episode/{name}"] = value
    return out
