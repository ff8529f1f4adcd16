"""The worked example of docs/tutorial.md, as a user runs it: ``examples/my_project`` holds
a JSONL data set, a reward module and an environment class outside the package, and
``sluice run`` trains on each in ``async`` mode (at the smoke config's size, so it takes
about a minute each); ``chat.yaml`` runs a model folder with a BPE tokenizer and a chat
template, built here as a user's would be."""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sluice.storage.ledger import Ledger, check_exactly_once
from tests.support.cli import ROOT, SMALL_RUN, child_env, sluice
from tests.support.skyrl_games import skyrl_rows

pytestmark = pytest.mark.integration

EXAMPLE = ROOT / "examples" / "my_project"
# configs/smoke.yaml's sizes: a tiny policy and a few short steps.
SMALL = [
    "policy.layers=2",
    "policy.hidden=64",
    "policy.heads=2",
    "policy.intermediate=128",
    "policy.warmstart_target=0.05",
    "policy.warmstart_max_steps=40",
    "policy.warmstart_eval_every=20",
    *SMALL_RUN,
]


def _run(
    config: str, tmp_path: Path, cache: Path, *more: str, small: bool = True
) -> tuple[str, Path]:
    args = ["run", str(EXAMPLE / config)]
    sizes = SMALL if small else []
    for setting in (f"root={tmp_path / 'runs'}", f"cache={cache}", *sizes, *more):
        args += ["--set", setting]
    result = sluice(*args, env={**os.environ, "PYTHONPATH": str(EXAMPLE)})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return out, tmp_path / "runs"


def _trained(table: pa.Table) -> set[str]:
    """The prompt ids the ledger records as trained."""
    events = zip(table["prompt_id"].to_pylist(), table["event"].to_pylist(), strict=True)
    return {p for p, e in events if e == "trained"}


def test_the_dataset_example_trains_on_its_jsonl_with_the_users_reward(
    tmp_path: Path, shared_cache: Path
) -> None:
    out, runs = _run("addition.yaml", tmp_path, shared_cache)
    assert "step    4/4" in out
    table = Ledger((runs / "my-addition").as_uri()).read()
    assert check_exactly_once(table) == []
    trained = _trained(table)
    assert trained and all(p.startswith("dataset/train/") for p in trained)
    with sqlite3.connect(runs / "mlflow.db") as db:
        keys = {k for (k,) in db.execute("SELECT DISTINCT key FROM metrics")}
    # each function of the weighted sum is logged as its own metric, with its extras
    assert {"rollout/reward/final_sum", "rollout/reward/shows_work"} <= keys
    assert "rollout/reward/final_sum/answered" in keys


