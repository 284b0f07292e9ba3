"""Importance-ratio statistics and collapse detection (docs/design.md §3). Pure: no I/O, no state.

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
from moe_rl.metric_names import (
    KL_K3, RATIO_ESS, RATIO_EXTREME_FRAC, RATIO_SEQ_VAR, RATIO_TOKEN_MAX, RATIO_TOKEN_VAR, ROUTE_MARGIN_MEAN,
    ROUTE_MARGIN_P10,
)

RATIO_KEYS = (RATIO_TOKEN_VAR, RATIO_TOKEN_MAX, RATIO_SEQ_VAR, RATIO_ESS, RATIO_EXTREME_FRAC, KL_K3)


@torch.no_grad()
def ratio_stats(*, logp: Tensor, old_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Ratio statistics of docs/design.md §3 (keys in `RATIO_KEYS`), in float64; all NaN when no token is valid."""
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
        RATIO_TOKEN_VAR: r.var(correction=0),
        RATIO_TOKEN_MAX: r.max(),
        RATIO_SEQ_VAR: seq_ratio.var(correction=0),
        RATIO_ESS: r.sum() ** 2 / (d.numel() * (r**2).sum()),  # (sum r)^2 / (N sum r^2)
        RATIO_EXTREME_FRAC: (d.abs() > math.log(2.0)).double().mean(),
        KL_K3: (torch.exp(-d) - 1.0 + d).mean(),  # k3 = exp(-delta) - 1 + delta
    }
    return dict(zip(stats, torch.stack(list(stats.values())).tolist()))


def margin_stats(margins: Tensor, mask: Tensor) -> dict[str, float]:
    """`route/margin_mean` and `route/margin_p10` of (B, T, L) router margins at valid (B, T)."""
    values = margins[mask.to(margins.device)].float()  # (n, L)
    if not values.numel():
        return {}
    return {ROUTE_MARGIN_MEAN: values.mean().item(), ROUTE_MARGIN_P10: values.quantile(0.1).item()}
