"""Policy-gradient losses and the diagnostics logged beside them.

All functions take per-token tensors shaped [batch, tokens] with a 0/1 ``mask`` that marks
the response tokens a loss applies to; padding and prompt tokens carry mask 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PolicyLoss:
    """The scalar to minimise plus the statistics a person wants to see per step."""

    loss: torch.Tensor
    clip_fraction: torch.Tensor
    ratio_mean: torch.Tensor


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    total = mask.sum()
    return (values * mask).sum() / total.clamp(min=1.0)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> PolicyLoss:
    """PPO's clipped surrogate, averaged over all response tokens of the batch.

    Schulman et al., "Proximal Policy Optimization Algorithms", arXiv 1707.06347, eq. 7:
    L = -E_t[min(r_t A_t, clip(r_t, 1-eps, 1+eps) A_t)], r_t = pi(a_t) / pi_old(a_t).
    ``advantages`` is [batch] (one per sequence, as GRPO gives) or [batch, tokens].
    Token-level averaging (every token weighs the same, as in DAPO, arXiv 2503.14476 §3.3)
    keeps long answers from being diluted.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = -masked_mean(torch.minimum(unclipped, clipped), mask)
    was_clipped = (unclipped != torch.minimum(unclipped, clipped)).float()
    return PolicyLoss(
        loss=loss,
        clip_fraction=masked_mean(was_clipped, mask).detach(),
        ratio_mean=masked_mean(ratio, mask).detach(),
    )


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) from samples of pi: E[e^d - d - 1], d = ref - pi.

    Non-negative for every sample and unbiased (http://joschu.net/blog/kl-approx.html).
    """
    delta = ref_logprobs - logprobs
    return masked_mean(torch.exp(delta) - delta - 1.0, mask)


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean per-token entropy (nats) of the distributions ``logits`` [batch, tokens, vocab]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return masked_mean(entropy, mask)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probability of each target id: logits [batch, tokens, vocab], targets [batch, tokens]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
