import dataclasses
import math

import pytest
import torch

from sluice.rl.losses import (
    AGGREGATIONS,
    LOSS_NAMES,
    chunked_token_stats,
    decoupled_ppo_loss,
    gspo_loss,
    kl_k3,
    kl_penalty,
    logprob_mismatch,
    loss_weights,
    masked_mean,
    policy_loss,
    ppo_clip_loss,
    sequence_sums,
    tis_loss,
    token_stats,
    value_loss,
)

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
    target = torch.zeros(1, 1, dtype=torch.long)
    assert token_stats(uniform, target)[1].item() == pytest.approx(math.log(vocab), rel=1e-6)
    assert token_stats(peaked, target)[1].item() == pytest.approx(0.0, abs=1e-6)


def test_token_stats_picks_the_targets_logprob():
    logits = torch.log(torch.tensor([[[0.1, 0.2, 0.7]]]))
    assert token_stats(logits, torch.tensor([[2]]))[0].item() == pytest.approx(math.log(0.7))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_stats_equal_the_whole_logits_in_values_and_gradients(chunk):
    torch.manual_seed(0)
    tokens, width, vocab = 64, 16, 300
    head = torch.nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(tokens, width, requires_grad=True)
    targets = torch.randint(vocab, (tokens,))
    weights = torch.randn(tokens)  # a loss that weighs each token's log-prob and entropy

    def grads(lp: torch.Tensor, ent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.autograd.grad((weights * lp).sum() + 0.3 * ent.sum(), [hidden, head.weight])

    whole_lp, whole_ent = token_stats(head(hidden), targets)
    lp, ent = chunked_token_stats(head, hidden, targets, chunk, entropy_grad=True)
    torch.testing.assert_close(lp, whole_lp)
    torch.testing.assert_close(ent, whole_ent)
    for mine, theirs in zip(grads(lp, ent), grads(whole_lp, whole_ent), strict=True):
        torch.testing.assert_close(mine, theirs)


def test_a_metric_entropy_leaves_the_graph():
    head = torch.nn.Linear(4, 10, bias=False)
    hidden = torch.randn(5, 4, requires_grad=True)
    lp, ent = chunked_token_stats(head, hidden, torch.zeros(5, dtype=torch.long), 2, False)
    assert lp.requires_grad and not ent.requires_grad
    with torch.no_grad():  # evaluation: nothing kept for a backward pass
        lp, _ = chunked_token_stats(head, hidden, torch.zeros(5, dtype=torch.long), 2, True)
    assert not lp.requires_grad


def test_chunked_stats_hold_one_chunk_of_logits_for_the_backward():
    """What autograd keeps between forward and backward: the chunks' inputs, not a
    [tokens, vocab] tensor (the backward recomputes each chunk's logits)."""
    head = torch.nn.Linear(8, 5000, bias=False)
    hidden = torch.randn(512, 8, requires_grad=True)
    targets = torch.zeros(512, dtype=torch.long)
    kept: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_token_stats(head, hidden, targets, 64, entropy_grad=False)
    assert max(kept) < 512 * 5000 // 4  # no whole-logits tensor saved
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_stats(head(hidden), targets)
    assert max(kept) >= 512 * 5000  # the unchunked path saves them


@pytest.mark.parametrize(("tokens", "runs"), [(64, 1), (65, 4)])
def test_only_tokens_beyond_one_chunk_recompute_their_logits_in_the_backward(tokens, runs):
    head = torch.nn.Linear(8, 50, bias=False)
    calls = []
    head.register_forward_pre_hook(lambda *_: calls.append(1))
    hidden = torch.randn(tokens, 8, requires_grad=True)
    lp, _ = chunked_token_stats(head, hidden, torch.zeros(tokens, dtype=torch.long), 64, False)
    lp.sum().backward()
    assert len(calls) == runs  # one chunk: once; two: each again in the backward


def test_masked_mean_empty_mask_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0


LN2 = math.log(2.0)


@pytest.mark.parametrize(
    ("logp", "prox", "behav", "adv", "cap", "expected_loss", "expected_clip", "expected_trunc"),
    [
        # all three policies agree: w = r = 1, loss -A
        (0.0, 0.0, 0.0, 2.0, None, -2.0, 0.0, 0.0),
        # stale behaviour: w = e uncapped, r = 1 -> loss -e A
        (0.0, 0.0, -1.0, 1.0, None, -E, 0.0, 0.0),
        # the same weight capped at 2 -> loss -2 A, every token truncated
        (0.0, 0.0, -1.0, 1.0, 2.0, -2.0, 0.0, 1.0),
        # w = 1, r = e > 1.2 with A > 0: clipped -> loss -1.2 A, as plain PPO
        (1.0, 0.0, 0.0, 1.0, None, -1.2, 1.0, 0.0),
        # w = 1/2, r = e clipped -> loss -0.5 * 1.2
        (1.0, 0.0, LN2, 1.0, 2.0, -0.6, 1.0, 0.0),
        # w = e capped at 2, r = e, A < 0: min picks e A -> loss 2 e
        (1.0, 0.0, -1.0, -1.0, 2.0, 2.0 * E, 0.0, 1.0),
    ],
    ids=[
        "on-policy",
        "stale-uncapped",
        "stale-capped",
        "proximal-clipped",
        "down-weighted-clipped",
        "capped-neg-adv",
    ],
)
def test_decoupled_ppo_closed_form(
    logp, prox, behav, adv, cap, expected_loss, expected_clip, expected_trunc
):
    # r = e^(logp - prox), w = e^(prox - behav), over three response tokens
    shape = (1, 3)
    out = decoupled_ppo_loss(
        torch.full(shape, logp),
        torch.full(shape, prox),
        torch.full(shape, behav),
        torch.tensor([adv]),
        torch.ones(shape),
        clip_eps=0.2,
        weight_cap=cap,
    )
    assert out.loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert out.clip_fraction.item() == pytest.approx(expected_clip)
    assert out.truncated_fraction.item() == pytest.approx(expected_trunc)
    assert out.ratio_mean.item() == pytest.approx(math.exp(logp - prox), rel=1e-6)
    # weight statistics describe w before the cap
    assert out.weight_mean.item() == pytest.approx(math.exp(prox - behav), rel=1e-6)
    assert out.weight_max.item() == pytest.approx(math.exp(prox - behav), rel=1e-6)


def _random_case(seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (3, 5)
    logp = -torch.rand(shape, generator=gen) * 2.0
    behav = logp + 0.5 * torch.randn(shape, generator=gen)
    adv = torch.randn(3, generator=gen)
    mask = (torch.rand(shape, generator=gen) > 0.3).float()
    return logp, behav, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2], ids=["seed0", "seed1", "seed2"])
