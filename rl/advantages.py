"""Group-relative advantages (GRPO).

Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models", arXiv 2402.03300, §4.1.2: each of the n samples of one prompt is scored against
the other samples of the same prompt, A_i = (r_i - mean(r)) / (std(r) + eps).
"""

from __future__ import annotations

import torch

# Keeps a group whose rewards are all equal (std 0) at advantage 0 instead of 0/0.
STD_EPS = 1e-6


def group_advantages(rewards: torch.Tensor, scale_by_std: bool = True) -> torch.Tensor:
    """Advantages for rewards shaped [groups, n] (n samples per prompt), same shape out.

    With ``scale_by_std=False`` the advantage is only centred (Liu et al., "Understanding
    R1-Zero-Like Training", arXiv 2503.20783, "Dr. GRPO"), which avoids up-weighting prompts
    that are almost always right or always wrong.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    # Population std (unbiased=False): a group of n equals n samples, not a sample of them.
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return centred / (std + STD_EPS)
