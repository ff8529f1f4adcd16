"""Tests for the countdown environment."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from sluice.envs import ALPHABET, Problem, score
from sluice.envs.base import split_of
from sluice.envs.countdown import (
    MAX_ABS_VALUE,
    CountdownEnv,
    ExpressionError,
    Node,
    evaluate,
    parse_prompt,
    random_tree,
    render,
)


def _problem(prompt: str) -> Problem:
    return Problem(
        prompt_id="countdown/train/0/0", env="countdown", prompt=prompt, answer="", split="train"
    )


P22 = _problem("3 5 7>22:")

CASES = [
    ("3*5+7", 1.0, "reference"),
    ("7+3*5", 1.0, "commuted"),
    ("7+5*3", 1.0, "commuted_product"),
    ("(3*5)+7", 1.0, "redundant_parens"),
    ("((((3))*5))+(7)", 1.0, "many_redundant_parens"),
    ("3 * 5 + 7", 1.0, "spaces"),
    ("  3*5+7\n", 1.0, "surrounding_whitespace"),
    ("3*5+7-0", 0.0, "zero_not_given"),
    ("5*5-3", 0.0, "reuses_five"),
    ("3*7+1", 0.0, "one_not_given"),
    ("22", 0.0, "target_literal"),
    ("3+5+7", 0.0, "wrong_value"),
    ("3*(5+7)", 0.0, "wrong_value_parens"),
    ("", 0.0, "empty"),
    ("   ", 0.0, "blank"),
    ("3*5+7=22", 0.0, "with_equals"),
    ("3*5+7 22", 0.0, "trailing_number"),
    ("3\t*5+7", 0.0, "tab"),
    ("03*5+7", 0.0, "leading_zero"),
    ("3*5+٧", 0.0, "arabic_indic_digit"),
    ("3*5+７", 0.0, "fullwidth_digit"),
    ("3*5+7_", 0.0, "underscore"),
    ("3**5", 0.0, "power"),
    ("3*5+7)", 0.0, "unbalanced_close"),
    ("(3*5+7", 0.0, "unbalanced_open"),
    ("()", 0.0, "empty_parens"),
    ("3*5++7", 0.0, "double_plus"),
    ("+3*5+7", 0.0, "unary_plus"),
    ("3*5+7+", 0.0, "dangling_operator"),
    ("3*5/1+7", 0.0, "division"),
    ("(" * 25 + "3*5+7" + ")" * 25, 0.0, "deep_parens"),
    ("(" * 10_000, 0.0, "very_deep_open_parens"),
    ("3*5+7" + "+0" * 200, 0.0, "too_long"),
    ("1" * 100_000, 0.0, "huge_literal"),
    ("__import__('os').system('true')", 0.0, "eval_lookalike"),
    ("eval('3*5+7')", 0.0, "eval_call"),
    ("3*5+7;", 0.0, "semicolon"),
]


@pytest.mark.parametrize(
    ("completion", "expected"), [(c, r) for c, r, _ in CASES], ids=[i for *_, i in CASES]
)
def test_reward(completion: str, expected: float) -> None:
    result = score(CountdownEnv(), P22, completion)
    assert result.error is None
    assert result.reward == expected
    assert result.correct is (expected == 1.0)


def test_several_correct_expressions_accepted() -> None:
    problem = _problem("2 3 4 6>24:")
    answers = ["4*6", "6*4", "2*3*4", "(6-2)*(3+3)", "6*(2+3)-6", "3*6+2+4", "2*(6+3*2)"]
    verdicts = {a: score(CountdownEnv(), problem, a).reward for a in answers}
    # (6-2)*(3+3), 6*(2+3)-6 and 2*(6+3*2) reuse 3, 6 or 2.
    assert verdicts == {
        "4*6": 1.0,
        "6*4": 1.0,
        "2*3*4": 1.0,
        "(6-2)*(3+3)": 0.0,
        "6*(2+3)-6": 0.0,
        "3*6+2+4": 1.0,
        "2*(6+3*2)": 0.0,
    }


@pytest.mark.parametrize(
    ("prompt", "completion", "expected"),
    [
        ("2 2 5>9:", "2+2+5", 1.0),
        ("2 5 7>9:", "2+2+5", 0.0),
        ("2 2 5>20:", "2*2*5", 1.0),
        ("2 5>4:", "2+2", 0.0),
    ],
    ids=["duplicates_given", "duplicate_not_given", "duplicates_product", "reuse_single"],
)
def test_numbers_are_a_multiset(prompt: str, completion: str, expected: float) -> None:
    assert score(CountdownEnv(), _problem(prompt), completion).reward == expected


def test_unary_minus_rejected_even_when_value_matches() -> None:
    problem = _problem("2 3 5>0:")
    assert score(CountdownEnv(), problem, "5-2-3").reward == 1.0
    assert score(CountdownEnv(), problem, "-5+2+3").reward == 0.0
    assert score(CountdownEnv(), problem, "2+(-5)+3").reward == 0.0


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("10-3-2", 5),
        ("10-(3-2)", 9),
        ("2+3*4", 14),
        ("(2+3)*4", 20),
        ("2*3-4*5", -14),
        ("7", 7),
        ("0", 0),
        (" 1 +  2 ", 3),
    ],
    ids=[
        "left_assoc",
        "parens",
        "precedence",
        "parens_precedence",
        "negative",
        "literal",
        "zero",
        "spaces",
    ],
)
def test_evaluate(text: str, value: int) -> None:
    assert evaluate(text.strip()).value == value


def test_evaluate_reports_numbers_used() -> None:
    assert evaluate("(3+5)*3-1").numbers == (3, 5, 3, 1)


@pytest.mark.parametrize(
    "text",
    [
        "999999*999999*999999",
        str(MAX_ABS_VALUE + 1),
        "1000000*1000000+1",
        "0-1000000*1000000-1",
    ],
    ids=["product_overflow", "literal_overflow", "sum_overflow", "negative_overflow"],
)
def test_huge_values_rejected(text: str) -> None:
    with pytest.raises(ExpressionError, match="out of range"):
        evaluate(text)


def test_depth_limit() -> None:
    assert evaluate("(" * 20 + "1" + ")" * 20).value == 1
    with pytest.raises(ExpressionError, match="deeper"):
        evaluate("(" * 21 + "1" + ")" * 21)


def _tree_value(node: Node) -> int:
    if isinstance(node, int):
        return node
    operator, left, right = node
    a, b = _tree_value(left), _tree_value(right)
    return a + b if operator == "+" else a - b if operator == "-" else a * b


def test_render_keeps_tree_value() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        numbers = [rng.randint(1, 20) for _ in range(rng.randint(1, 7))]
        tree = random_tree(rng, numbers)
        text = render(tree)
        assert evaluate(text).value == _tree_value(tree), text
        assert sorted(evaluate(text).numbers) == sorted(numbers)


CONFIGS = [
    ({}, "default"),
    ({"count": 1, "max_number": 100}, "one_number"),
    ({"count": 5, "max_number": 100}, "five_of_100"),
    ({"long_tail": 1.0}, "long_tail"),
    ({"count": 4, "max_number": 50, "long_tail": 2.0}, "heavy_long_tail"),
]


@pytest.mark.parametrize("kwargs", [k for k, _ in CONFIGS], ids=[i for _, i in CONFIGS])
@pytest.mark.parametrize("split", ["train", "heldout"], ids=["train", "heldout"])
def test_reference_answers_score_one(kwargs: dict[str, object], split: str) -> None:
    env = CountdownEnv(**kwargs)  # type: ignore[arg-type]
    n = 300 if split == "train" else 3 if kwargs.get("count") == 1 else 100  # heldout is small
    for problem in env.problems(split, n, seed=11):  # type: ignore[arg-type]
        assert problem.split == split
        numbers, target = parse_prompt(problem.prompt)
        assert numbers == sorted(numbers)
        assert target == evaluate(problem.answer).value >= 0
        assert Counter(evaluate(problem.answer).numbers) == Counter(numbers)
        result = score(env, problem, problem.answer)
        assert (result.reward, result.correct, result.error) == (1.0, True, None), problem


@pytest.mark.parametrize("kwargs", [k for k, _ in CONFIGS], ids=[i for _, i in CONFIGS])
def test_prompts_and_answers_use_only_alphabet(kwargs: dict[str, object]) -> None:
    env = CountdownEnv(**kwargs)  # type: ignore[arg-type]
    allowed = set(ALPHABET)
    for problem in env.problems("train", 500, seed=0):
        assert set(problem.prompt + problem.answer) <= allowed, problem
        assert problem.prompt.endswith(":")


def test_same_seed_same_problems() -> None:
    env = CountdownEnv()
    assert env.problems("train", 50, seed=7) == CountdownEnv().problems("train", 50, seed=7)
    assert env.problems("heldout", 20, seed=7) == env.problems("heldout", 20, seed=7)


def test_different_seed_different_problems() -> None:
    env = CountdownEnv()
    first = [p.prompt for p in env.problems("train", 50, seed=1)]
    second = [p.prompt for p in env.problems("train", 50, seed=2)]
    assert first != second


def test_prompt_ids_unique_and_stable() -> None:
    problems = CountdownEnv().problems("heldout", 30, seed=4)
    ids = [p.prompt_id for p in problems]
    assert len(set(ids)) == len(ids)
    assert ids[:2] == ["countdown/heldout/4/0", "countdown/heldout/4/1"]
    assert CountdownEnv().problems("heldout", 10, seed=4) == problems[:10]


def _canonical(problem: Problem) -> str:
    return problem.prompt.removesuffix(":")


def test_splits_are_disjoint() -> None:
    env = CountdownEnv(count=3, max_number=10)
    train = {_canonical(p) for seed in range(3) for p in env.problems("train", 2000, seed)}
    heldout = {_canonical(p) for seed in range(3) for p in env.problems("heldout", 200, seed)}
    assert train.isdisjoint(heldout)
    assert all(split_of("countdown", c) == "heldout" for c in heldout)
    assert all(split_of("countdown", c) == "train" for c in train)


def test_heldout_problems_are_unique() -> None:
    problems = CountdownEnv().problems("heldout", 150, seed=0)
    prompts = [p.prompt for p in problems]
    assert len(set(prompts)) == len(prompts)


def test_space_too_small_raises() -> None:
    # One number in 1..3 gives three distinct problems.
    with pytest.raises(ValueError, match="too small"):
        CountdownEnv(count=1, max_number=3).problems("heldout", 5, seed=0)


def test_long_tail_widens_number_counts() -> None:
    problems = CountdownEnv(count=3, long_tail=1.0).problems("train", 3000, seed=0)
    sizes = Counter(len(parse_prompt(p.prompt)[0]) for p in problems)
    assert min(sizes) == 3
    assert max(sizes) == 3 + 5
    assert sizes[3] > len(problems) / 2
    lengths = sorted(len(p.answer) for p in problems)
    assert lengths[int(0.99 * (len(lengths) - 1))] >= 2 * lengths[len(lengths) // 2]


def test_no_long_tail_fixed_count() -> None:
    problems = CountdownEnv(count=4).problems("train", 500, seed=0)
    assert {len(parse_prompt(p.prompt)[0]) for p in problems} == {4}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"count": 0},
        {"max_number": 0},
        {"max_number": MAX_ABS_VALUE + 1},
        {"long_tail": -1.0},
        {"count": True},
    ],
    ids=["zero_count", "zero_max", "max_too_big", "negative_tail", "bool_count"],
)
def test_bad_settings_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CountdownEnv(**kwargs)  # type: ignore[arg-type]


def test_unreachable_settings_raise() -> None:
    # Products of 25 numbers near 10**11 always overflow the verifier's value limit.
    env = CountdownEnv(count=25, max_number=10**11)
    with pytest.raises(ValueError, match="attempts"):
        env.problems("train", 1, seed=0)


@pytest.mark.parametrize(
    "prompt", ["3 5 7>22", "3 5 7=22:", "3 5 x>22:", "3 5 7>-2:", "3  5 7>22:"], ids=str
)
def test_foreign_prompt_is_a_verifier_error(prompt: str) -> None:
    result = score(CountdownEnv(), _problem(prompt), "3*5+7")
    assert result.reward == 0.0
    assert result.error is not None
    assert "countdown" in result.error