def test_decoupled_ppo_with_proximal_equal_behaviour_is_ppo(seed):
    logp, behav, adv, mask = _random_case(seed)
    # pi_theta moves away from pi_prox so that some ratios clip
    step = 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed))
    theta_a = (logp + step).requires_grad_()
    theta_b = theta_a.detach().clone().requires_grad_()
    ppo = ppo_clip_loss(theta_a, behav, adv, mask, clip_eps=0.2)
    decoupled = decoupled_ppo_loss(theta_b, behav, behav, adv, mask, 0.2, weight_cap=None)
    ppo.loss.backward()
    decoupled.loss.backward()
    assert ppo.clip_fraction.item() > 0.0
    torch.testing.assert_close(decoupled.loss, ppo.loss)
    torch.testing.assert_close(decoupled.clip_fraction, ppo.clip_fraction)
    torch.testing.assert_close(theta_b.grad, theta_a.grad)


@pytest.mark.parametrize(
    ("behav", "cap", "weight"),
    [(0.0, None, 1.0), (-1.0, None, E), (-1.0, 2.0, 2.0), (LN2, 2.0, 0.5)],
    ids=["on-policy", "stale-uncapped", "stale-capped", "down-weighted"],
)
def test_decoupled_ppo_gradient_at_proximal(behav, cap, weight):
    # at pi_theta = pi_prox (r = 1, inside the clip range) d loss / d logp_t = -w_t A / N
    adv, n = 1.5, 4
    logp = torch.zeros(1, n, requires_grad=True)
    out = decoupled_ppo_loss(
        logp,
        logp.detach(),
        torch.full((1, n), behav),
        torch.tensor([adv]),
        torch.ones(1, n),
        clip_eps=0.2,
        weight_cap=cap,
    )
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, n), -weight * adv / n))


