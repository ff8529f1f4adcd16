import math

import pytest
import torch

from rl.losses import entropy_from_logits, kl_k3, masked_mean, ppo_clip_loss, token_logprobs

E = math.e


@pytest.mark.parametrize(
    ("logp", "old", "adv", "expected_loss", "expected_clip"),
    [
        # ratio 1: loss is -A
        (0.0, 0.0, 2.0, -2.0, 0.0),
        # ratio e > 1.2, A > 0: clipped at 1.2 -> loss -1.2 A
        (1.0, 0.0, 1.0, -1.2, 1.0),
        # ratio e, A < 0: min picks the unclipped e*A -> loss e
        (1.0, 0.0, -1.0, E, 0.0),
        # ratio 1/e < 0.8, A < 0: clipped at 0.8 -> loss 0.8
        (-1.0, 0.0, -1.0, 0.8, 1.0),
        # ratio 1/e, A > 0: unclipped 1/e -> loss -1/e
        (-1.0, 0.0, 1.0, -1.0 / E, 0.0),
    ],
    ids=[
        "on-policy",
        "high-ratio-pos-adv",
        "high-ratio-neg-adv",
        "low-ratio-neg-adv",
        "low-ratio-pos-adv",
    ],
)
def test_ppo_clip_closed_form(logp, old, adv, expected_loss, expected_clip):
    # ratio will be [r, r, r] over three response tokens
    shape = (1, 3)
    out = ppo_clip_loss(
        torch.full(shape, logp),
        torch.full(shape, old),
        torch.tensor([adv]),
        torch.ones(shape),
        clip_eps=0.2,
    )
    assert out.loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(expected_clip)
    assert out.ratio_mean.item() == pytest.approx(math.exp(logp - old), rel=1e-6)


def test_ppo_clip_ignores_masked_tokens():
    logp = torch.tensor([[0.0, 5.0]])
    mask = torch.tensor([[1.0, 0.0]])
    out = ppo_clip_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), mask)
    assert out.loss.item() == pytest.approx(-1.0)


def test_ppo_clip_token_level_mean():
    # two sequences, 1 and 3 tokens, advantages +1 and -1, on-policy: (-1 + 3 * 1) / 4
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    out = ppo_clip_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    assert out.loss.item() == pytest.approx(0.5)


def test_ppo_gradient_raises_logprob_of_positive_advantage():
    logp = torch.zeros(1, 1, requires_grad=True)
    ppo_clip_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1)).loss.backward()
    assert logp.grad.item() == pytest.approx(-1.0)  # minimising pushes logp up


@pytest.mark.parametrize(
    ("logp", "ref", "expected"),
    [(0.0, 0.0, 0.0), (0.0, 1.0, E - 2.0), (1.0, 0.0, 1.0 / E)],
    ids=["equal", "ref-higher", "policy-higher"],
)
def test_kl_k3_closed_form(logp, ref, expected):
    # k3 = e^d - d - 1 with d = ref - logp
    out = kl_k3(torch.full((2, 2), logp), torch.full((2, 2), ref), torch.ones(2, 2))
    assert out.item() == pytest.approx(expected, rel=1e-6)


def test_entropy_uniform_and_peaked():
    vocab = 8
    uniform = torch.zeros(1, 1, vocab)
    peaked = torch.tensor([[[100.0] + [0.0] * (vocab - 1)]])
    mask = torch.ones(1, 1)
    assert entropy_from_logits(uniform, mask).item() == pytest.approx(math.log(vocab), rel=1e-6)
    assert entropy_from_logits(peaked, mask).item() == pytest.approx(0.0, abs=1e-6)


def test_token_logprobs_picks_target():
    logits = torch.log(torch.tensor([[[0.1, 0.2, 0.7]]]))
    assert token_logprobs(logits, torch.tensor([[2]])).item() == pytest.approx(math.log(0.7))


def test_masked_mean_empty_mask_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0
