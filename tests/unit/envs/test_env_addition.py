"""Tests for the addition environment."""

from __future__ import annotations

import statistics

import pytest

from sluice.envs import ALPHABET, Problem, score
from sluice.envs.addition import AdditionEnv, parse_prompt, scratch_answer, scratch_work
from sluice.envs.base import split_of


def _problem(prompt: str, answer: str = "") -> Problem:
    return Problem(
        prompt_id="addition/train/0/0", env="addition", prompt=prompt, answer=answer, split="train"
    )


PLAIN = _problem("47+385=", "432")
SCRATCH = _problem("47+385?", "7+5=12,4+8+1=13,0+3+1=4|432")

PLAIN_CASES = [
    ("432", 1.0, "right"),
    ("  432\n", 1.0, "right_with_whitespace"),
    ("431", 0.0, "wrong"),
    ("433", 0.0, "off_by_one_up"),
    ("", 0.0, "empty"),
    ("   ", 0.0, "blank"),
    ("4_32", 0.0, "underscore"),
    ("٤٣٢", 0.0, "arabic_indic_digits"),
    ("４３２", 0.0, "fullwidth_digits"),
    (" +432", 0.0, "plus_sign"),
    ("-432", 0.0, "minus_sign"),
    ("0432", 0.0, "leading_zero"),
    ("432.0", 0.0, "decimal"),
    ("4 32", 0.0, "inner_space"),
    ("0x1b0", 0.0, "hex"),
    ("432432", 0.0, "repeated"),
    ("432 is the answer", 0.0, "trailing_text"),
    ("7+5=12,4+8+1=13,0+3+1=4|432", 0.0, "scratch_in_plain_mode"),
    ("9" * 100_000, 0.0, "very_long_digits"),
    ("4" * 5000 + "32", 0.0, "long_prefix"),
    ("__import__('os').system('true')", 0.0, "eval_lookalike"),
    ("47+385", 0.0, "expression"),
]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [(c, r) for c, r, _ in PLAIN_CASES],
    ids=[i for _, _, i in PLAIN_CASES],
)
def test_plain_reward(completion: str, expected: float) -> None:
    result = score(AdditionEnv(), PLAIN, completion)
    assert result.error is None
    assert result.reward == expected
    assert result.correct is (expected == 1.0)


SCRATCH_CASES = [
    ("7+5=12,4+8+1=13,0+3+1=4|432", 1.0, True, "right"),
    (" 7+5=12,4+8+1=13,0+3+1=4|432 \n", 1.0, True, "right_with_whitespace"),
    # half for the sum, half shared by the three columns
    ("7+5=12,4+8=12,0+3=3|432", 0.5 + 0.5 / 3, False, "right_sum_one_column"),
    ("7+5=12,4+8+1=13,0+3=3|432", 0.5 + 1.0 / 3, False, "right_sum_two_columns"),
    ("7+5=12,4+8+1=13|432", 0.5 + 1.0 / 3, False, "right_sum_missing_column"),
    ("7+5=12,4+8+1=13,0+3+1=4,0+0=0|432", 0.5 + 1.0 / 3, False, "extra_column_costs_one"),
    ("4+8+1=13,7+5=12,0+3+1=4|432", 0.5 + 0.5 / 3, False, "columns_out_of_place"),
    ("junk|432", 0.5, False, "right_sum_junk_work"),
    ("|432", 0.5, False, "right_sum_no_work"),
    ("7+5=12,4+8+1=13,0+3+1=4|431", 0.5, False, "right_work_wrong_sum"),
    ("7+5=12,4+8=12,0+3=3|431", 0.5 / 3, False, "one_column_wrong_sum"),
    ("7+5=12,4+8+1=13,0+3+1=4|0432", 0.5, False, "leading_zero_sum"),
    ("7+5=12,4+8+1=13,0+3+1=4|4_32", 0.5, False, "underscore_sum"),
    ("7+5=12,4+8+1=13,0+3+1=4|٤٣٢", 0.5, False, "arabic_indic_sum"),
    ("7+5=12,4+8+1=13,0+3+1=4", 0.0, False, "no_delimiter"),
    ("432", 0.0, False, "sum_only"),
    ("7+5=12|4+8+1=13,0+3+1=4|432", 0.0, False, "two_delimiters"),
    ("", 0.0, False, "empty"),
    ("|", 0.0, False, "delimiter_only"),
    ("7+5=12," * 20_000 + "|432", 0.5, False, "very_long_work"),
]


