"""The built-in multi-turn environments: their reference episodes play through their own
``step``, tool calls get results or error observations, and answers are graded."""

import asyncio
import inspect
import statistics

import pytest

from sluice.envs.base import split_of
from sluice.envs.calculator import CalculatorEnv, tool_call
from sluice.envs.guessing import GuessingEnv
from sluice.envs.multi_turn import check_step, is_multi_turn, reference_turns
from sluice.envs.registry import make_env


@pytest.mark.parametrize("name", ["calculator", "guessing"])
def test_each_reference_episode_plays_through_step_to_a_correct_end(name):
    env = make_env(name)
    assert is_multi_turn(env)
    for problem in env.problems("train", 20, seed=3):
        turns = reference_turns(problem.answer)
        history = []
        for i in range(0, len(turns), 2):
            history.append(turns[i])
            step = check_step(env.step(problem, list(history)))
            if i + 1 < len(turns):
                assert not step.done and step.observation == turns[i + 1]
                history.append(step.observation)
        assert step.done and step.correct and step.reward > 0


def test_calculator_problems_need_the_tool_and_split_by_their_operands():
    env = CalculatorEnv(digits=3)
    problems = env.problems("heldout", 50, seed=1)
    for p in problems:
        a, b = p.prompt.rstrip("?\n").split("*")
        assert len(a) == len(b) == 3
        assert split_of("calculator", f"{min(int(a), int(b))}*{max(int(a), int(b))}") == "heldout"
    assert len({p.prompt for p in problems}) == 50


def test_calculator_tool_errors_are_observations_and_a_plain_turn_is_the_answer():
    env = CalculatorEnv()
    [problem] = env.problems("train", 1, seed=0)
    product = env.product(problem)
    bad = env.step(problem, ['<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'])
    assert not bad.done and "error" in bad.observation and bad.tool_errors == {"bad_arguments": 1}
    unknown = env.step(problem, ['<tool_call>{"name": "shell"}</tool_call>'])
    assert "no tool named 'shell'" in unknown.observation
    broken = env.step(problem, ["<tool_call>{oops"])
    assert broken.tool_errors == {"bad_call": 1} and "never closed" in broken.observation
    good = env.step(problem, [tool_call("6*7")])
    assert "<tool_response>\n42\n</tool_response>" in good.observation and good.tool_calls == 1
    assert env.step(problem, [str(product)]).correct
    wrong = env.step(problem, [str(product + 1)])
    assert wrong.done and not wrong.correct and wrong.reward == 0.0


def test_guessing_gives_feedback_and_fewer_guesses_earn_more():
    env = GuessingEnv(high=32)
    [problem] = env.problems("train", 1, seed=0)
    secret = env.secret(problem)
    assert env.step(problem, ["0"]).observation == " higher\n"
    assert env.step(problem, ["33"]).observation == " lower\n"
    assert env.step(problem, ["soon"]).observation == " not a number\n"
    first = env.step(problem, [str(secret)])
    later = env.step(problem, ["0", " higher\n", "0", " higher\n", str(secret)])
    assert first.correct and later.correct and first.reward > later.reward


def test_calculator_latency_is_a_heavy_tailed_wait_that_changes_nothing_else():
    plain, slow = CalculatorEnv(), CalculatorEnv(latency_s=0.2, latency_sigma=1.3)
    [problem] = plain.problems("train", 1, seed=0)
    call = [tool_call("6*7")]
    pending = slow.step(problem, call)
    assert inspect.isawaitable(pending)
    pending.close()  # not awaited here: it would sleep
    assert not inspect.isawaitable(slow.step(problem, ["42"]))  # an answer waits for nothing
    waits = sorted(slow.latency(problem, [tool_call(f"{k}*7")]) for k in range(2000))
    assert 0.17 < statistics.median(waits) < 0.23
    assert 3.0 < waits[int(0.99 * len(waits))] < 6.0  # p99 ~ 0.2 * exp(2.33 * 1.3) = 4.1 s
    assert slow.latency(problem, call) == slow.latency(problem, call)
    quick = CalculatorEnv(latency_s=1e-4)
    assert asyncio.run(quick.step(problem, call)) == plain.step(problem, call)
    with pytest.raises(ValueError, match="latency_s"):
        CalculatorEnv(latency_s=-1.0)
