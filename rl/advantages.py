"""Advantages from a group's rewards, and the reward shaping that comes before them.

Each prompt is sampled n times; its group's rewards become one advantage per sample
(``Credit.advantages``, in the rollout worker as a group finishes). Estimators:

- GRPO: Shao et al., "DeepSeekMath", arXiv 2402.03300, §4.1.2:
  A_i = (r_i - mean(r)) / (std(r) + eps), or only centred (Dr. GRPO, arXiv 2503.20783).
- RLOO: Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for
  Learning from Human Feedback in LLMs", arXiv 2402.14740, eq. 5 (after Kool et al. 2019):
  A_i = r_i - mean_{j != i}(r_j), each sample against the others' mean.
- REINFORCE++: Hu, "REINFORCE++", arXiv 2501.03262, §3.3: no per-prompt baseline; the
  reward is normalised over the whole training batch's tokens (``whiten``, by the trainer).
  ``reinforce_pp_baseline`` first subtracts the group mean (§3.4, "REINFORCE++-baseline"),
  then normalises over the batch the same way.

Overlong shaping (DAPO: Yu et al., arXiv 2503.14476, §3.4, eq. 13) adds a soft penalty to
answers that reach the last ``buffer`` tokens before ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

# Keeps a group whose rewards are all equal (std 0) at advantage 0 instead of 0/0.
STD_EPS = 1e-6

Estimator = Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
# The estimators whose advantages the trainer normalises over its whole batch (``whiten``).
BATCH_NORMALISED = frozenset({"reinforce_pp", "reinforce_pp_baseline"})


def _check_groups(rewards: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}")
    return torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid


def group_advantages(
    rewards: torch.Tensor, scale_by_std: bool = True, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """GRPO's advantages for rewards shaped [groups, n] (n samples per prompt), same shape out.

    With ``scale_by_std=False`` the advantage is only centred (Liu et al., "Understanding
    R1-Zero-Like Training", arXiv 2503.20783, "Dr. GRPO"), which avoids up-weighting prompts
    that are almost always right or always wrong. ``valid`` ([groups, n] bool): samples whose
    reward failed are left out of their group's mean and std and get advantage 0, so a
    failed reward teaches nothing rather than "this answer scored 0".
    """
    weight = _check_groups(rewards, valid).to(rewards.dtype)
    count = weight.sum(dim=1, keepdim=True).clamp(min=1.0)
    mean = (rewards * weight).sum(dim=1, keepdim=True) / count
    centred = (rewards - mean) * weight
    if not scale_by_std:
        return centred
    # Population std (over the group's valid samples): a group of n is n samples, not a
    # sample of them.
    std = ((centred**2).sum(dim=1, keepdim=True) / count).sqrt()
    return centred / (std + STD_EPS)


def rloo_advantages(rewards: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO's leave-one-out advantages, [groups, n] -> [groups, n]:
    A_i = r_i - (sum_j r_j - r_i) / (k - 1) = k / (k - 1) (r_i - mean(r)) over a group's k
    valid samples. A failed sample, and every sample of a group with fewer than two valid
    ones (no other sample to compare with), gets 0."""
    weight = _check_groups(rewards, valid).to(rewards.dtype)
    count = weight.sum(dim=1, keepdim=True)
    total = (rewards * weight).sum(dim=1, keepdim=True)
    others = (total - rewards) / (count - 1.0).clamp(min=1.0)
    return torch.where(count > 1.0, (rewards - others) * weight, torch.zeros_like(rewards))


def whiten(values: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """REINFORCE++'s batch normalisation of one advantage per sample, [batch] -> [batch]:
    ``(A - mean) / (std + eps)`` with the mean and (population) std over every loss token of
    the batch, a sample weighing by its ``tokens``. A sample not ``valid`` (its reward
    failed) is left out of both and gets 0."""
    weight = tokens.to(torch.float64) * valid.to(torch.float64)
    total = weight.sum().clamp(min=1.0)
    mean = (values * weight).sum() / total
    std = (((values - mean) ** 2 * weight).sum() / total).sqrt()
    out = (values - mean) / (std + STD_EPS)
    return torch.where(weight > 0, out, torch.zeros_like(out)).to(values.dtype)


def overlong_penalty(
    lengths: torch.Tensor, max_tokens: int, buffer: int, scale: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13) of each length in tokens, same shape out:
    0 up to ``max_tokens - buffer``, then falling linearly to ``-scale`` at ``max_tokens``,
    and ``-scale`` beyond it. ``buffer`` 0: no penalty."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    if buffer > max_tokens:
        raise ValueError(f"the overlong buffer ({buffer}) exceeds max_tokens ({max_tokens})")
    free = max_tokens - buffer
    over = (lengths.to(torch.float32) - free).clamp(min=0.0, max=float(buffer))
    return -scale * over / buffer


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    sequence_ids: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each sequence's loss tokens, [batch, tokens]
    in and out: the advantages and the returns (advantage + value) the critic learns.

    Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation", arXiv 1506.02438, eq. 16: delta_t = r_t + gamma V_{t+1} - V_t,
    A_t = sum_l (gamma lam)^l delta_{t+l}. An outcome reward: ``rewards`` holds each
    sequence's reward (at every token, or one per row [batch]), credited at its last loss
    token; V after a sequence's last loss token is 0. Tokens ``mask`` leaves out (an
    environment's, padding) are stepped over: the next loss token follows the one before.
    ``sequence_ids`` names each token's sequence (``rl.batching.sequence_ids``).
    """
    per_token = rewards.unsqueeze(1).expand_as(values) if rewards.dim() == 1 else rewards
    rows, width = values.shape
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(rows)
    next_advantage = values.new_zeros(rows)
    seen = torch.zeros(rows, dtype=torch.bool, device=values.device)  # a later loss token
    for t in reversed(range(width)):
        if t + 1 < width:  # the next token starts another sequence: start afresh
            fresh = sequence_ids[:, t + 1] != sequence_ids[:, t]
            next_value = torch.where(fresh, 0.0, next_value)
            next_advantage = torch.where(fresh, 0.0, next_advantage)
            seen = seen & ~fresh
        here = mask[:, t].bool()
        reward = torch.where(here & ~seen, per_token[:, t], 0.0)
        delta = reward + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
        seen = seen | here
    return advantages, (advantages + values) * mask


@dataclass(frozen=True)
class Credit:
    """How the rewards of a finished group become its samples' advantages: the estimator
    (``ESTIMATORS``), GRPO's std scaling, and overlong shaping (``overlong_buffer`` tokens
    before ``max_new_tokens``; 0: none), from the ``train`` section of a run's config."""

    estimator: Estimator = "grpo"
    scale_by_std: bool = True
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    max_new_tokens: int = 0

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(
                f"unknown advantage estimator {self.estimator!r}; allowed: {', '.join(ESTIMATORS)}"
            )

    def shaping(self, lengths: Sequence[Sequence[int]]) -> torch.Tensor:
        """The overlong penalty of each sample from its length in tokens, [groups, n] (0
        everywhere without shaping)."""
        sizes = torch.tensor(lengths, dtype=torch.long)
        if self.overlong_buffer == 0:
            return torch.zeros(sizes.shape)
        return overlong_penalty(
            sizes, self.max_new_tokens, self.overlong_buffer, self.overlong_penalty
        )

    def advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Each sample's advantage, [groups, n], from (shaped) rewards and which of them are
        valid. The REINFORCE++ estimators give the worker's part; the trainer normalises
        them over its batch."""
        if self.estimator == "grpo":
            return group_advantages(rewards, self.scale_by_std, valid)
        if self.estimator == "rloo":
            return rloo_advantages(rewards, valid)
        if self.estimator == "reinforce_pp_baseline":
            return group_advantages(rewards, scale_by_std=False, valid=valid)
        return torch.where(valid, rewards, torch.zeros_like(rewards))  # reinforce_pp