@pytest.mark.parametrize(
    ("logp", "behav", "adv", "cap", "expected_loss", "expected_weight", "expected_trunc"),
    [
        # rho = 1: loss -logp A = 1, weight 1
        (-1.0, -1.0, 1.0, 2.0, 1.0, 1.0, 0.0),
        # rho = e^(1/2) < 2: loss -e^(1/2) * logp * A
        (-1.0, -1.5, 1.0, 2.0, math.exp(0.5), math.exp(0.5), 0.0),
        # rho = e > 2: truncated to 2 -> loss -2 * (-1) * 1 = 2
        (-1.0, -2.0, 1.0, 2.0, 2.0, E, 1.0),
        # rho = e, A < 0, cap 1 (IMPALA's rho-bar): loss -1 * (-1) * (-1) = -1
        (-1.0, -2.0, -1.0, 1.0, -1.0, E, 1.0),
        # rho = 1/e < cap: loss -(1/e) * (-2) * 1
        (-2.0, -1.0, 1.0, 2.0, 2.0 / E, 1.0 / E, 0.0),
    ],
    ids=["on-policy", "below-cap", "above-cap", "neg-adv-cap-one", "under-one"],
)
def test_tis_closed_form(logp, behav, adv, cap, expected_loss, expected_weight, expected_trunc):
    # loss = -min(rho, cap) * logp * A with rho = e^(logp - behav), over three tokens
    shape = (1, 3)
    logprobs = torch.full(shape, logp, requires_grad=True)
    out = tis_loss(logprobs, torch.full(shape, behav), torch.tensor([adv]), torch.ones(shape), cap)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert out.weight_mean.item() == pytest.approx(expected_weight, rel=1e-6)
    assert out.weight_max.item() == pytest.approx(expected_weight, rel=1e-6)
    assert out.truncated_fraction.item() == pytest.approx(expected_trunc)
    assert out.clip_fraction.item() == 0.0
    # the weight is held constant: d loss / d logp_t = -min(rho, cap) A / N
    truncated = min(expected_weight, cap)
    torch.testing.assert_close(logprobs.grad, torch.full(shape, -truncated * adv / 3))


@pytest.mark.parametrize("seed", [0, 1, 2], ids=["seed0", "seed1", "seed2"])
def test_tis_gradient_matches_closed_form_under_a_mask(seed):
    logp, behav, adv, mask = _random_case(seed)
    logp.requires_grad_()
    cap = 1.2
    tis_loss(logp, behav, adv, mask, cap).loss.backward()
    rho = torch.exp(logp.detach() - behav)
    expected = -torch.clamp(rho, max=cap) * adv.unsqueeze(1) * mask / mask.sum()
    torch.testing.assert_close(logp.grad, expected)


@pytest.mark.parametrize("seed", [0, 1, 2], ids=["seed0", "seed1", "seed2"])
def test_decoupled_ppo_at_proximal_has_the_tis_gradient(seed):
    # One optimiser step per batch makes pi_prox = pi_theta: r = 1 and both losses give
    # min(pi/pi_behav, cap) * A * grad log pi.
    logp, behav, adv, mask = _random_case(seed)
    a = logp.clone().requires_grad_()
    b = logp.clone().requires_grad_()
    decoupled_ppo_loss(a, a.detach(), behav, adv, mask, 0.2, weight_cap=1.5).loss.backward()
    tis_loss(b, behav, adv, mask, cap=1.5).loss.backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_weight_statistics_and_truncation_over_mixed_tokens():
    # rho = [1/2, 1, 3, 5], cap 2: mean 9.5/4, max 5, half the tokens truncated
    rho = torch.tensor([[0.5, 1.0, 3.0, 5.0]])
    logp = torch.zeros(1, 4)
    out = tis_loss(logp, -torch.log(rho), torch.tensor([1.0]), torch.ones(1, 4), cap=2.0)
    assert out.weight_mean.item() == pytest.approx(9.5 / 4, rel=1e-6)
    assert out.weight_max.item() == pytest.approx(5.0, rel=1e-6)
    assert out.truncated_fraction.item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda lp, b, a, m: ppo_clip_loss(lp, b, a, m, 0.2),
        lambda lp, b, a, m: decoupled_ppo_loss(lp, lp.detach(), b, a, m, 0.2, 2.0),
        lambda lp, b, a, m: tis_loss(lp, b, a, m, 2.0),
    ],
    ids=["ppo", "decoupled_ppo", "tis"],
)
def test_masked_tokens_change_neither_loss_nor_statistics(loss_fn):
    # the second token has a weight of e^5 but mask 0: everything is as for the first alone
    logp = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    behav = torch.tensor([[-1.0, -5.0]])
    out = loss_fn(logp, behav, torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]))
    out.loss.backward()
    alone = loss_fn(logp[:, :1].detach(), behav[:, :1], torch.tensor([1.0]), torch.ones(1, 1))
    assert out.loss.item() == pytest.approx(alone.loss.item())
    assert out.weight_mean.item() == pytest.approx(1.0)
    assert out.weight_max.item() == pytest.approx(1.0)
    assert out.truncated_fraction.item() == 0.0
    assert logp.grad[0, 1].item() == 0.0


