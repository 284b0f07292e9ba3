"""Importance-ratio statistics and collapse detection (DESIGN §3). Pure: no I/O, no state.

Ratio statistics, over valid response tokens, before clipping, with delta = logp - old_logp:
    ratio/token_var     population variance of the token ratio exp(delta)
    ratio/token_max     largest token ratio
    ratio/seq_var       population variance, across non-empty sequences, of the GSPO sequence
                        ratio exp(mean_t delta)
    ratio/ess           normalised effective sample size (sum r)^2 / (N sum r^2), in (0, 1]
    ratio/extreme_frac  fraction of valid tokens with |delta| > ln 2 (ratio outside [1/2, 2])
    kl/k3               mean(exp(-delta) - 1 + delta), the k3 estimate of the old/new policy gap
`ratio/clipfrac_low` and `ratio/clipfrac_high` depend on eps and advantages and come from the
losses in `moe_rl.algos`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_rl.collapse import DEFINITIONS, TRIGGERS, CollapseEvent, detect_collapse  # noqa: F401 (re-exported)

RATIO_KEYS = ("ratio/token_var", "ratio/token_max", "ratio/seq_var", "ratio/ess", "ratio/extreme_frac", "kl/k3")


@torch.no_grad()
def ratio_stats(*, logp: Tensor, old_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Ratio statistics of DESIGN §3 (keys in `RATIO_KEYS`), in float64; all NaN when no token is valid."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    for name, x in (("old_logp", old_logp), ("mask", mask)):
        if x.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} != logp shape {tuple(logp.shape)}")
    mask = mask.to(torch.bool)
    if not mask.any():
        return {k: math.nan for k in RATIO_KEYS}
    delta = torch.where(mask, logp.double() - old_logp.double(), 0.0)  # (B, T)
    d = delta[mask]  # (N,) valid tokens
    r = torch.exp(d)
    seq_len = mask.sum(dim=-1)  # (B,)
    nonempty = seq_len > 0
    seq_ratio = torch.exp(delta.sum(dim=-1)[nonempty] / seq_len[nonempty])  # s_i = exp(mean_t delta)
    stats = {
        "ratio/token_var": r.var(correction=0),
        "ratio/token_max": r.max(),
        "ratio/seq_var": seq_ratio.var(correction=0),
        "ratio/ess": r.sum() ** 2 / (d.numel() * (r**2).sum()),  # (sum r)^2 / (N sum r^2)
        "ratio/extreme_frac": (d.abs() > math.log(2.0)).double().mean(),
        "kl/k3": (torch.exp(-d) - 1.0 + d).mean(),  # k3 = exp(-delta) - 1 + delta
    }
    return dict(zip(stats, torch.stack(list(stats.values())).tolist()))


def margin_stats(margins: Tensor, mask: Tensor) -> dict[str, float]:
    """`route/margin_mean` and `route/margin_p10` of (B, T, L) router margins at valid (B, T)."""
    values = margins[mask.to(margins.device)].float()  # (n, L)
    if not values.numel():
        return {}
    return {"route/margin_mean": values.mean().item(), "route/margin_p10": values.quantile(0.1).item()}


@torch.no_grad()
def rollout_gap_stats(*, rollout_logp: Tensor, train_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Engine/trainer gap over response tokens, with g = |rollout_logp - train_logp| per token:
        rollout/logp_gap               mean g
        rollout/token_mult_prob_error  mean exp(g): 1 when the rollout policy is the trained one
        rollout/logp_gap_over_ln2      fraction of tokens with g > ln 2 (probabilities off by more than 2x)
    `train_logp` is the old-policy pass (the pi_old of the ratio). 0, 1 and 0 when no token is valid."""
    gap = (rollout_logp.double() - train_logp.double()).abs()
    valid = mask.bool()
    n = max(int(valid.sum()), 1)
    return {
        "rollout/logp_gap": float((gap * valid).sum()) / n,
        "rollout/token_mult_prob_error": float((gap.exp() * valid).sum() + (n - int(valid.sum()))) / n,
        "rollout/logp_gap_over_ln2": float(((gap > math.log(2)) & valid).sum()) / n,
    }
