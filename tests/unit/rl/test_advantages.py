import math

import pytest
import torch

from sluice.rl.advantages import (
    STD_EPS,
    Credit,
    gae,
    group_advantages,
    overlong_penalty,
    rloo_advantages,
    whiten,
)


@pytest.mark.parametrize(
    ("rewards", "scale", "expected"),
    [
        # mean 0.5, population std 0.5: +-1 (up to eps)
        ([[1.0, 0.0]], True, [[0.5 / (0.5 + STD_EPS), -0.5 / (0.5 + STD_EPS)]]),
        # mean 0.25, std sqrt(3)/4
        (
            [[1.0, 0.0, 0.0, 0.0]],
            True,
            [[0.75 / (math.sqrt(3) / 4 + STD_EPS)] + [-0.25 / (math.sqrt(3) / 4 + STD_EPS)] * 3],
        ),
        ([[1.0, 0.0, 0.0, 0.0]], False, [[0.75, -0.25, -0.25, -0.25]]),
        # all equal: no signal, no division by zero
        ([[1.0, 1.0, 1.0]], True, [[0.0, 0.0, 0.0]]),
        # groups are independent
        ([[1.0, 0.0], [0.0, 0.0]], False, [[0.5, -0.5], [0.0, 0.0]]),
    ],
    ids=["pair", "one-of-four", "one-of-four-centred", "all-equal", "two-groups"],
)
def test_group_advantages_closed_form(rewards, scale, expected):
    out = group_advantages(torch.tensor(rewards), scale_by_std=scale)
    torch.testing.assert_close(out, torch.tensor(expected), rtol=0, atol=1e-6)


def test_group_advantages_sum_to_zero_per_group():
    rewards = torch.rand(5, 8)
    assert torch.allclose(group_advantages(rewards).sum(dim=1), torch.zeros(5), atol=1e-5)


def test_group_advantages_rejects_flat_input():
    with pytest.raises(ValueError, match=r"\[groups, n\]"):
        group_advantages(torch.zeros(8))


@pytest.mark.parametrize(
    ("scale", "expected"),
    # valid [1, 0] of [1, 0, 5]: mean 0.5, std 0.5; the failed sample's 5 counts for nothing
    [(True, [1.0, -1.0, 0.0]), (False, [0.5, -0.5, 0.0])],
    ids=["scaled", "centred"],
)
def test_failed_samples_are_left_out_of_their_group(scale: bool, expected: list[float]) -> None:
    rewards = torch.tensor([[1.0, 0.0, 5.0], [2.0, 2.0, 2.0]])
    valid = torch.tensor([[True, True, False], [False, False, False]])
    out = group_advantages(rewards, scale_by_std=scale, valid=valid)
    torch.testing.assert_close(out[0], torch.tensor(expected), atol=1e-5, rtol=0)
    assert out[1].tolist() == [0.0, 0.0, 0.0]  # a group that failed whole teaches nothing


@pytest.mark.parametrize(
    ("rewards", "valid", "expected"),
    [
        # k = 4: 1 - mean(0, 0, 0) and 0 - mean(1, 0, 0)
        ([[1.0, 0.0, 0.0, 0.0]], None, [[1.0, -1 / 3, -1 / 3, -1 / 3]]),
        # the failed 5 is nobody's baseline and gets 0: 1 - 0, 0 - 1
        ([[1.0, 0.0, 5.0]], [[True, True, False]], [[1.0, -1.0, 0.0]]),
        # one valid sample has no other to compare with
        ([[1.0, 0.0]], [[True, False]], [[0.0, 0.0]]),
        # k / (k - 1) times GRPO's centred advantage: 2 x (0.5, -0.5)
        ([[1.0, 0.0]], None, [[1.0, -1.0]]),
    ],
    ids=["one-of-four", "failed-left-out", "alone", "pair"],
)
def test_rloo_closed_form(rewards, valid, expected):
    out = rloo_advantages(torch.tensor(rewards), None if valid is None else torch.tensor(valid))
    torch.testing.assert_close(out, torch.tensor(expected), rtol=0, atol=1e-6)


