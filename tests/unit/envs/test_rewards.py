"""User reward functions by import path, run in ``RewardPool``'s processes (``envs/rewards.py``).

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

from sluice.envs.rewards import (
    RewardCall,
    RewardFunction,
    RewardPool,
    check_signature,
    import_function,
    module_root,
)

USER_MODULE = """
import asyncio, os, signal, time
from sluice.envs.rewards import batched

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
        ("die", "the reward process was killed by SIGKILL"),
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
    assert out[0].error is not None and "timed out" in out[0].error
    assert [o.reward for o in out[1:]] == [1.0, 1.0, 1.0]


def test_a_group_is_one_round_trip_and_a_call_that_hangs_or_dies_in_it_fails_alone(
    user_rewards: str,
) -> None:
    """A group's calls go to a process in one request, answered call by call; when one of
    them hangs or kills the process, only that call fails and the later ones go on in a
    fresh process."""
    with _pool(user_rewards, "by_mode", timeout_s=1.0) as pool:
        [job] = pool._jobs(_calls("a", "b", "c"))
        assert job.each and job.calls == [0, 1, 2]
        out = pool.score(_calls("fine", "hang", "fine", "die", "raise", "fine"))
        assert [o.error is None for o in out] == [True, False, True, False, False, True]
        assert "timed out" in str(out[1].error) and "SIGKILL" in str(out[3].error)
        assert "raised KeyError" in str(out[4].error)
        assert [out[i].reward for i in (0, 2, 5)] == [1.0, 1.0, 1.0]
        [slot] = pool._slots
        assert slot is not None and slot.proc.poll() is None
        pid = slot.proc.pid
        assert [o.reward for o in pool.score(_calls("fine", "fine", "fine"))] == [1.0] * 3
        assert pool._slots[0] is slot and slot.proc.pid == pid  # no process lost on the way


def test_the_timeout_counts_for_each_call_of_a_group(user_rewards: str) -> None:
    """Three calls of 0.6 s in one request take longer than the 1 s timeout together, and
    none of them times out."""
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
