"""A skyrl-gym environment of a user's own, named by import path in the adapter's tests,
and rows in SkyRL's data format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class SaysTheAnswer(BaseTextEnv):
    """Done with reward 1 when the turn contains the row's ground truth; else asked again
    with a tool message, at most twice."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.truth = str((extras or {})["reward_spec"]["ground_truth"])
        self.max_turns = 2

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        if self.truth in action:
            return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})
        done = self.turns >= self.max_turns
        again = [] if done else [{"role": "tool", "content": "not yet"}]
        return BaseTextEnvStepOutput(observations=again, reward=0.0, done=done, metadata={})


def skyrl_rows(path: Path, n: int) -> None:
    """SkyRL's dataset format: chat-message prompts beside the environment's extras."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {i}+2? End with '#### <answer>'."}],
            "env_class": "gsm8k_multi_turn",
            "reward_spec": {"method": "rule", "ground_truth": str(i + 2)},
            "extra_info": {"max_turns": 2},
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
