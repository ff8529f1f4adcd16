"""verifiers tasksets as problems (``envs/verifiers_tasksets.py``): tasks split by their
content's hash and rendered with a chat template, carried as JSON; the config makes
verifiers' own agent play them. The episodes themselves run against vLLM in
``tests/integration/test_verifiers_episodes.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.config.tree import VERIFIERS_AGENT, load_config
from sluice.envs import make_env

TASKSETS = str(Path(__file__).parents[2] / "support" / "verifiers_tasksets")


@pytest.fixture
def tasksets(monkeypatch):
    monkeypatch.syspath_prepend(TASKSETS)  # verifiers imports a taskset by its id


def test_tasks_become_problems_split_by_content(tasksets) -> None:
    env = make_env("verifiers", taskset="vftest_qa")
    with pytest.raises(ValueError, match="chat template"):
        env.problems("train", 1, 0)
    env.render_prompts(lambda messages: json.dumps(messages))
    train, heldout = env.problems("train", 100, 0), env.problems("heldout", 100, 0)
    assert len(train) + len(heldout) == 30 and heldout
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in heldout}
    assert {p.prompt_id for p in env.problems("train", 100, 1)} == {p.prompt_id for p in train}
    problem = train[0]
    assert json.loads(problem.prompt) == [
        {"role": "user", "content": problem.fields["task"]["prompt"]}
    ]
    assert json.dumps(problem.fields["task"])  # JSON, as it travels to the agent's process


def test_the_config_makes_verifiers_play_its_episodes() -> None:
    cfg = load_config(None, ["env.name=verifiers", "env.args.taskset=vftest_qa", "mode=sync"])
    assert cfg.env.agent == VERIFIERS_AGENT and cfg.env.agent_args == {"taskset": "vftest_qa"}
    with pytest.raises(ValueError, match=r"leave env\.agent unset"):
        load_config(None, ["env.name=verifiers", "env.agent=my_agents:other", "mode=sync"])


def test_an_unknown_taskset_names_itself(tasksets) -> None:
    with pytest.raises(ValueError, match="no_such_taskset"):
        make_env("verifiers", taskset="no_such_taskset")
