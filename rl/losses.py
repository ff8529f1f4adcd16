"""Policy-gradient losses and the diagnostics logged beside them.

All functions take per-token tensors shaped [batch, tokens] with a 0/1 ``mask`` that marks
the response tokens a loss applies to; padding and prompt tokens carry mask 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch.utils.checkpoint import checkpoint

LossName = Literal["ppo", "decoupled_ppo", "tis", "gspo"]
LOSS_NAMES: tuple[str, ...] = get_args(LossName)
# How per-token losses add up to a batch's loss (verl's ``loss_agg_mode`` names):
# token_mean: every loss token of the batch weighs the same (DAPO, arXiv 2503.14476 §3.3);
# seq_mean_token_mean: each sequence's token mean, then the mean over sequences (GRPO's
# original form, arXiv 2402.03300 eq. 3); seq_mean_token_sum: each sequence's token sum,
# then the mean over sequences (Dr. GRPO's unbiased form divides by a constant instead,
# arXiv 2503.20783 §3.1).
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


@dataclass(frozen=True)
class PolicyLoss:
    """The scalar to minimise plus the statistics a person wants to see per step.

    All statistics are detached token-level means over the mask, except ``weight_max``.
    ``weight_*`` describe the importance weight that corrects for the policy that generated
    the tokens, before any cap; ``truncated_fraction`` is the share of tokens whose weight
    exceeded the cap (0 for a loss without one).
    """

    loss: torch.Tensor
    clip_fraction: torch.Tensor
    ratio_mean: torch.Tensor
    weight_mean: torch.Tensor
    weight_max: torch.Tensor
    truncated_fraction: torch.Tensor


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    total = mask.sum()
    return (values * mask).sum() / total.clamp(min=1.0)


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Largest of ``values`` where ``mask`` is 1 (0 when the mask is empty)."""
    if not bool(mask.any()):
        return values.new_zeros(())
    return values.detach()[mask.bool()].max()


def sequence_sums(
    values: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor
) -> torch.Tensor:
    """At each token, the sum of ``values`` over the masked tokens of its sequence; all
    [batch, tokens], ``sequence_ids`` naming each token's sequence (``rl.batching``)."""
    flat_ids = sequence_ids.reshape(-1)
    size = int(flat_ids.max()) + 1 if flat_ids.numel() else 0
    sums = values.new_zeros(size).index_add(0, flat_ids, (values * mask).reshape(-1))
    return sums[flat_ids].reshape(values.shape)


