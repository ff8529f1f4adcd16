"""Tests for the shared environment types, ``score`` and the registry."""

from __future__ import annotations

import logging
import random
import signal
import string
import time

import pytest

from sluice.envs import (
    ALPHABET,
    ENV_NAMES,
    AdditionEnv,
    CountdownEnv,
    Problem,
    RewardResult,
    make_env,
    score,
)
from sluice.envs.base import heavy_tail_extra, parse_nonneg_int, split_of

PROBLEM = Problem(prompt_id="fake/train/0/3", env="fake", prompt="q:", answer="a", split="train")


class FakeEnv:
    """An environment whose verifier returns a fixed value or raises."""

    name = "fake"

    def __init__(self, outcome: object) -> None:
        self.outcome = outcome

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        return [PROBLEM] * n

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome  # type: ignore[return-value]


BAD_OUTCOMES = [
    (RuntimeError("verifier exploded"), "RuntimeError", "raises"),
    (RecursionError("too deep"), "RecursionError", "recursion_error"),
    (ValueError("line one\nline two"), "ValueError", "multiline_message"),
    (RewardResult(reward=1.5, correct=True), "outside", "reward_above_one"),
    (RewardResult(reward=-0.1, correct=False), "outside", "negative_reward"),
    (RewardResult(reward=float("nan"), correct=False), "outside", "nan"),
    (RewardResult(reward=float("inf"), correct=True), "outside", "inf"),
    (RewardResult(reward=1, correct=True), "not float", "int_reward"),
    (RewardResult(reward=True, correct=True), "not float", "bool_reward"),
    (RewardResult(reward="1.0", correct=True), "not float", "str_reward"),  # type: ignore[arg-type]
    (RewardResult(reward=1.0, correct=1), "not bool", "int_correct"),  # type: ignore[arg-type]
    (RewardResult(reward=0.0, correct=False, error=3), "not str", "bad_error"),  # type: ignore[arg-type]
    (1.0, "not RewardResult", "bare_float"),
    (None, "not RewardResult", "none"),
]


@pytest.mark.parametrize(
    ("outcome", "needle"), [(o, n) for o, n, _ in BAD_OUTCOMES], ids=[i for *_, i in BAD_OUTCOMES]
)
def test_score_turns_failures_into_zero(
    outcome: object, needle: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="sluice.envs.base"):
        result = score(FakeEnv(outcome), PROBLEM, "anything")
    assert result.reward == 0.0
    assert result.correct is False
    assert result.error is not None
    assert "\n" not in result.error
    assert "fake" in result.error
    assert "fake/train/0/3" in result.error
    assert needle in result.error
    assert any(
        r.levelno == logging.WARNING and "fake/train/0/3" in r.getMessage() for r in caplog.records
    )


def test_score_passes_valid_results_through(caplog: pytest.LogCaptureFixture) -> None:
    for outcome in (RewardResult(1.0, True), RewardResult(0.0, False), RewardResult(0.5, False)):
        with caplog.at_level(logging.WARNING, logger="sluice.envs.base"):
            assert score(FakeEnv(outcome), PROBLEM, "x") == outcome
    assert not caplog.records


def test_score_bounds_error_length() -> None:
    result = score(FakeEnv(RuntimeError("x" * 10_000)), PROBLEM, "")
    assert result.error is not None
    assert len(result.error) <= 300


def test_score_does_not_catch_keyboard_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt):
        score(FakeEnv(KeyboardInterrupt()), PROBLEM, "")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("432", 432),
        ("", None),
        ("0432", None),
        ("4_32", None),
        ("٤٣٢", None),
        ("+432", None),
        (" 432", None),
        ("-1", None),
        ("1e3", None),
        ("9" * 65, None),
    ],
    ids=[
        "zero",
        "plain",
        "empty",
        "leading_zero",
        "underscore",
        "arabic_indic",
        "plus",
        "space",
        "negative",
        "exponent",
        "too_long",
    ],
)
def test_parse_nonneg_int(text: str, expected: int | None) -> None:
    assert parse_nonneg_int(text) == expected


def test_split_is_stable_and_about_ten_percent() -> None:
    assert split_of("addition", "47+385") == split_of("addition", "47+385")
    splits = [split_of("addition", f"{i}+{i + 1}") for i in range(10_000)]
    share = splits.count("heldout") / len(splits)
    assert 0.08 < share < 0.12


def test_heavy_tail_extra_bounds() -> None:
    rng = random.Random(0)
    draws = [heavy_tail_extra(rng, 1.0, 5) for _ in range(10_000)]
    assert min(draws) == 0
    assert max(draws) == 5
    assert draws.count(0) > len(draws) / 2
    assert all(heavy_tail_extra(rng, 1000.0, 3) <= 3 for _ in range(1000))


def test_heavy_tail_extra_off_consumes_no_randomness() -> None:
    rng = random.Random(0)
    state = rng.getstate()
    assert heavy_tail_extra(rng, 0.0, 5) == 0
    assert heavy_tail_extra(rng, 1.0, 0) == 0
    assert rng.getstate() == state


def test_alphabet_is_printable_ascii() -> None:
    assert len(ALPHABET) == 95
    assert set(ALPHABET) == set(string.printable) - set("\t\n\r\x0b\x0c")
    assert len(set(ALPHABET)) == len(ALPHABET)


@pytest.mark.parametrize(
    ("name", "cls"), [("addition", AdditionEnv), ("countdown", CountdownEnv)], ids=ENV_NAMES[:2]
)
def test_make_env(name: str, cls: type) -> None:
    env = make_env(name)
    assert isinstance(env, cls)
    assert env.name == name


def test_make_env_forwards_kwargs() -> None:
    env = make_env("addition", digits=4, scratch=True)
    assert isinstance(env, AdditionEnv)
    assert (env.digits, env.scratch) == (4, True)


def test_make_env_unknown_name() -> None:
    with pytest.raises(ValueError, match="'multiplication'") as info:
        make_env("multiplication")
    message = str(info.value)
    assert all(name in message for name in ENV_NAMES)


def test_env_names() -> None:
    assert ENV_NAMES == (
        "addition",
        "countdown",
        "reasoning_gym",
        "calculator",
        "guessing",
        "textarena",
        "gym",
        "skyrl_gym",
        "openenv",
        "verifiers",
    )


class HangingEnv(FakeEnv):
    """A verifier stuck in a loop, as adversarial model output can make a parser."""

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        while True:
            pass


def test_a_verifier_that_hangs_fails_its_sample_after_the_budget() -> None:
    started = time.monotonic()
    result = score(HangingEnv(None), PROBLEM, "x", timeout_s=0.2)
    assert result.reward == 0.0 and result.correct is False
    assert result.error is not None and "0.2 s time budget" in result.error
    assert "fake/train/0/3" in result.error
    assert time.monotonic() - started < 5.0  # cut at the budget, not left running
    # The timer is off again and the previous SIGALRM handler is back.
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.default_int_handler)
    assert score(FakeEnv(RewardResult(1.0, True)), PROBLEM, "x").reward == 1.0