def test_the_environment_example_trains_the_users_class_and_evaluates_pass_at_k(
    tmp_path: Path, shared_cache: Path
) -> None:
    out, runs = _run("reverse.yaml", tmp_path, shared_cache, "eval.k=4")
    assert "step    4/4" in out
    table = Ledger((runs / "my-reverse").as_uri()).read()
    assert check_exactly_once(table) == []
    assert all(p.startswith("reverse/") for p in table["prompt_id"].to_pylist())
    with sqlite3.connect(runs / "mlflow.db") as db:
        rows = db.execute(
            "SELECT key, step, value FROM metrics WHERE key LIKE 'eval/%' ORDER BY step"
        ).fetchall()
    at = {(key, step): value for key, step, value in rows}
    for step in (0, 2, 4):  # the start, every eval.every steps, the end
        mean, passed = at[("eval/mean_at_4", step)], at[("eval/pass_at_4", step)]
        assert 0.0 <= mean <= passed <= 1.0  # a prompt with a right sample counts for pass

    result = sluice(
        "eval",
        str(EXAMPLE / "reverse.yaml"),
        "--policy",
        str(runs / "my-reverse" / "policy"),
        *("--set", f"root={tmp_path / 'eval'}", "--set", f"cache={shared_cache}"),
        *("--set", "eval.k=4", "--set", "eval.prompts=16", "--set", "rollout.kv_cache_gib=0.25"),
        env={**os.environ, "PYTHONPATH": str(EXAMPLE)},
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    printed = r"held-out accuracy [\d.]+%, mean@4 [\d.]+%, pass@4 [\d.]+% on 16 prompts"
    assert re.search(printed, result.stdout), result.stdout


# The chat example (chat.yaml) runs in tests/integration/test_user_reward.py, beside a
# failing reward of the user's.


# Slow tier (make test-slow): the dataset and environment examples cover a task of yours.
@pytest.mark.slow
def test_a_reasoning_gym_task_trains_for_a_few_steps(
    tmp_path: Path, shared_cache: Path, bpe_policy: Path
) -> None:
    """Any reasoning-gym task by name: its entries are the prompts, its scorer the reward."""
    trained = _smoke_async(
        tmp_path,
        shared_cache,
        bpe_policy,
        "env.name=reasoning_gym",
        "env.args={task: basic_arithmetic, size: 400, seed: 1}",
        "rollout.max_new_tokens=16",
    )
    assert trained and all(p.startswith("reasoning_gym/basic_arithmetic/train/") for p in trained)


def _smoke_async(
    tmp_path: Path, cache: Path, policy: Path, *settings: str, env: dict[str, str] | None = None
) -> set[str]:
    """``configs/smoke.yaml`` (4 steps) in async on ``policy`` with ``settings``: the
    prompt ids trained, once the run ended well with every sample accounted for."""
    args = ["run", "configs/smoke.yaml"]
    for setting in (
        f"root={tmp_path / 'runs'}",
        f"cache={cache}",
        "mode=async",
        f"policy.path={policy}",
        *settings,
    ):
        args += ["--set", setting]
    result = sluice(*args, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "step    4/4" in out
    table = Ledger((tmp_path / "runs" / "smoke").as_uri()).read()
    assert check_exactly_once(table) == []
    return _trained(table)


LIBRARIES = {
    "gym": ["env.name=gym", "env.args={make: tests.support.games:Countdown}", "env.max_turns=5"],
    "textarena": ["env.name=textarena", "env.args={game: GuessTheNumber-v0}", "env.max_turns=4"],
    "openenv": [
        "env.name=openenv",
        "env.args={environment: tests.support.openenv_games:WordLength}",
        "env.max_turns=3",
    ],
    "skyrl_gym": ["env.name=skyrl_gym"],  # with rows in SkyRL's format, written below
    "verifiers": ["env.name=verifiers", "env.args={taskset: vftest_qa}"],
}


@pytest.mark.slow
@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_an_environment_of_each_library_trains_in_async(
    library: str, tmp_path: Path, shared_cache: Path, bpe_policy: Path
) -> None:
    """An environment written for gymnasium, TextArena, OpenEnv, skyrl-gym or verifiers,
    named in the config: the run sends it to its rollout workers (Ray's serializer), plays
    its episodes and trains on them in async, every sample accounted for."""
    settings = LIBRARIES[library]
    if library == "skyrl_gym":
        skyrl_rows(tmp_path / "skyrl.jsonl", 200)
        settings = [*settings, f"env.data.path={tmp_path / 'skyrl.jsonl'}"]
    tasksets = ROOT / "tests" / "support" / "verifiers_tasksets"
    paths = os.pathsep.join((str(ROOT), str(tasksets)))
    trained = _smoke_async(
        tmp_path,
        shared_cache,
        bpe_policy,
        "rollout.max_new_tokens=24",
        *settings,
        env=child_env(PYTHONPATH=paths),
    )
    assert trained


def test_the_agent_example_plays_episodes_through_the_endpoint(
    tmp_path: Path, shared_cache: Path, bpe_policy: Path
) -> None:
    """``agent.yaml``: the user's ``openai``-client agent plays every episode against its
    rollout worker's chat endpoint, in async; the trainer trains on the sessions' tokens
    (the template's tokens between the agent's calls masked out), every sample accounted
    for, and held-out evaluation plays episodes too. The untrained model's replies are
    rarely digits only, so most episodes take the agent's second call."""
    out, runs = _run(
        "agent.yaml", tmp_path, shared_cache, f"policy.path={bpe_policy}", *SMALL_RUN, small=False
    )
    assert "step    4/4" in out and "held-out" in out
    table = Ledger((runs / "my-agent").as_uri()).read()
    assert check_exactly_once(table) == []
    assert _trained(table)
    rows = pq.read_table(runs / "my-agent" / "trajectories", columns=["loss_mask", "reason"])
    masks = [m for m in rows.column("loss_mask").to_pylist() if m is not None]
    calls = [re.sub("0+", "0", re.sub("1+", "1", "".join(map(str, m)))) for m in masks]
    assert set(calls) <= {"1", "101"} and "101" in calls  # one call, or two with text between
    assert rows.column("reason").null_count == rows.num_rows  # no agent failed