def test_ppo_reports_its_ratio_as_the_weight_and_never_truncates():
    # ratio [e, 1/e]: mean (e + 1/e) / 2, max e; PPO has no cap
    out = ppo_clip_loss(
        torch.tensor([[1.0, -1.0]]), torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2)
    )
    assert out.weight_mean.item() == pytest.approx((E + 1 / E) / 2, rel=1e-6)
    assert out.weight_max.item() == pytest.approx(E, rel=1e-6)
    assert out.truncated_fraction.item() == 0.0


def test_empty_mask_gives_zero_statistics():
    out = tis_loss(torch.zeros(1, 2), torch.full((1, 2), -3.0), torch.ones(1), torch.zeros(1, 2), 2)
    assert (out.loss.item(), out.weight_mean.item(), out.weight_max.item()) == (0.0, 0.0, 0.0)
    assert out.truncated_fraction.item() == 0.0


@pytest.mark.parametrize(
    ("prox", "behav", "mask", "expected"),
    [
        ([[0.0, 0.0]], [[0.0, 0.0]], [[1.0, 1.0]], 0.0),
        ([[-1.0, -2.0]], [[-1.5, -1.0]], [[1.0, 1.0]], 0.75),  # (0.5 + 1) / 2
        ([[-1.0, -2.0]], [[-1.5, -9.0]], [[1.0, 0.0]], 0.5),  # second token masked
    ],
    ids=["equal", "both-signs", "masked"],
)
def test_logprob_mismatch_closed_form(prox, behav, mask, expected):
    out = logprob_mismatch(torch.tensor(prox), torch.tensor(behav), torch.tensor(mask))
    assert out.item() == pytest.approx(expected)


@pytest.mark.parametrize("name", LOSS_NAMES, ids=LOSS_NAMES)
def test_policy_loss_dispatches_by_name(name):
    logp, behav, adv, mask = _random_case(0)
    rows = torch.arange(3).unsqueeze(1).expand_as(mask)
    direct = {
        "ppo": lambda: ppo_clip_loss(logp, behav, adv, mask, 0.2),
        "decoupled_ppo": lambda: decoupled_ppo_loss(logp, logp, behav, adv, mask, 0.2, 1.5),
        "tis": lambda: tis_loss(logp, behav, adv, mask, 1.5),
        "gspo": lambda: gspo_loss(logp, behav, adv, mask, rows, 0.2),
    }[name]()
    out = policy_loss(
        name, logp, logp, behav, adv, mask, clip_eps=0.2, is_cap=1.5, sequence_ids=rows
    )
    for field in dataclasses.fields(out):
        torch.testing.assert_close(getattr(out, field.name), getattr(direct, field.name))


def test_policy_loss_rejects_unknown_names():
    with pytest.raises(ValueError, match="allowed: ppo, decoupled_ppo, tis, gspo"):
        policy_loss("a2c", *(torch.zeros(1, 1),) * 3, torch.zeros(1), torch.ones(1, 1), 0.2, 2.0)


