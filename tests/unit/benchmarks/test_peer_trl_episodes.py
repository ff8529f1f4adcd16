"""benchmarks/trl_episodes.py: TRL's rollout on a multi-turn environment.

The episode logic (turns, masks, limits, rewards) is checked with a scripted model that
plays each problem's reference episode, against the real calculator environment in its
isolated step process; tests/unit/benchmarks/test_peer_trl_grpo.py runs TRL's real
trainer on the agentic workload with it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from benchmarks.trl_episodes import EpisodeRollout, play
from sluice.engines.rollout.episodes import EpisodeSteps, StepSpec
from sluice.envs import make_env
from sluice.envs.multi_turn import EpisodeLimits, reference_turns
from sluice.policy.starting import EOS_ID, PAD_ID, build_tokenizer

TOKENIZER = build_tokenizer()
THREE_TURNS = EpisodeLimits(max_turns=3)


class Scripted:
    """Plays each row's reference episode: the model turn due after what the row holds
    (one per EOS after the prompt), then EOS; with ``wrong``, the answer one digit off."""

    training = True

    def __init__(self, problems: list, wrong: bool = False) -> None:
        self.turns = {
            tuple(TOKENIZER(p.prompt)["input_ids"]): reference_turns(p.answer)[::2]
            for p in problems
        }
        self.wrong = wrong

    def eval(self) -> None:
        self.training = False

    def train(self, mode: bool = True) -> None:
        self.training = mode

    def generate(self, input_ids, attention_mask, max_new_tokens, **_) -> torch.Tensor:
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            held = [t for t, m in zip(ids, mask, strict=True) if m]
            prompt = next(p for p in self.turns if tuple(held[: len(p)]) == p)
            turns = self.turns[prompt]
            due = held[len(prompt) :].count(EOS_ID)
            turn = turns[due]
            if self.wrong and due == len(turns) - 1:  # the answer, one digit off
                turn = turn[:-1] + ("1" if turn[-1] != "1" else "2")
            new = [*_tokens(turn), EOS_ID, *[PAD_ID] * max_new_tokens][:max_new_tokens]
            rows.append(ids + new)
        return torch.tensor(rows)


@pytest.fixture(scope="module")
def steps() -> Iterator[EpisodeSteps]:
    calls = EpisodeSteps(StepSpec("calculator", {"digits": 2}), timeout_s=30)
    yield calls
    calls.close()


@pytest.fixture(scope="module")
def problems() -> list:
    return make_env("calculator", digits=2).problems("train", 3, 0)


def _tokens(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def _turn(text: str) -> list[int]:
    """A model turn's tokens: the text's, then EOS."""
    return [*_tokens(text), EOS_ID]


def _play(model, steps, problems, limits=THREE_TURNS, budget=160):
    return play(model, TOKENIZER, steps, problems, limits, budget, 1.0)


def test_an_episode_holds_the_model_turns_and_the_observation_masked(steps, problems):
    for e, p in zip(_play(Scripted(problems), steps, problems), problems, strict=True):
        call, seen, answer = reference_turns(p.answer)
        first, middle, last = _turn(call), _tokens(seen), _turn(answer)
        assert e.prompt_ids == TOKENIZER(p.prompt)["input_ids"]
        assert e.ids == first + middle + last
        assert e.mask == [1] * len(first) + [0] * len(middle) + [1] * len(last)
        assert e.history == [call, seen, answer]
        assert (e.reward, e.correct, e.over, e.sampled) == (1.0, True, True, len(first + last))


def test_a_wrong_answer_scores_zero(steps, problems):
    episodes = _play(Scripted(problems, wrong=True), steps, problems)
    assert [(e.reward, e.correct, e.over, e.model_turns) for e in episodes] == [
        (0.0, False, True, 2)
    ] * 3


def test_an_episode_out_of_turns_or_tokens_ends_unsolved(steps, problems):
    model, first = Scripted(problems), problems[:1]
    call, seen, _ = reference_turns(first[0].answer)
    one_turn = _play(model, steps, first, EpisodeLimits(max_turns=1))[0]
    assert one_turn.ids == _turn(call)  # the observation is not appended
    assert (one_turn.reward, one_turn.over) == (0.0, True)
    # an episode budget the observation would fill: cut before it, as a Sluice run cuts
    short = _play(model, steps, first, budget=len(_turn(call)) + len(_tokens(seen)))[0]
    assert short.ids == _turn(call) and short.reward == 0.0
    # a turn budget shorter than the call: the turn stops there
    cut = _play(model, steps, first, EpisodeLimits(3, max_turn_tokens=5))[0]
    assert cut.ids == _tokens(call)[:5] and cut.mask == [1] * 5


def test_the_rollout_answers_trl_with_one_episode_per_prompt(steps, problems):
    rollout = EpisodeRollout(steps, problems, THREE_TURNS, 160, 1.0)

    class Trainer:
        model, processing_class = Scripted(problems), TOKENIZER

    prompts = [p.prompt for p in problems for _ in range(2)]  # TRL repeats each prompt
    out = rollout(prompts, Trainer())
    assert {"prompt_ids", "completion_ids", "logprobs", "env_mask"} <= out.keys()
    assert out["logprobs"] is None
    assert len(out["completion_ids"]) == len(out["env_mask"]) == len(prompts)
    assert [len(m) for m in out["env_mask"]] == [len(c) for c in out["completion_ids"]]
    assert out["episode_reward"] == [1.0] * 6 and out["episode_correct"] == [True] * 6
    assert out["sampled_tokens"] == [sum(m) for m in out["env_mask"]]
    assert Trainer.model.training  # handed back in training mode
    assert rollout.accuracy(Trainer.model, TOKENIZER, problems) == 1.0
