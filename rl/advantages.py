"""Group-relative advantages (GRPO).

Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models", arXiv 2402.03300, §4.1.2: each of the n samples of one prompt is scored against
the other samples of the same prompt, A_i = (r_i - mean(r)) / (std(r) + eps).
"""

from __future__ import annotations

import torch

# Keeps a group whose rewards are all equal (std 0) at advantage 0 instead of 0/0.
STD_EPS = 1e-6


def group_advantages(
    rewards: torch.Tensor, scale_by_std: bool = True, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Advantages for rewards shaped [groups, n] (n samples per prompt), same shape out.

    With ``scale_by_std=False`` the advantage is only centred (Liu et al., "Understanding
    R1-Zero-Like Training", arXiv 2503.20783, "Dr. GRPO"), which avoids up-weighting prompts
    that are almost always right or always wrong. ``valid`` ([groups, n] bool): samples whose
    reward failed are left out of their group's mean and std and get advantage 0, so a
    failed reward teaches nothing rather than "this answer scored 0".
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    weight = valid.to(rewards.dtype)
    count = weight.sum(dim=1, keepdim=True).clamp(min=1.0)
    mean = (rewards * weight).sum(dim=1, keepdim=True) / count
    centred = (rewards - mean) * weight
    if not scale_by_std:
        return centred
    # Population std (over the group's valid samples): a group of n is n samples, not a
    # sample of them.
    std = ((centred**2).sum(dim=1, keepdim=True) / count).sqrt()
    return centred / (std + STD_EPS)