@pytest.mark.parametrize(
    ("log_ratio", "adv", "high", "expected_ratio_term", "clipped"),
    [
        # ratio e^0.25 = 1.284, A > 0: symmetric 0.2 clips at 1.2
        (0.25, 1.0, None, 1.2, 1.0),
        # clip-higher 0.28 clips at 1.28 instead
        (0.25, 1.0, 0.28, 1.28, 1.0),
        # ratio e^0.2 = 1.221 < 1.28: left alone under clip-higher
        (0.2, 1.0, 0.28, math.exp(0.2), 0.0),
        # the low side is clip_eps's whatever the high one: ratio e^-0.5 = 0.607, A < 0
        (-0.5, -1.0, 0.28, 0.8, 1.0),
    ],
    ids=["symmetric", "clip-higher", "under-the-higher-bound", "low-side"],
)
def test_clip_higher_closed_form(log_ratio, adv, high, expected_ratio_term, clipped):
    shape = (1, 2)
    out = ppo_clip_loss(
        torch.full(shape, log_ratio),
        torch.zeros(shape),
        torch.tensor([adv]),
        torch.ones(shape),
        clip_eps=0.2,
        clip_eps_high=high,
    )
    assert out.loss.item() == pytest.approx(-expected_ratio_term * adv, abs=1e-6)
    assert out.clip_fraction.item() == clipped


# Two sequences of 2 and 3 loss tokens (the first padded by one masked token).
_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
_ROWS = torch.arange(2).unsqueeze(1).expand(2, 3)


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        # every token of the batch: 1/5 each
        ("token_mean", [[0.2, 0.2, 0.0], [0.2, 0.2, 0.2]]),
        # each sequence weighs 1/2, split over its own tokens
        ("seq_mean_token_mean", [[0.25, 0.25, 0.0], [1 / 6, 1 / 6, 1 / 6]]),
        # each sequence's token sum, over 2 sequences
        ("seq_mean_token_sum", [[0.5, 0.5, 0.0], [0.5, 0.5, 0.5]]),
    ],
    ids=list(AGGREGATIONS),
)
def test_loss_weights_closed_form(aggregation, expected):
    weights = loss_weights(_MASK, _ROWS, aggregation, torch.tensor(5.0), torch.tensor(2.0))
    torch.testing.assert_close(weights, torch.tensor(expected))


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    # on-policy (ratio 1), A = +1 for the 2-token sequence, -1 for the 3-token one:
    # token mean -(2 - 3) / 5; sequence means -(1 - 1) / 2; sequence sums -(2 - 3) / 2
    [("token_mean", 0.2), ("seq_mean_token_mean", 0.0), ("seq_mean_token_sum", 0.5)],
    ids=list(AGGREGATIONS),
)
def test_aggregation_changes_the_ppo_loss_as_by_hand(aggregation, expected):
    weights = loss_weights(_MASK, _ROWS, aggregation, torch.tensor(5.0), torch.tensor(2.0))
    zeros = torch.zeros(2, 3)
    out = ppo_clip_loss(zeros, zeros, torch.tensor([1.0, -1.0]), _MASK, 0.2, weights=weights)
    assert out.loss.item() == pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize("aggregation", AGGREGATIONS, ids=AGGREGATIONS)
def test_a_batch_cut_in_parts_adds_up_to_its_whole_loss(aggregation):
    logp, behav, adv, mask = _random_case(3)
    mask[:, 0] = 1.0  # every sequence has a loss token
    rows = torch.arange(3).unsqueeze(1).expand_as(mask)
    tokens, sequences = mask.sum(), torch.tensor(3.0)

    def loss(index):
        part = mask[index]
        weights = loss_weights(part, rows[index], aggregation, tokens, sequences)
        return ppo_clip_loss(logp[index], behav[index], adv[index], part, 0.2, weights=weights)

    whole = loss(torch.arange(3)).loss
    split = loss(torch.tensor([0, 2])).loss + loss(torch.tensor([1])).loss
    assert split.item() == pytest.approx(whole.item(), abs=1e-6)


def test_loss_weights_reject_unknown_aggregations():
    with pytest.raises(ValueError, match="allowed: token_mean, seq_mean_token_mean"):
        loss_weights(_MASK, _ROWS, "sum", torch.tensor(5.0), torch.tensor(2.0))


def test_sequence_sums_keep_packed_samples_apart():
    # one packed row: sample 0 on tokens 0-1, sample 1 on tokens 2-4 (token 3 masked)
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0]])
    sums = sequence_sums(torch.tensor([[1.0, 2.0, 3.0, 100.0, 5.0]]), mask, ids)
    assert sums.tolist() == [[3.0, 3.0, 8.0, 8.0, 8.0]]


