"""A judge's and a reward model's scoring logic: the template, the verdict's parse, and
what each answer becomes (reward, failure, verdict, agreement with the exact answer). The
served actors are in tests/integration/test_reward_models.py."""

from __future__ import annotations

import re

import pytest

from sluice.config.tree import (
    ConfigError,
    JudgeConfig,
    RewardConfig,
    RewardModelConfig,
    load_config,
)
from sluice.driver.environment import check_rewards
from sluice.engines.reward_models.scorer import ModelScorer, parse_verdict, render
from sluice.engines.reward_models.served import ServedModels
from sluice.envs import make_env
from sluice.envs.base import Problem
from tests.support.reward_model import build_reward_model

PROBLEM = Problem("addition/train/0/0", "addition", "12+30=", "42", "train", {"level": 2})


def judge(**settings) -> JudgeConfig:
    return JudgeConfig(model="/judge", prompt="Q: {prompt} A: {completion} Right?", **settings)


def test_the_template_takes_the_problem_and_the_completion():
    text = render("{prompt}|{completion}|{answer}|{level}", PROBLEM, "42 {x}")
    assert text == "12+30=|42 {x}|42|2"  # braces in a completion are its own text
    with pytest.raises(ValueError, match=r"asks for \{hint\}, which the problem does not have"):
        render("{prompt}{hint}", PROBLEM, "42")


def test_a_pattern_without_a_group_is_found_or_not():
    yes = re.compile(JudgeConfig.model_fields["parse"].default)
    assert parse_verdict("Yes, 42 is right.", yes, 1.0) == 1.0
    assert parse_verdict("  yes", yes, 1.0) == 1.0
    assert parse_verdict("No, yes would be wrong.", yes, 1.0) == 0.0  # only a leading yes
    assert parse_verdict("", yes, 1.0) == 0.0


def test_a_group_captures_a_score_over_max_score():
    score = re.compile(r"SCORE:\s*([0-9.]+)")
    assert parse_verdict("fine. SCORE: 7", score, 10.0) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="does not match the verdict"):
        parse_verdict("no score given", score, 10.0)
    with pytest.raises(ValueError, match=r"captured 11, outside \[0, 10\]"):
        parse_verdict("SCORE: 11", score, 10.0)
    with pytest.raises(ValueError, match=r"captured '\.', not a number"):
        parse_verdict("SCORE: .", score, 10.0)


def scorer(cfg, verifier=None) -> ModelScorer:
    return ModelScorer(ServedModels(cfg, []), correct_at=1.0, verifier=verifier)


def test_a_judge_answer_becomes_a_reward_with_its_verdict_kept():
    addition = make_env("addition")
    pairs = [(PROBLEM, "42"), (PROBLEM, "41"), (PROBLEM, "42"), (PROBLEM, "42")]
    answers = [("Yes.", None), ("Yes!", None), ("No.", None), (None, "the judge failed: gone")]
    out = scorer(judge(), addition)._results(pairs, answers)
    assert [(r.reward, r.correct, r.verdict) for r in out[:3]] == [
        (1.0, True, "Yes."),
        (1.0, True, "Yes!"),
        (0.0, False, "No."),
    ]
    # Compared with the environment's own verdict on the same completion:
    assert [r.metrics for r in out[:3]] == [
        {"agrees_with_verifier": 1.0},
        {"agrees_with_verifier": 0.0},  # judged right, but 41 is wrong
        {"agrees_with_verifier": 0.0},
    ]
    assert out[3].error == "the judge failed: gone" and out[3].reward == 0.0
    assert out[3].verdict is None


def test_a_verdict_the_parse_cannot_read_fails_its_sample_and_is_kept():
    cfg = judge(parse=r"SCORE: (\d+)", max_score=10.0)
    (bad,) = scorer(cfg)._results([(PROBLEM, "42")], [("I cannot say.", None)])
    assert bad.error is not None and "does not match the verdict" in bad.error
    assert bad.verdict == "I cannot say."


def test_a_reward_model_score_is_the_reward_and_has_no_verdict():
    cfg = RewardModelConfig(model="/rm")
    out = scorer(cfg)._results([(PROBLEM, "42"), (PROBLEM, "4")], [(0.75, None), (0.25, None)])
    assert [(r.reward, r.correct, r.verdict, r.error) for r in out] == [
        (0.75, False, None, None),
        (0.25, False, None, None),
    ]


def test_the_reward_section_takes_one_source():
    assert RewardConfig(judge={"model": "/j", "prompt": "{completion}"}).served is not None
    with pytest.raises(ValueError, match=r"reward.functions and reward.judge are both set"):
        RewardConfig(functions=[{"fn": "a.b:c"}], judge={"model": "/j", "prompt": "x"})
    with pytest.raises(ValueError, match="needs parse"):
        RewardConfig(judge={"model": "/j", "prompt": "x", "parse": None})
    with pytest.raises(ValueError, match="has 2 groups"):
        JudgeConfig(model="/j", prompt="x", parse=r"(a)(b)")
    with pytest.raises(ValueError, match="not a regular expression"):
        JudgeConfig(model="/j", prompt="x", parse=r"(")


def test_a_run_checks_the_folder_and_the_template_before_it_starts(tmp_path):
    folder = build_reward_model(tmp_path / "rm")
    base = ["env.name=addition", f"reward.model.model={folder}"]
    check_rewards(load_config(None, base))
    with pytest.raises(ConfigError, match=r"reward.model.model .* is not a folder"):
        check_rewards(load_config(None, ["env.name=addition", f"reward.model.model={tmp_path}/x"]))
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"reward.model.model .* has no \*.safetensors"):
        check_rewards(load_config(None, base))
    build_reward_model(folder)
    with pytest.raises(ConfigError, match=r"reward.model.template: the template asks for \{hint\}"):
        check_rewards(load_config(None, [*base, "reward.model.template='{prompt}{hint}'"]))
    with pytest.raises(ConfigError, match=r"reward.judge.parse_fn: 'nowhere\.at_all:fn'"):
        check_rewards(
            load_config(
                None,
                ["env.name=addition", f"reward.judge.model={folder}",
                 "reward.judge.prompt='{completion}'", "reward.judge.parse_fn=nowhere.at_all:fn"],
            )
        )  # fmt: skip
