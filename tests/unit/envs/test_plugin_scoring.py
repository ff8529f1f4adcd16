"""A plugin environment's ``reward`` is user code: ``scorer_factory`` runs it in the reward
pool's isolated processes (``envs/environment_reward.py``), while the built-in environments
keep their in-process verifiers. The environment lives in a module outside the package, as
a user's would; a reward that hangs, kills its process or raises fails its own sample."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.config.tree import EnvConfig, RewardConfig
from sluice.driver.environment import make_environment, scorer_factory
from sluice.envs import Problem
from sluice.envs.scoring import PoolScorer, VerifierScorer

MODULE = """
import os, signal, time
from sluice import Problem, RewardResult

class Echo:
    name = "echo"

    def __init__(self, word="hi"):
        self.word = word
        self.pid = os.getpid()

    def problems(self, split, n, seed):
        return [Problem(f"echo/{split}/{seed}/{i}", "echo", f"say {self.word}:", self.word, split)
                for i in range(n)]

    def reward(self, problem, completion):
        if completion == "hang":
            time.sleep(600)
        if completion == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if completion == "raise":
            raise KeyError("no such thing")
        if completion == "pid":  # where the reward runs
            return RewardResult(0.5, False, metrics={"pid": float(os.getpid())})
        right = completion.strip() == problem.answer
        return RewardResult(float(right), right)
"""


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "user_envs.py").write_text(textwrap.dedent(MODULE))
    sys.path.insert(0, str(tmp_path))
    try:
        yield "user_envs:Echo"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("user_envs", None)


def test_a_plugin_environments_reward_runs_isolated_and_its_failures_fail_samples(
    plugin: str,
) -> None:
    cfg = EnvConfig(name=plugin, args={"word": "yo"})
    env, _ = make_environment(cfg)
    scorer = scorer_factory(env, RewardConfig(timeout_s=1.0), cfg)()
    assert isinstance(scorer, PoolScorer)
    try:
        [problem] = env.problems("train", 1, 0)
        kinds = ["yo", "no", "pid", "hang", "die", "raise", "yo"]
        [results] = scorer.score([problem], [kinds], [[1] * len(kinds)])
    finally:
        scorer.close()
    right, wrong, pid, hang, die, raised, again = results
    assert (right.reward, right.correct, right.error) == (1.0, True, None)
    assert (wrong.reward, wrong.correct, wrong.error) == (0.0, False, None)
    # scored in another process, the environment's metrics kept
    assert pid.reward == 0.5 and pid.metrics["environment/pid"] not in (0.0, float(env.pid))
    assert hang.error and "timed out after 1 s (reward.timeout_s)" in hang.error
    assert die.error and "killed by SIGKILL" in die.error
    assert raised.error and "verifier raised KeyError" in raised.error
    assert again == right  # the pool replaced what it lost and went on


def test_built_in_environments_keep_their_in_process_verifier() -> None:
    cfg = EnvConfig(name="addition")
    env, _ = make_environment(cfg)
    scorer = scorer_factory(env, RewardConfig(), cfg)()
    assert isinstance(scorer, VerifierScorer)
    problem = Problem("p", "addition", "2+2?", "2+2=4|4", "train")
    [[result]] = scorer.score([problem], [["2+2=4|4"]], [[7]])
    assert result.correct
