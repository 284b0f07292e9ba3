"""Group-normalised advantages of GRPO (DeepSeekMath, arXiv 2402.03300), shared by GRPO and GSPO."""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, *, group_size: int, eps: float = 1e-6) -> Tensor:
    """Per-response advantage A_i = (R_i - mean_group R) / (std_group R + eps), shape (P*G,).

    `rewards` is (P*G,), group-contiguous: rows p*G .. p*G+G-1 are the G responses to prompt p.
    std is the *population* std (unbiased=False, divide by G), so every non-degenerate group
    has advantages with mean 0 and std ~1 regardless of G. (TRL's GRPOTrainer uses the unbiased
    std instead; its advantages are ours times sqrt((G-1)/G).) A group whose rewards are all
    equal carries no signal and gets exactly zero advantages, even where floating-point
    rounding would leave a tiny non-zero mean residual.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (P*G,), got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to normalise within a group, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"len(rewards)={rewards.numel()} is not divisible by group_size={group_size}")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    r = rewards.detach().to(dtype).view(-1, group_size)  # (P, G)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    adv = (r - mean) / (std + eps)  # A_i = (R_i - mean) / (std + eps)
    degenerate = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return torch.where(degenerate, torch.zeros_like(adv), adv).view(-1)