def test_whiten_weighs_samples_by_their_tokens_and_leaves_failed_ones_out():
    # A = [1, -1, 7] over [1, 3, 2] tokens, the 7 failed: mean (1 - 3) / 4 = -0.5,
    # variance (1 x 1.5^2 + 3 x 0.5^2) / 4 = 0.75
    out = whiten(
        torch.tensor([1.0, -1.0, 7.0]),
        torch.tensor([1.0, 3.0, 2.0]),
        torch.tensor([1, 1, 0]).bool(),
    )
    std = math.sqrt(0.75)
    torch.testing.assert_close(out, torch.tensor([1.5 / std, -0.5 / std, 0.0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("scale", "expected"),
    # max 10, buffer 4: free up to 6, then -1/4 a token, -scale from 10 on
    [(1.0, [0.0, 0.0, -0.5, -1.0, -1.0]), (0.5, [0.0, 0.0, -0.25, -0.5, -0.5])],
    ids=["whole", "half"],
)
def test_overlong_penalty_closed_form(scale, expected):
    out = overlong_penalty(torch.tensor([5, 6, 8, 10, 12]), max_tokens=10, buffer=4, scale=scale)
    torch.testing.assert_close(out, torch.tensor(expected))


def test_no_overlong_buffer_is_no_penalty():
    assert overlong_penalty(torch.tensor([10, 99]), max_tokens=10, buffer=0).tolist() == [0, 0]


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("grpo", [[1.0, -1.0, 0.0]]),  # mean 0.5, std 0.5 over the valid two
        ("rloo", [[1.0, -1.0, 0.0]]),
        ("reinforce_pp_baseline", [[0.5, -0.5, 0.0]]),  # centred; the trainer normalises
        ("reinforce_pp", [[1.0, 0.0, 0.0]]),  # the reward itself; the trainer normalises
    ],
    ids=["grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp"],
)
def test_credit_picks_the_estimator(estimator, expected):
    rewards = torch.tensor([[1.0, 0.0, 5.0]])
    valid = torch.tensor([[True, True, False]])
    out = Credit(estimator).advantages(rewards, valid)
    torch.testing.assert_close(out, torch.tensor(expected), atol=1e-5, rtol=0)


def test_credit_shapes_by_length_against_max_new_tokens():
    credit = Credit(overlong_buffer=4, overlong_penalty=0.5, max_new_tokens=10)
    assert credit.shaping([[6, 8], [10, 3]]).tolist() == [[0.0, -0.25], [-0.5, 0.0]]
    assert Credit(max_new_tokens=10).shaping([[10]]).tolist() == [[0.0]]


def test_credit_refuses_an_unknown_estimator():
    with pytest.raises(ValueError, match="allowed: grpo, rloo, reinforce_pp"):
        Credit("ppo")  # type: ignore[arg-type]


def _gae(values, mask, rewards, ids=None, gamma=1.0, lam=1.0):
    v, m = torch.tensor([values]), torch.tensor([mask])
    ids = torch.zeros_like(v, dtype=torch.long) if ids is None else torch.tensor([ids])
    # one reward for the row, or one per token
    r = torch.tensor(rewards) if len(rewards) == 1 else torch.tensor([rewards])
    return gae(r, v, m, ids, gamma, lam)


@pytest.mark.parametrize(
    ("values", "mask", "gamma", "lam", "expected"),
    [
        # gamma = lam = 1: Monte Carlo, R - V at every token
        ([0.5, 0.5, 0.5], [1.0, 1.0, 1.0], 1.0, 1.0, [0.5, 0.5, 0.5]),
        # lam = 0: one-step TD errors, the reward only at the last token
        ([0.5, 0.5, 0.5], [1.0, 1.0, 1.0], 1.0, 0.0, [0.0, 0.0, 0.5]),
        # t2: 1 - 0.6 = 0.4; t1: 0.9 x 0.6 - 0.4 + 0.45 x 0.4 = 0.32;
        # t0: 0.9 x 0.4 - 0.2 + 0.45 x 0.32 = 0.304
        ([0.2, 0.4, 0.6], [1.0, 1.0, 1.0], 0.9, 0.5, [0.304, 0.32, 0.4]),
        # an environment's token between: stepped over (its value 9 unread)
        ([0.2, 9.0, 0.6], [1.0, 0.0, 1.0], 0.9, 0.5, [0.34 + 0.45 * 0.4, 0.0, 0.4]),
        # padding after the sequence: the reward is at its last loss token
        ([0.5, 0.5, 7.0], [1.0, 1.0, 0.0], 1.0, 1.0, [0.5, 0.5, 0.0]),
    ],
    ids=["monte-carlo", "td0", "gamma-lambda", "environment-token", "padding"],
)
def test_gae_closed_form(values, mask, gamma, lam, expected):
    advantages, returns = _gae(values, mask, [1.0], gamma=gamma, lam=lam)
    torch.testing.assert_close(advantages, torch.tensor([expected]), atol=1e-6, rtol=0)
    want = [(a + v) * m for a, v, m in zip(expected, values, mask, strict=True)]
    torch.testing.assert_close(returns, torch.tensor([want]), atol=1e-6, rtol=0)


def test_gae_keeps_packed_sequences_apart():
    # one packed row: sequence 0 (reward 1) on tokens 0-1, sequence 1 (reward 0) on 2-3;
    # sequence 0 must not bootstrap from sequence 1's values of 5
    advantages, _ = _gae([0.0, 0.0, 5.0, 5.0], [1.0] * 4, [1.0, 1.0, 0.0, 0.0], ids=[0, 0, 1, 1])
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 1.0, -5.0, -5.0]]))