def test_gspo_takes_one_ratio_per_sequence():
    # log ratios 0.1 and 0.3: s = exp(mean) = e^0.2 = 1.2214, inside [0.8, 1.28]
    logp = torch.tensor([[0.1, 0.3]], requires_grad=True)
    mask = torch.ones(1, 2)
    rows = torch.zeros(1, 2, dtype=torch.long)
    weights = loss_weights(mask, rows, "seq_mean_token_mean", torch.tensor(2.0), torch.tensor(1.0))
    out = gspo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), mask, rows, 0.2, 0.28, weights)
    s = math.exp(0.2)
    assert out.loss.item() == pytest.approx(-s, rel=1e-6)
    assert out.ratio_mean.item() == pytest.approx(s, rel=1e-6)  # every token carries s
    out.loss.backward()
    # GSPO's gradient: -A s (1/|y|) grad log pi for each token
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -s / 2))


def test_gspo_clips_a_whole_sequence_and_no_token_of_another():
    # sequence 0: log ratios 0.4, 0.0 -> s = e^0.2 = 1.22 > 1 + 4e-4, A > 0: clipped whole;
    # sequence 1: log ratios 0.4, -0.4 -> s = 1, inside: no token clipped although each
    # token's own ratio is far outside the band
    logp = torch.tensor([[0.4, 0.0], [0.4, -0.4]], requires_grad=True)
    mask = torch.ones(2, 2)
    rows = torch.arange(2).unsqueeze(1).expand(2, 2)
    weights = loss_weights(mask, rows, "seq_mean_token_mean", torch.tensor(4.0), torch.tensor(2.0))
    out = gspo_loss(
        logp, torch.zeros(2, 2), torch.tensor([1.0, 1.0]), mask, rows, 3e-4, 4e-4, weights
    )
    assert out.clip_fraction.item() == pytest.approx(0.5)
    assert out.loss.item() == pytest.approx(-((1 + 4e-4) + 1.0) / 2, rel=1e-6)
    out.loss.backward()
    # the clipped sequence carries no gradient; the other -s A / (|y| * 2 sequences) each
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]]))


@pytest.mark.parametrize(
    ("estimator", "expected"),
    # d = log pi - log ref = [0, 1, -1]
    [
        ("k1", [0.0, 1.0, -1.0]),
        ("k2", [0.0, 0.5, 0.5]),
        ("k3", [0.0, 1.0 / E, E - 2.0]),  # e^-d + d - 1
    ],
    ids=["k1", "k2", "k3"],
)
def test_kl_penalty_closed_form(estimator, expected):
    out = kl_penalty(torch.tensor([[0.0, 1.0, -1.0]]), torch.zeros(1, 3), estimator)
    torch.testing.assert_close(out, torch.tensor([expected]))


def test_kl_penalty_k3_gradient_pulls_toward_the_reference():
    # d/d(log pi) of e^-d + d - 1 is 1 - e^-d: positive above the reference, negative below
    logp = torch.tensor([[1.0, -1.0]], requires_grad=True)
    kl_penalty(logp, torch.zeros(1, 2), "k3").sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[1.0 - 1.0 / E, 1.0 - E]]))


def test_kl_penalty_rejects_unknown_estimators():
    with pytest.raises(ValueError, match="allowed: k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


@pytest.mark.parametrize(
    ("value", "old", "ret", "expected"),
    [
        # V moved 0.5 past V_old: clipped to 0.7, farther from R = 2: 0.5 x 1.3^2
        (1.0, 0.5, 2.0, 0.5 * 1.3**2),
        # inside the clip range: 0.5 x (1 - 0)^2
        (1.0, 0.9, 0.0, 0.5),
        # clipped toward R: the unclipped error is the larger one
        (1.0, 0.5, 0.0, 0.5),
    ],
    ids=["clipped-farther", "inside", "clipped-nearer"],
)
def test_value_loss_closed_form(value, old, ret, expected):
    out = value_loss(
        torch.tensor([[value]]), torch.tensor([[old]]), torch.tensor([[ret]]), torch.ones(1, 1), 0.2
    )
    assert out.item() == pytest.approx(expected)
