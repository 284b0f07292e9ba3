"""Engine-gap corrections: truncated or masked importance weights between the rollout (behaviour)
policy and the trainer's old policy, as pure functions of tensors.

The rollout policy that sampled a batch (the vLLM engine, or the harness's own sampler in
`rollout.dtype`) is not bitwise the trainer's old policy, so the samples are slightly off-policy
before any update. With the behaviour/trainer ratio per valid completion token

    rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_logp_t - rollout_logp_t)

(sequence level: rho_i = exp(sum_t (old_logp_t - rollout_logp_t)), the product of the token ratios,
shared by the sequence's tokens), each correction gives a constant weight w that multiplies the
token's policy term (`weight` of `moe_rl.algos.losses`):
- `tis` (truncated IS, verl `rollout_corr` / TRL `vllm_importance_sampling_mode=*_truncate`):
  w = min(rho, cap), cap 2 (the default of TRL and ms-swift's `rollout_importance_sampling_threshold`);
- `mis` (masked IS, `*_mask`): w = rho where rho <= cap, else 0 (the token or sequence is dropped);
- `icepop` (IcePop, arXiv 2510.18855): w = rho where low <= rho <= high, else 0, with the paper's
  band [0.5, 5]: tokens whose engine and trainer probabilities disagree by more than that are masked,
  the rest are calibrated by rho.
Masked tokens stay in the loss's denominator (their term is 0), as in IcePop's objective.
Without an engine the rollout policy is the trainer's own sampler: at `rollout.dtype=float32` rho is
1 up to rounding and every correction is (almost) the identity; at bfloat16 it corrects the
precision gap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

LEVELS = ("token", "sequence")


class EngineWeight(NamedTuple):
    """The correction of one batch: `weight` (B, T), and which valid tokens were truncated or masked."""

    weight: Tensor
    truncated: Tensor  # (B, T) bool
    masked: Tensor  # (B, T) bool


def _tis(rho: Tensor, cap: float, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    over = rho > cap
    return torch.clamp(rho, max=cap), over, torch.zeros_like(over)


def _mis(rho: Tensor, cap: float, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    over = rho > cap
    return torch.where(over, torch.zeros_like(rho), rho), torch.zeros_like(over), over


def _icepop(rho: Tensor, cap: float, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    outside = (rho < low) | (rho > high)
    return torch.where(outside, torch.zeros_like(rho), rho), torch.zeros_like(outside), outside


CORRECTIONS: dict[str, Callable[[Tensor, float, float, float], tuple[Tensor, Tensor, Tensor]]] = {
    "tis": _tis,
    "mis": _mis,
    "icepop": _icepop,
}


def engine_weight(
    *,
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    correction: str,
    level: str = "token",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 5.0,
) -> EngineWeight:
    """The constant per-token weight of `correction` (one of `CORRECTIONS`) at `level` (token or
    sequence) from the old and rollout log-probs (B, T) on the valid tokens `mask`; 0 at masked
    positions, whatever the log-probs hold there."""
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown correction {correction!r}; valid: {', '.join(CORRECTIONS)}")
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; valid: {', '.join(LEVELS)}")
    mask = mask.to(torch.bool)
    log_rho = torch.where(mask, old_logp.detach().double() - rollout_logp.detach().double(), 0.0)  # (B, T)
    if level == "sequence":
        log_rho = log_rho.sum(dim=-1, keepdim=True).expand_as(log_rho)  # log prod_t rho_t, per sequence
    weight, truncated, masked = CORRECTIONS[correction](torch.exp(log_rho), cap, low, high)
    zero = torch.zeros_like(weight)
    return EngineWeight(torch.where(mask, weight, zero).to(old_logp.dtype), truncated & mask, masked & mask)
