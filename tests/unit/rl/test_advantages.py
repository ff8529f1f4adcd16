import math

import pytest
import torch

from sluice.rl.advantages import STD_EPS, group_advantages


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
