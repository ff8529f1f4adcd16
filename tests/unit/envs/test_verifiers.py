"""The built-in reward functions (``envs/verifiers.py``), each against worked cases."""

from __future__ import annotations

import pytest

from sluice.envs import make_env
from sluice.envs.verifiers import (
    addition,
    exact_match,
    final_number,
    format_reward,
    math_answer,
    normalized_match,
    overlong_penalty,
)


@pytest.mark.parametrize(
    ("completion", "answer", "exact", "normalized"),
    [
        (" 42\n", "42", 1.0, 1.0),
        ("The Eiffel tower.", "eiffel Tower", 0.0, 1.0),
        ("an apple", "pear", 0.0, 0.0),
    ],
)
def test_exact_and_normalised_match(
    completion: str, answer: str, exact: float, normalized: float
) -> None:
    assert exact_match(completion, answer) == exact
    assert normalized_match(completion, answer) == normalized


@pytest.mark.parametrize(
    ("completion", "answer", "right"),
    [
        (r"so the answer is \boxed{\frac{1}{2}}", "0.5", True),
        (r"$\frac{2}{4}$", r"\frac{1}{2}", True),
        (r"\boxed{3}", "4", False),
        ("no answer at all", "4", False),
    ],
    ids=["boxed-fraction-vs-decimal", "equivalent-fractions", "wrong", "nothing-parsed"],
)
def test_math_answer_accepts_equivalent_forms(completion: str, answer: str, right: bool) -> None:
    out = math_answer(completion, answer)
    assert (out["reward"], out["correct"]) == (float(right), right)


@pytest.mark.parametrize(
    ("completion", "right"),
    [
        ("23 + 45 = 68", True),
        ("68", True),
        ("The sum is 68.", True),
        ("It is 70, not 68", True),  # the last number decides
        ("23 + 45", False),  # restating the question, which math_answer would accept
        ("23 + 45 = 78", False),
        ("sixty-eight", False),
    ],
)
def test_final_number_reads_the_last_number(completion: str, right: bool) -> None:
    assert final_number(completion, "68")["correct"] is right
    assert math_answer("23 + 45", "68")["correct"]  # why arithmetic needs final_number
    assert final_number("1,234", "1234")["correct"] and final_number("-7", "-7")["correct"]


def test_format_reward_and_the_overlong_penalty() -> None:
    assert format_reward(r"x \boxed{2}", r"\\boxed\{") == 1.0
    assert format_reward("2", r"\\boxed\{") == 0.0
    # max 100, buffer 20: free up to 80 tokens, -1 at 100 and beyond, linear between
    assert [overlong_penalty(n, 100, 20) for n in (80, 90, 100, 130)] == [0.0, -0.5, -1.0, -1.0]


def test_the_addition_reward_function_agrees_with_the_environment() -> None:
    env = make_env("addition", digits=3, scratch=True)
    for problem in env.problems("heldout", 20, seed=3):
        for completion in (problem.answer, problem.answer[:-1], "nonsense"):
            want = env.reward(problem, completion)
            got = addition(problem.prompt, completion)
            assert (got["reward"], got["correct"]) == (want.reward, want.correct)