def sequence_lengths(mask: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """At each token, its sequence's number of loss tokens (at least 1), [batch, tokens]."""
    return sequence_sums(torch.ones_like(mask), mask, sequence_ids).clamp(min=1.0)


def loss_weights(
    mask: torch.Tensor,
    sequence_ids: torch.Tensor,
    aggregation: str,
    tokens: torch.Tensor,
    sequences: torch.Tensor,
) -> torch.Tensor:
    """Each token's weight in a batch's loss, [batch, tokens]: summed over every part and
    rank of the batch the weights add up to 1 (``AGGREGATIONS``). ``tokens`` and
    ``sequences`` are the whole batch's loss tokens and sequences with any (every rank's)."""
    if aggregation == "token_mean":
        return mask / tokens.clamp(min=1.0)
    if aggregation == "seq_mean_token_sum":
        return mask / sequences.clamp(min=1.0)
    if aggregation == "seq_mean_token_mean":
        length = sequence_lengths(mask, sequence_ids)
        return mask / (length * sequences.clamp(min=1.0))
    raise ValueError(
        f"unknown loss aggregation {aggregation!r}; allowed: {', '.join(AGGREGATIONS)}"
    )


def _reduce(
    per_token: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """The loss from per-token objectives: minus their ``weights``-weighted sum, or minus
    their mean over ``mask`` when no weights are given."""
    return -masked_mean(per_token, mask) if weights is None else -(per_token * weights).sum()


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages [batch] (one per sequence, GRPO) or [batch, tokens], as [batch, tokens]."""
    return advantages.unsqueeze(1).expand_as(like) if advantages.dim() == 1 else advantages


def _with_stats(
    loss: torch.Tensor,
    clip_fraction: torch.Tensor,
    weight: torch.Tensor,
    mask: torch.Tensor,
    cap: float | None,
    ratio_mean: torch.Tensor | None = None,
) -> PolicyLoss:
    """``loss`` and its statistics, from the uncapped importance weight [batch, tokens].

    ``truncated_fraction`` is the share of ``weight`` over ``cap`` (0 with no cap);
    ``ratio_mean`` defaults to the weight's mean, for a loss whose ratio is the weight.
    """
    weight = weight.detach()
    over = torch.zeros_like(weight) if cap is None else (weight > cap).float()
    weight_mean = masked_mean(weight, mask)
    return PolicyLoss(
        loss=loss,
        clip_fraction=clip_fraction,
        ratio_mean=weight_mean if ratio_mean is None else ratio_mean,
        weight_mean=weight_mean,
        weight_max=masked_max(weight, mask),
        truncated_fraction=masked_mean(over, mask),
    )


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token min(r A, clip(r, 1-low, 1+high) A) and whether the clipped branch won.
    ``high`` None: ``low`` both ways; a larger ``high`` is DAPO's clip-higher (arXiv
    2503.14476 §3.1), which leaves low-probability tokens room to grow."""
    unclipped = ratio * advantages
    bounded = torch.clamp(ratio, 1.0 - low, 1.0 + (low if high is None else high))
    surrogate = torch.minimum(unclipped, bounded * advantages)
    return surrogate, (unclipped != surrogate).float()


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """PPO's clipped surrogate, averaged over all response tokens of the batch.

    Schulman et al., "Proximal Policy Optimization Algorithms", arXiv 1707.06347, eq. 7:
    L = -E_t[min(r_t A_t, clip(r_t, 1-eps, 1+eps) A_t)], r_t = pi(a_t) / pi_old(a_t).
    ``logprobs``, ``old_logprobs``, ``mask`` are [batch, tokens]; ``advantages`` is [batch]
    (one per sequence, as GRPO gives) or [batch, tokens].
    Token-level averaging (every token weighs the same, as in DAPO, arXiv 2503.14476 §3.3)
    keeps long answers from being diluted; ``weights`` ([batch, tokens], ``loss_weights``)
    replace that mean with another aggregation. ``clip_eps_high``: the upper clip bound, when
    it differs from the lower (clip-higher).

    The ratio r_t is also the importance weight against ``old_logprobs`` (the behaviour policy
    when the trainer passes vLLM's log-probs), so ``weight_*`` report r_t's statistics; with
    no cap, ``truncated_fraction`` is 0.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate, was_clipped = _clipped_surrogate(
        ratio, _per_token(advantages, logprobs), clip_eps, clip_eps_high
    )
    clip_fraction = masked_mean(was_clipped, mask).detach()
    return _with_stats(_reduce(surrogate, mask, weights), clip_fraction, ratio, mask, cap=None)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    sequence_ids: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """GSPO: PPO's clipped surrogate with one ratio per sequence.

    Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071, eq. 5-7:
    s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t log(pi / pi_old)) over sequence i's
    loss tokens, L = -E_i[min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i)]. Written per token as
    GSPO-token (eq. 13-14): s_i,t = sg[s_i] pi(y_t) / sg[pi(y_t)], whose value is s_i and
    whose gradient, token-averaged within each sequence, is GSPO's: with
    ``seq_mean_token_mean`` ``weights`` this is exactly GSPO (the paper's clip range is
    3e-4 / 4e-4, not PPO's 0.2). A whole sequence is clipped or not. ``sequence_ids``
    ([batch, tokens]) names each token's sequence (packed rows hold several).
    """
    log_ratio = (logprobs - old_logprobs) * mask
    length = sequence_lengths(mask, sequence_ids)
    sequence_log_ratio = sequence_sums(log_ratio, mask, sequence_ids) / length
    ratio = torch.exp(sequence_log_ratio.detach() + logprobs - logprobs.detach())
    surrogate, was_clipped = _clipped_surrogate(
        ratio, _per_token(advantages, logprobs), clip_eps, clip_eps_high
    )
    clip_fraction = masked_mean(was_clipped, mask).detach()
    return _with_stats(_reduce(surrogate, mask, weights), clip_fraction, ratio, mask, cap=None)


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    weight_cap: float | None,
    clip_eps_high: float | None = None,
    weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """Decoupled PPO: clip against a proximal policy, importance-weight against the behaviour one.

    Hilton, Cobbe, Schulman, "Batch size-invariance for policy optimization", arXiv 2110.00641
    (the proximal policy), as AReaL uses it for asynchronous RL (Fu et al., arXiv 2505.24298,
    eq. 5): L = -E_t[w_t min(r_t A_t, clip(r_t, 1-eps, 1+eps) A_t)], with
    r_t = pi_theta / pi_prox and w_t = pi_prox / pi_behav held constant (no gradient).
    All tensors are [batch, tokens] except ``advantages``, [batch] or [batch, tokens].
    ``proximal_logprobs`` come from the trainer's policy before this update (no grad).

    ``weight_cap`` truncates w_t at the cap (None: no cap). AReaL's ``behav_imp_weight_cap``
    instead drops tokens whose weight exceeds it; truncation keeps their signal, bounded.
    ``weight_*`` describe w_t before the cap; ``ratio_mean`` and ``clip_fraction`` describe r_t.
    ``clip_eps_high`` and ``weights`` as in ``ppo_clip_loss``.
    """
    ratio = torch.exp(logprobs - proximal_logprobs)
    raw_weight = torch.exp(proximal_logprobs - behaviour_logprobs).detach()
    weight = raw_weight if weight_cap is None else raw_weight.clamp(max=weight_cap)
    surrogate, was_clipped = _clipped_surrogate(
        ratio, _per_token(advantages, logprobs), clip_eps, clip_eps_high
    )
    return _with_stats(
        _reduce(weight * surrogate, mask, weights),
        masked_mean(was_clipped, mask).detach(),
        raw_weight,
        mask,
        weight_cap,
        ratio_mean=masked_mean(ratio, mask).detach(),
    )


def tis_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """Policy gradient with truncated importance sampling against the behaviour policy.

    Espeholt et al., "IMPALA", arXiv 1802.01561, §4.1 (the truncated rho of V-trace's policy
    gradient): L = -E_t[sg(min(rho_t, cap)) log pi_theta(a_t) A_t], rho_t = pi_theta / pi_behav,
    so the gradient is -E_t[min(rho_t, cap) A_t grad log pi_theta(a_t)].
    All tensors are [batch, tokens] except ``advantages``, [batch] or [batch, tokens].
    The loss value itself carries no meaning (it scales with log pi); only its gradient does.
    No clipping: ``clip_fraction`` is 0, ``ratio_mean`` equals ``weight_mean`` (rho before the
    cap), and ``truncated_fraction`` is the share of tokens with rho_t > cap. ``weights`` as
    in ``ppo_clip_loss``.
    """
    rho = torch.exp(logprobs - behaviour_logprobs).detach()
    weight = rho.clamp(max=cap)
    loss = _reduce(weight * logprobs * _per_token(advantages, logprobs), mask, weights)
    return _with_stats(loss, loss.new_zeros(()).detach(), rho, mask, cap)


def logprob_mismatch(
    proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Mean |log pi_prox - log pi_behav| per response token; all inputs [batch, tokens].

    How far the trainer's log-probs of the sampled tokens sit from those the generator
    recorded: staleness plus any numerical mismatch between the two engines.
    """
    return masked_mean((proximal_logprobs - behaviour_logprobs).abs(), mask).detach()


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    is_cap: float,
    clip_eps_high: float | None = None,
    weights: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
) -> PolicyLoss:
    """The policy loss called ``name`` (one of ``LOSS_NAMES``), so a trainer need not know which.

    ppo: ``ppo_clip_loss`` with the ratio against the behaviour policy. decoupled_ppo:
    ``decoupled_ppo_loss`` with the behaviour weight capped at ``is_cap``. tis: ``tis_loss``
    truncated at ``is_cap``. gspo: ``gspo_loss`` against the behaviour policy (needs
    ``sequence_ids``). ``clip_eps_high``, ``weights``: as in ``ppo_clip_loss``. Shapes as in
    those functions.
    """
    if name == "ppo":
        return ppo_clip_loss(
            logprobs, behaviour_logprobs, advantages, mask, clip_eps, clip_eps_high, weights
        )
    if name == "decoupled_ppo":
        return decoupled_ppo_loss(
            logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask, clip_eps, is_cap,
            clip_eps_high, weights,
        )  # fmt: skip
    if name == "tis":
        return tis_loss(logprobs, behaviour_logprobs, advantages, mask, is_cap, weights)
    if name == "gspo":
        if sequence_ids is None:
            raise ValueError("the gspo loss needs each token's sequence (sequence_ids)")
        return gspo_loss(
            logprobs, behaviour_logprobs, advantages, mask, sequence_ids, clip_eps,
            clip_eps_high, weights,
        )  # fmt: skip
    raise ValueError(f"unknown policy loss {name!r}; allowed: {', '.join(LOSS_NAMES)}")


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO's clipped value loss, all [batch, tokens]: 0.5 max((V - R)^2, (V_clip - R)^2),
    V_clip = V_old + clip(V - V_old, -clip, clip) (Schulman et al., arXiv 1707.06347, as
    OpenAI's baselines ppo2 writes it), averaged over ``mask`` or weighted by ``weights``
    (``loss_weights``)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return -_reduce(per_token, mask, weights)


KlEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimates of KL(pi || ref) from tokens sampled from pi, [batch, tokens] in
    and out, differentiable in ``logprobs``; d = log pi - log ref. Schulman, "Approximating
    KL Divergence" (http://joschu.net/blog/kl-approx.html): k1 = d (unbiased, high
    variance, can be negative); k2 = d^2 / 2 (biased, low variance); k3 = e^-d + d - 1
    (unbiased, non-negative, low variance: verl's ``low_var_kl``)."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {', '.join(KL_ESTIMATORS)}")


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) from samples of pi: E[e^d - d - 1], d = ref - pi.

    Non-negative for every sample and unbiased (http://joschu.net/blog/kl-approx.html).
    """
    delta = ref_logprobs - logprobs
    return masked_mean(torch.exp(delta) - delta - 1.0, mask)


def token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target id and the entropy (nats) of each distribution
    softmax(logits / temperature): logits [..., vocab] (any dtype; computed in float32),
    targets [...]."""
    logits = logits.float()
    logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return chosen, -(logp.exp() * logp).sum(dim=-1)


def chunked_token_stats(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    entropy_grad: bool,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_stats`` of ``head(hidden)``, [tokens, hidden] -> [tokens] each, holding the
    vocabulary logits of at most ``chunk`` tokens at a time, in the backward pass too.

    With gradients on and more than one chunk, each chunk runs under activation
    checkpointing: the forward keeps only its input (``chunk x hidden``), and the backward
    recomputes that chunk's logits, so a micro-batch's peak holds one chunk's ``chunk x
    vocab`` float32 tensors whatever its length. Tokens that fit in one chunk keep its
    logits for the backward instead: the same one chunk, without the recompute (a second
    head matmul, a third more of a step at 151,936 words and two layers: make bench-vocab).
    The values and gradients are ``token_stats``' of the whole logits. ``entropy_grad``
    False: the entropy is a metric only, detached from the graph.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 token, got {chunk}")

    def stats(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_stats(head(h), t, temperature)

    starts = range(0, max(int(hidden.shape[0]), 1), chunk)
    recompute = torch.is_grad_enabled() and hidden.requires_grad and len(starts) > 1
    logprobs, entropies = [], []
    for start in starts:
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if recompute:
            lp, ent = checkpoint(stats, h, t, use_reentrant=False)
        else:
            lp, ent = stats(h, t)
        logprobs.append(lp)
        entropies.append(ent if entropy_grad else ent.detach())
    return torch.cat(logprobs), torch.cat(entropies)