@pytest.mark.parametrize(
    ("completion", "expected", "correct"),
    [(c, r, k) for c, r, k, _ in SCRATCH_CASES],
    ids=[i for *_, i in SCRATCH_CASES],
)
def test_scratch_reward(completion: str, expected: float, correct: bool) -> None:
    result = score(AdditionEnv(scratch=True), SCRATCH, completion)
    assert result.error is None
    assert result.reward == pytest.approx(expected)
    assert result.correct is correct


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (47, 385, "7+5=12,4+8+1=13,0+3+1=4|432"),
        (0, 0, "0+0=0|0"),
        (9, 1, "9+1=10|10"),
        (999, 1, "9+1=10,9+0+1=10,9+0+1=10|1000"),
        (12, 34, "2+4=6,1+3=4|46"),
    ],
    ids=["docstring_example", "zeros", "final_carry", "carry_chain", "no_carry"],
)
def test_scratch_answer_format(a: int, b: int, expected: str) -> None:
    assert scratch_answer(a, b) == expected
    assert scratch_work(a, b) == expected.split("|")[0]


def test_mode_is_read_from_prompt() -> None:
    assert parse_prompt("47+385=") == (47, 385, False)
    assert parse_prompt("47+385?") == (47, 385, True)
    # A plain env still scores a scratch prompt as scratch, so rewards depend only on problems.
    assert AdditionEnv().reward(SCRATCH, SCRATCH.answer).reward == 1.0


@pytest.mark.parametrize("prompt", ["47+385", "47-385=", "47+385+1=", "+385=", "047+385="], ids=str)
def test_foreign_prompt_is_a_verifier_error(prompt: str) -> None:
    result = score(AdditionEnv(), _problem(prompt), "432")
    assert result.reward == 0.0
    assert result.error is not None
    assert "addition" in result.error


def test_problem_from_other_env_is_a_verifier_error() -> None:
    other = Problem(
        prompt_id="countdown/train/0/0", env="countdown", prompt="47+385=", answer="", split="train"
    )
    result = score(AdditionEnv(), other, "432")
    assert result.error is not None
    assert "countdown/train/0/0" in result.error


CONFIGS = [
    ({}, "default"),
    ({"digits": 1}, "one_digit"),
    ({"digits": 5}, "five_digits"),
    ({"scratch": True}, "scratch"),
    ({"digits": 2, "long_tail": 1.0}, "long_tail"),
    ({"digits": 3, "long_tail": 0.3}, "small_long_tail"),
]


@pytest.mark.parametrize("kwargs", [k for k, _ in CONFIGS], ids=[i for _, i in CONFIGS])
@pytest.mark.parametrize("split", ["train", "heldout"], ids=["train", "heldout"])
def test_reference_answers_score_one(kwargs: dict[str, object], split: str) -> None:
    env = AdditionEnv(**kwargs)  # type: ignore[arg-type]
    n = 3 if kwargs.get("digits") == 1 and split == "heldout" else 300  # tiny heldout space
    for problem in env.problems(split, n, seed=3):  # type: ignore[arg-type]
        assert problem.split == split
        assert problem.env == "addition"
        result = score(env, problem, problem.answer)
        assert (result.reward, result.correct, result.error) == (1.0, True, None), problem


@pytest.mark.parametrize("kwargs", [k for k, _ in CONFIGS], ids=[i for _, i in CONFIGS])
def test_prompts_and_answers_use_only_alphabet(kwargs: dict[str, object]) -> None:
    env = AdditionEnv(**kwargs)  # type: ignore[arg-type]
    allowed = set(ALPHABET)
    for problem in env.problems("train", 500, seed=0):
        assert set(problem.prompt + problem.answer) <= allowed, problem
        assert problem.prompt.endswith(("=", "?"))


def test_same_seed_same_problems() -> None:
    env = AdditionEnv(digits=3)
    assert env.problems("train", 50, seed=7) == env.problems("train", 50, seed=7)
    assert AdditionEnv(digits=3).problems("heldout", 20, 7) == env.problems("heldout", 20, 7)


