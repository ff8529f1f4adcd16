"""Multi-turn episodes for TRL's GRPO trainer: the peer's rollout on a multi-turn environment.

TRL 1.16's ``GRPOTrainer(rollout_func=...)`` hands the function the prompts of a batch
(each repeated ``num_generations`` times) and takes back ``prompt_ids``, ``completion_ids``
and ``logprobs`` (None: TRL computes what its loss needs itself), plus extra fields, which
it passes to the reward functions; an ``env_mask`` field (1 for a sampled token, 0 for one
the environment wrote) keeps the environment's tokens out of the loss.
``benchmarks/trl_grpo.py`` uses :class:`EpisodeRollout` when the config's environment is
multi-turn (the agentic workload, ``configs/agentic.yaml``).

:func:`play` plays episodes as a synchronous trainer's user would write it: every live
episode's next turn in one padded HF ``generate``, then every episode's environment step
at once through Sluice's isolated ``EpisodeSteps`` (the same step process and tool latency
a Sluice run waits on), until each episode ends. Its limits are a Sluice run's
(``engines/rollout/sample_runner.py``): at most ``env.max_turns`` model turns, a turn at most
``env.max_turn_tokens`` tokens, an episode at most ``rollout.max_new_tokens`` tokens, the
environment's counted. A finished episode scores the environment's reward; one cut short,
or whose step failed, scores 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from sluice.engines.rollout.episodes import EpisodeSteps, StepFailed
from sluice.envs import Problem
from sluice.envs.multi_turn import EpisodeLimits


@dataclass
class Episode:
    """One episode: the prompt's tokens, then every token after it (the model's and the
    environment's), which of those the model sampled, and how it ended."""

    problem: Problem
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    reward: float = 0.0
    correct: bool = False
    over: bool = False

    @property
    def model_turns(self) -> int:
        return (len(self.history) + 1) // 2

    @property
    def sampled(self) -> int:
        return sum(self.mask)


def _turns(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    episodes: list[Episode],
    budgets: list[int],
    temperature: float,
) -> list[list[int]]:
    """Each episode's next turn, generated in one left-padded batch: up to its budget,
    through its first EOS."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    rows = [e.prompt_ids + e.ids for e in episodes]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        attention[i, width - len(row) :] = 1
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=max(budgets),
        pad_token_id=pad,
        eos_token_id=eos,
        **sampling,
    )
    turns = []
    for i, budget in enumerate(budgets):
        turn = out[i, width:].tolist()[:budget]
        turns.append(turn[: turn.index(eos) + 1] if eos in turn else turn)
    return turns


@torch.no_grad()
def play(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    steps: EpisodeSteps,
    problems: list[Problem],
    limits: EpisodeLimits,
    max_new_tokens: int,
    temperature: float,
) -> list[Episode]:
    """An episode per problem, sampled at ``temperature`` (0: greedy), to its end."""
    was_training = model.training
    model.eval()
    episodes = [Episode(p, list(tokenizer(p.prompt)["input_ids"])) for p in problems]
    live = list(episodes)
    try:
        while live:
            rooms = [max_new_tokens - len(e.ids) for e in live]
            budgets = [min(room, limits.max_turn_tokens or room) for room in rooms]
            turns = _turns(model, tokenizer, live, budgets, temperature)
            for e, turn in zip(live, turns, strict=True):
                e.ids += turn
                e.mask += [1] * len(turn)
                e.history.append(tokenizer.decode(turn, skip_special_tokens=True))
            answers = [steps.submit(e.problem, list(e.history)) for e in live]
            going_on = []
            for e, answer in zip(live, answers, strict=True):
                step = answer.result().outcome
                if isinstance(step, StepFailed) or step.done:
                    e.over = True
                    if not isinstance(step, StepFailed):
                        e.reward, e.correct = float(step.reward), bool(step.correct)
                    continue
                if step.role is not None:
                    raise ValueError(
                        f"{e.problem.env}: a step answered with a {step.role!r} message; the "
                        "TRL rollout appends plain-text observations only"
                    )
                tokens = tokenizer(step.observation, add_special_tokens=False)["input_ids"]
                if e.model_turns >= limits.max_turns or len(e.ids) + len(tokens) >= max_new_tokens:
                    e.over = True  # out of turns or tokens: not solved
                    continue
                e.ids += tokens
                e.mask += [0] * len(tokens)
                e.history.append(step.observation)
                going_on.append(e)
            live = going_on
    finally:
        model.train(was_training)
    return episodes


class EpisodeRollout:
    """TRL's ``rollout_func``: an episode per prompt it is handed, sampled with the
    trainer's model. The episodes' rewards and sampled-token counts go to the reward
    functions as the extra fields ``episode_reward``, ``episode_correct`` and
    ``sampled_tokens``."""

    def __init__(
        self,
        steps: EpisodeSteps,
        problems: list[Problem],
        limits: EpisodeLimits,
        max_new_tokens: int,
        temperature: float,
    ) -> None:
        self.steps, self.limits = steps, limits
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.by_prompt = {p.prompt: p for p in problems}

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        problems = [self.by_prompt[p] for p in prompts]
        episodes = play(
            trainer.model,
            trainer.processing_class,
            self.steps,
            problems,
            self.limits,
            self.max_new_tokens,
            self.temperature,
        )
        return {
            "prompt_ids": [e.prompt_ids for e in episodes],
            "completion_ids": [e.ids for e in episodes],
            "logprobs": None,
            "env_mask": [e.mask for e in episodes],
            "episode_reward": [e.reward for e in episodes],
            "episode_correct": [e.correct for e in episodes],
            "sampled_tokens": [e.sampled for e in episodes],
        }

    def accuracy(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, problems: list[Problem]
    ) -> float:
        """Fraction of ``problems`` whose greedy episode, within the same limits, the
        environment calls correct."""
        episodes = play(
            model, tokenizer, self.steps, problems, self.limits, self.max_new_tokens, 0.0
        )
        return sum(e.correct for e in episodes) / len(problems)
