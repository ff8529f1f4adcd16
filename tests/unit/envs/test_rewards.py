"""User reward functions by import path, run in ``RewardPool``'s processes (``envs/rewards.py``
over ``envs/isolated.py``).

The functions live in a module written to a folder outside the package, as a user's would;
the pool's processes are real subprocesses with real limits. Each way a reward can fail
(raise, hang, kill its process, exhaust memory, return NaN, an infinity or a non-number)
fails its own sample with the reason, and the pool goes on scoring the next ones.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.envs import isolated
from sluice.envs.rewards import (
    RewardCall,
    RewardFunction,
    RewardPool,
    check_signature,
    import_function,
    module_root,
)

USER_MODULE = """
import asyncio, os, signal, threading, time
from sluice.envs.rewards import batched

_three = threading.Barrier(3, timeout=60)

def together(completion):  # returns only once three calls are in it at the same moment
    _three.wait()
    return 1.0

async def blocks_the_loop(completion):
    if completion == "block":
        time.sleep(600)
    return 1.0

def exact(completion, answer):
    return float(completion.strip() == answer)

def with_metrics(prompt, completion, **fields):
    return {"reward": 0.5, "length": len(completion), "correct": completion == fields["answer"]}

async def slow_async(completion):
    await asyncio.sleep(0.01)
    return 2

@batched
def group(prompts, completions, answer):
    return [float(c == a) for c, a in zip(completions, answer)]

def chatty(completion):
    print("a line the user printed")
    return 1.0

def by_mode(completion):
    if completion == "raise":
        raise KeyError("no such thing")
    if completion == "hang":
        time.sleep(600)
    if completion == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if completion == "nan":
        return float("nan")
    if completion == "inf":
        return float("inf")
    if completion == "text":
        return "1.0"
    if completion == "none":
        return None
    if completion == "memory":
        return len(bytearray(8 << 30))
    if completion == "slow":
        time.sleep(0.6)
    return 1.0

@batched
def short_batch(completions):
    return [1.0]

def needs_gold(completion, gold):
    return 1.0

not_callable = 3
"""


@pytest.fixture
def user_rewards(tmp_path: Path) -> Iterator[str]:
    """A module ``user_rewards`` in a folder of its own, on ``sys.path`` as a user's would be."""
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    sys.path.insert(0, str(tmp_path))
    try:
        yield str(tmp_path)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("user_rewards", None)


def _pool(root: str, *names: str, **kwargs: object) -> RewardPool:
    functions = [RewardFunction(f"user_rewards:{n}") for n in names]
    return RewardPool(functions, roots=[root], **kwargs)  # type: ignore[arg-type]


def _calls(*completions: str) -> list[RewardCall]:
    return [RewardCall("2+2=", c, {"answer": "4"}) for c in completions]


def test_plain_async_batched_and_mapping_rewards_score_in_the_pool(user_rewards: str) -> None:
    with _pool(user_rewards, "exact", "with_metrics", "slow_async", "group") as pool:
        out = pool.score(_calls("4", "5"))
    assert [o.error for o in out] == [None, None]
    # exact 1 + with_metrics 0.5 + slow_async 2 + group 1, then 0 + 0.5 + 2 + 0
    assert [o.reward for o in out] == [4.5, 2.5]
    assert out[0].metrics == {
        "exact": 1.0,
        "with_metrics": 0.5,
        "with_metrics/length": 1.0,
        "slow_async": 2.0,
        "group": 1.0,
    }
    assert [o.correct for o in out] == [True, False]  # with_metrics says, by its 'correct'


def test_weights_scale_each_function_and_correct_follows_the_threshold(
    user_rewards: str,
) -> None:
    functions = [
        RewardFunction("user_rewards:exact", 2.0),
        RewardFunction("user_rewards:chatty", -0.5),
    ]
    with RewardPool(functions, roots=[user_rewards], correct_at=1.5) as pool:
        out = pool.score(_calls("4", "x"))
    assert [(o.reward, o.correct) for o in out] == [(1.5, True), (-0.5, False)]
    assert out[0].error is None  # what chatty printed did not corrupt the answers


@pytest.mark.parametrize(
    ("completion", "reason"),
    [
        ("raise", "raised KeyError: 'no such thing'"),
        ("hang", "timed out after 1 s (reward.timeout_s)"),
        ("die", "its process ended (killed by SIGKILL)"),
        ("nan", "returned nan, not a finite number"),
        ("inf", "returned inf, not a finite number"),
        ("text", "returned a str, not a number or a mapping"),
        ("none", "returned None, not a number"),
        ("memory", "memory limit"),
    ],
    ids=["raises", "hangs", "kills-its-process", "nan", "inf", "string", "none", "memory"],
)
def test_a_failing_reward_fails_its_sample_and_the_pool_goes_on(
    user_rewards: str, completion: str, reason: str
) -> None:
    with _pool(user_rewards, "by_mode", timeout_s=1.0, memory_mib=1024) as pool:
        bad, good = pool.score(_calls(completion, "fine"))
        assert bad.error is not None and reason in bad.error, bad.error
        assert bad.error.startswith("reward user_rewards:by_mode: ")
        assert (bad.reward, bad.correct) == (0.0, False)
        assert good == pool.score(_calls("fine"))[0]
        assert (good.reward, good.error) == (1.0, None)