def test_different_seed_different_problems() -> None:
    env = AdditionEnv(digits=3)
    first = [p.prompt for p in env.problems("train", 50, seed=1)]
    second = [p.prompt for p in env.problems("train", 50, seed=2)]
    assert first != second


def test_prompt_ids_unique_stable_and_prefix() -> None:
    env = AdditionEnv(digits=3)
    short = env.problems("train", 20, seed=5)
    long = env.problems("train", 40, seed=5)
    assert long[:20] == short
    ids = [p.prompt_id for p in long]
    assert len(set(ids)) == len(ids)
    assert ids[0] == "addition/train/5/0"
    assert ids[-1] == "addition/train/5/39"


def _canonical(problem: Problem) -> str:
    a, b, _ = parse_prompt(problem.prompt)
    return f"{min(a, b)}+{max(a, b)}"


@pytest.mark.parametrize(
    "kwargs", [{"digits": 2}, {"digits": 2, "long_tail": 1.0}], ids=["plain", "long_tail"]
)
def test_splits_are_disjoint(kwargs: dict[str, object]) -> None:
    env = AdditionEnv(**kwargs)  # type: ignore[arg-type]
    train = {_canonical(p) for seed in range(3) for p in env.problems("train", 2000, seed)}
    heldout_problems = [p for seed in range(3) for p in env.problems("heldout", 300, seed)]
    heldout = {_canonical(p) for p in heldout_problems}
    assert train.isdisjoint(heldout)
    assert all(split_of("addition", c) == "heldout" for c in heldout)
    assert all(split_of("addition", c) == "train" for c in train)


def test_commuted_problem_is_in_same_split() -> None:
    env = AdditionEnv(digits=2)
    for problem in env.problems("heldout", 50, seed=0):
        a, b, _ = parse_prompt(problem.prompt)
        assert split_of("addition", f"{min(a, b)}+{max(a, b)}") == "heldout"


def test_heldout_problems_are_unique() -> None:
    problems = AdditionEnv(digits=2).problems("heldout", 200, seed=0)
    canon = [_canonical(p) for p in problems]
    assert len(set(canon)) == len(canon)


def test_space_too_small_raises() -> None:
    # One-digit operands give 55 distinct problems, about 10% of them held out.
    with pytest.raises(ValueError, match="too small"):
        AdditionEnv(digits=1).problems("heldout", 60, seed=0)


def test_long_tail_widens_answer_lengths() -> None:
    env = AdditionEnv(digits=2, long_tail=1.0)
    lengths = sorted(len(p.answer) for p in env.problems("train", 3000, seed=0))
    median = statistics.median(lengths)
    p99 = lengths[int(0.99 * (len(lengths) - 1))]
    assert p99 / median >= 3, (median, p99)


def test_long_tail_operand_digits_are_bounded() -> None:
    env = AdditionEnv(digits=2, long_tail=1.0)
    widths = [
        len(str(parse_prompt(p.prompt)[i])) for p in env.problems("train", 3000, 0) for i in (0, 1)
    ]
    assert max(widths) == 2 + 8
    assert statistics.median(widths) <= 2


def test_long_tail_enables_scratch() -> None:
    assert AdditionEnv(long_tail=0.5).scratch
    assert not AdditionEnv().scratch
    problem = AdditionEnv(long_tail=0.5).problems("train", 1, seed=0)[0]
    assert problem.prompt.endswith("?")
    assert "|" in problem.answer


@pytest.mark.parametrize(
    "kwargs",
    [
        {"digits": 0},
        {"digits": -1},
        {"digits": 1.5},
        {"long_tail": -0.1},
        {"long_tail": float("nan")},
        {"long_tail": float("inf")},
    ],
    ids=["zero_digits", "negative_digits", "float_digits", "negative_tail", "nan_tail", "inf_tail"],
)
def test_bad_settings_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        AdditionEnv(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("split", "n"),
    [("test", 1), ("train", -1), ("train", 1.5)],
    ids=["bad_split", "neg_n", "float_n"],
)
def test_bad_problem_arguments_raise(split: str, n: object) -> None:
    with pytest.raises(ValueError):
        AdditionEnv().problems(split, n, seed=0)  # type: ignore[arg-type]


def test_zero_problems() -> None:
    assert AdditionEnv().problems("heldout", 0, seed=0) == []
