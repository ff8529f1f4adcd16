"""reasoning-gym tasks as environments (``envs/reasoning_gym.py``), against the library's
own entries and scorer."""

from __future__ import annotations

import pickle

import pytest
import reasoning_gym

from sluice.envs import make_env
from sluice.envs.base import split_of


def test_entries_become_split_problems_scored_by_the_tasks_own_scorer() -> None:
    env = make_env("reasoning_gym", task="leg_counting", size=120, seed=3)
    library = reasoning_gym.create_dataset("leg_counting", size=120, seed=3)
    train, heldout = env.problems("train", 500, 0), env.problems("heldout", 500, 0)
    assert len(train) + len(heldout) == 120
    assert all(split_of(env.name, p.prompt) == "heldout" for p in heldout)
    first = train[0]
    entry = library[int(first.fields["index"])]
    assert (first.prompt, first.answer) == (entry["question"], str(entry["answer"]))
    assert env.reward(first, first.answer).correct
    assert env.reward(first, f"I count <answer>{first.answer}</answer>").correct
    assert env.reward(first, "<answer>-1</answer>").reward == 0.0
    # a copy sent to a rollout worker rebuilds the same entries there
    assert pickle.loads(pickle.dumps(env)).reward(first, first.answer).correct


def test_an_unknown_task_names_the_registry() -> None:
    with pytest.raises(ValueError, match="reasoning-gym has no task 'chess'"):
        make_env("reasoning_gym", task="chess")
