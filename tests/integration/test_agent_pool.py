"""The agent pool on real processes: many runs wait at once, and an agent that raises,
hangs, blocks its process, returns junk or kills its process fails only its own runs."""

from __future__ import annotations

import time

import pytest

from sluice.envs.agents import AgentPool

pytestmark = pytest.mark.integration

ROOT = "tests.support.agents"


def pool(name: str, timeout_s: float = 10.0) -> AgentPool:
    return AgentPool(f"{ROOT}:{name}", timeout_s=timeout_s, memory_mib=None, grace_s=1.0)


def test_many_runs_wait_at_once_in_one_process():
    agents = pool("waits")
    try:
        started = time.monotonic()
        runs = [agents.run({"base_url": f"http://x/s/{i}", "prompt": str(i)}) for i in range(50)]
        outcomes = [r.result(timeout=30) for r in runs]
        assert time.monotonic() - started < 10  # 50 half-second waits, together
    finally:
        agents.close()
    assert [o.reward for o in outcomes] == [1.0] * 50
    assert all(o.error is None and o.correct for o in outcomes)


def test_a_mapping_gives_reward_correct_and_metrics_and_unused_arguments_are_left_out():
    agents = pool("plain")
    try:
        outcome = agents.run({"base_url": "u", "prompt": "p", "answer": "a"}).result(timeout=30)
    finally:
        agents.close()
    assert (outcome.reward, outcome.correct, dict(outcome.metrics)) == (0.25, True, {"calls": 3.0})


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("raises", "raised KeyError"),
        ("hangs", "timed out after 1 s"),
        ("blocks_the_loop_sync", "timed out after 1 s"),
        ("blocks_the_loop", "its process stopped answering: killed"),
        ("junk", "not a number"),
        ("dies", "process ended (exit code 3)"),
    ],
)
def test_a_failing_agent_fails_its_run_with_the_reason_and_the_pool_goes_on(name, reason):
    agents = pool(name, timeout_s=1.0)
    try:
        outcome = agents.run({"base_url": "u"}).result(timeout=30)
        assert outcome.error is not None and reason in outcome.error, outcome.error
        again = agents.run({"base_url": "u"}).result(timeout=30)  # a new process if needed
        assert again.error is not None
    finally:
        agents.close()


def test_an_agent_that_does_not_import_is_one_clear_failure():
    agents = AgentPool("tests.support.agents:missing", memory_mib=None)
    try:
        outcome = agents.run({"base_url": "u"}).result(timeout=60)
    finally:
        agents.close()
    assert outcome.error is not None and "does not load" in outcome.error


def test_the_agent_process_ends_when_its_input_closes_even_with_runs_hanging():
    """What happens when the worker holding the pool dies: nobody writes to the process,
    and it must not live on for the agents it still runs."""
    agents = pool("blocks_the_loop_sync", timeout_s=3600.0)
    try:
        run = agents.run({"base_url": "u"})
        [child] = agents.pool.processes()
        assert child.stdin is not None
        child.stdin.close()
        assert child.wait(timeout=30) == 0
        outcome = run.result(timeout=30)
    finally:
        agents.close()
    assert outcome.error is not None and "process ended" in outcome.error
