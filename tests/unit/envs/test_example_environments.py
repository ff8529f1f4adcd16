"""The environments of ``examples/environments`` (docs/bring-an-environment.md), as their
configs name them: each config parses, the gymnasium-style game scores its tries, and the
verifiers taskset's tasks become problems. Their learning curves are in docs/results.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sluice.config.tree import RunConfig, load_config
from sluice.envs import make_env

EXAMPLES = Path(__file__).parents[3] / "examples" / "environments"
CONFIGS = sorted(EXAMPLES.glob("*.yaml"))


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as the configs' PYTHONPATH does


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_example_config_parses(path: Path) -> None:
    assert isinstance(load_config(path), RunConfig)


def test_the_examples_are_there() -> None:
    assert [p.stem for p in CONFIGS] == ["gym_sum", "textarena_guess", "verifiers_sum"]


def test_sum_with_hints_halves_its_reward_for_each_try(on_path) -> None:
    cfg = load_config(EXAMPLES / "gym_sum.yaml")
    env = make_env(cfg.env.name, **cfg.env.args)
    problem = env.problems("train", 1, 0)[0]
    a, b = map(int, re.findall(r"\d+", problem.prompt)[:2])
    first = env.step(problem, ["The answer is 0"])
    assert "higher" in first.observation and not first.done
    second = env.step(problem, ["0", first.observation, str(a + b)])
    assert (second.done, second.reward, second.correct) == (True, 0.5, False)
    right = env.step(problem, [f"{a}+{b}={a + b}"])
    assert (right.done, right.reward, right.correct) == (True, 1.0, True)
    history = ["abc"]
    for _ in range(2):
        step = env.step(problem, history)
        assert "not a number" in step.observation
        history += [step.observation, "abc"]
    assert env.step(problem, history).reward == 0.0


def test_the_sum_taskset_gives_sums_as_problems(on_path) -> None:
    cfg = load_config(EXAMPLES / "verifiers_sum.yaml")
    env = make_env(cfg.env.name, **cfg.env.args)
    env.render_prompts(lambda messages: json.dumps(messages))
    train, heldout = env.problems("train", 64, 0), env.problems("heldout", 256, 0)
    assert len(train) == 64 and len(heldout) == 256
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in heldout}
    for problem in train:
        task = problem.fields["task"]
        a, b = map(int, re.findall(r"\d+", task["prompt"])[:2])
        assert task["answer"] == str(a + b)


def test_a_binary_search_wins_in_five_guesses_and_the_game_ends_after_the_fifth() -> None:
    cfg = load_config(EXAMPLES / "textarena_guess.yaml")
    env = make_env(cfg.env.name, **cfg.env.args)
    for problem in env.problems("heldout", 8, 0):
        low, high, history = 1, 20, []
        for _ in range(cfg.env.max_turns):
            history.append(f"[{(low + high) // 2}]")
            step = env.step(problem, history)
            if step.done:
                break
            history.append(step.observation)
            if "higher" in step.observation:
                low = (low + high) // 2 + 1
            else:
                high = (low + high) // 2 - 1
        assert (step.done, step.correct) == (True, True), history
    problem, history = env.problems("heldout", 1, 0)[0], []
    for guess in range(1, 21):  # upwards from 1, never repeated: the game's limit ends it
        history.append(f"[{guess}]")
        step = env.step(problem, history)
        if step.done:
            break
        history.append(step.observation)
    assert guess == 5 and not step.correct, (guess, step)