def test_a_batched_reward_returning_the_wrong_count_fails_the_group(user_rewards: str) -> None:
    with _pool(user_rewards, "short_batch") as pool:
        out = pool.score(_calls("a", "b"))
    assert all(o.error and "returned 1 results for 2 calls" in o.error for o in out)


def test_two_processes_share_the_calls(user_rewards: str) -> None:
    with _pool(user_rewards, "by_mode", workers=2, timeout_s=1.0) as pool:
        out = pool.score(_calls("hang", "fine", "fine", "fine"))
        assert len(pool.pool.processes()) == 2
    assert out[0].error is not None and "timed out" in out[0].error
    assert [o.reward for o in out[1:]] == [1.0, 1.0, 1.0]


def test_the_calls_of_a_group_run_at_once(user_rewards: str) -> None:
    """Three calls that each wait for the other two: they finish only if they run together."""
    with _pool(user_rewards, "together") as pool:
        out = pool.score(_calls("a", "b", "c"))
    assert [(o.reward, o.error) for o in out] == [(1.0, None)] * 3


def test_a_call_that_hangs_or_dies_among_others_fails_alone(user_rewards: str) -> None:
    """The calls sharing the process that one of them killed are run again, each alone in a
    fresh process: only the one that kills it fails."""
    with _pool(user_rewards, "by_mode", timeout_s=1.0) as pool:
        out = pool.score(_calls("fine", "hang", "fine", "die", "raise", "fine"))
        assert [o.error is None for o in out] == [True, False, True, False, False, True]
        assert "timed out" in str(out[1].error)
        assert "its process ended (killed by SIGKILL)" in str(out[3].error)
        assert "raised KeyError" in str(out[4].error)
        assert [out[i].reward for i in (0, 2, 5)] == [1.0, 1.0, 1.0]
        assert [o.reward for o in pool.score(_calls("fine", "fine", "fine"))] == [1.0] * 3


def test_a_call_that_blocks_its_process_fails_as_timed_out_and_the_others_go_on(
    user_rewards: str,
) -> None:
    """An async reward that blocks the event loop stops its process answering: past the
    grace the process is killed, that call fails as timed out, the others run again alone."""
    with _pool(user_rewards, "blocks_the_loop", timeout_s=1.0) as pool:
        pool.pool.grace_s = 0.5
        out, fine = pool.score(_calls("block", "fine"))
    assert out.error is not None
    assert "timed out after 1 s (reward.timeout_s), and its process stopped answering" in out.error
    assert (fine.reward, fine.error) == (1.0, None)


def test_a_process_full_of_hung_threads_is_replaced(
    user_rewards: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain function that timed out runs on in its thread: after ``RETIRE_AFTER`` of
    them the process takes no new calls and is stopped once its calls are answered."""
    monkeypatch.setattr(isolated, "RETIRE_AFTER", 2)
    with _pool(user_rewards, "by_mode", timeout_s=0.5) as pool:
        assert [o.error is not None for o in pool.score(_calls("hang", "hang"))] == [True, True]
        [first] = pool.pool.processes() or [None]
        assert first is None  # retired and stopped: no process is left with two hung threads
        assert [o.reward for o in pool.score(_calls("fine"))] == [1.0]
        assert len(pool.pool.processes()) == 1


def test_the_timeout_counts_for_each_call(user_rewards: str) -> None:
    """Three calls of 0.6 s take longer than the 1 s timeout together, and none of them
    times out."""
    with _pool(user_rewards, "by_mode", timeout_s=1.0) as pool:
        out = pool.score(_calls("slow", "slow", "slow"))
    assert [(o.reward, o.error) for o in out] == [(1.0, None)] * 3


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("user_rewards.exact", "not an import path of the form"),
        ("no_such_module:f", "module 'no_such_module' does not import"),
        ("user_rewards:missing", "has no attribute 'missing'"),
        ("user_rewards:not_callable", "is a int, not a function"),
    ],
)
def test_a_bad_import_path_names_what_is_wrong(user_rewards: str, path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        import_function(path)


def test_signatures_are_checked_against_the_fields_the_run_passes(user_rewards: str) -> None:
    check_signature("user_rewards:exact", import_function("user_rewards:exact"), ["answer"])
    check_signature("user_rewards:group", import_function("user_rewards:group"), ["answer"])
    with pytest.raises(ValueError, match="requires 'gold'"):
        check_signature(
            "user_rewards:needs_gold", import_function("user_rewards:needs_gold"), ["answer"]
        )
    assert module_root("user_rewards:exact") == user_rewards
