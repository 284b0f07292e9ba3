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
    KL_K3,
    RATIO_ESS,
    RATIO_EXTREME_FRAC,
    RATIO_SEQ_VAR,
    RATIO_TOKEN_MAX,
    RATIO_TOKEN_VAR,
    ROLLOUT_LOGP_GAP,
    ROLLOUT_LOGP_GAP_OVER_LN2,
    ROLLOUT_TOKEN_MULT_PROB_ERROR,
    ROUTE_MARGIN_MEAN,
    ROUTE_MARGIN_P10,
)
from moe_rl.partial import Partial

RATIO_KEYS = (RATIO_TOKEN_VAR, RATIO_TOKEN_MAX, RATIO_SEQ_VAR, RATIO_ESS, RATIO_EXTREME_FRAC, KL_K3)


@torch.no_grad()
def ratio_stats(*, logp: Tensor, old_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Ratio statistics of docs/design.md §3 (keys in `RATIO_KEYS`), in float64; all NaN when no token is valid."""
    return ratio_finalize(ratio_parts(logp=logp, old_logp=old_logp, mask=mask))


@torch.no_grad()
def ratio_parts(*, logp: Tensor, old_logp: Tensor, mask: Tensor) -> Partial:
    """What `ratio_finalize` needs from these rows: delta of each valid token and the mean delta of each
    non-empty sequence (the log of its GSPO ratio), float64, in row-major order."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    for name, x in (("old_logp", old_logp), ("mask", mask)):
        if x.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} != logp shape {tuple(logp.shape)}")
    mask = mask.to(torch.bool)
    delta = torch.where(mask, logp.double() - old_logp.double(), 0.0)  # (B, T)
    seq_len = mask.sum(dim=-1)  # (B,)
    nonempty = seq_len > 0
    return Partial(rows={"delta": delta[mask], "seq_delta": delta.sum(dim=-1)[nonempty] / seq_len[nonempty]})


def ratio_finalize(parts: Partial) -> dict[str, float]:
    """RATIO_KEYS from the pooled `ratio_parts` of all rows."""
    d = parts.rows["delta"]  # (N,) valid tokens
    if not d.numel():
        return {k: math.nan for k in RATIO_KEYS}
    r = torch.exp(d)
    seq_ratio = torch.exp(parts.rows["seq_delta"])  # s_i = exp(mean_t delta)
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
    return margin_finalize(margin_parts(margins, mask))


def margin_parts(margins: Tensor, mask: Tensor) -> Partial:
    """The (n, L) float32 margins of the valid positions, in row-major order."""
    return Partial(rows={"margins": margins[mask.to(margins.device)].float()})


def margin_finalize(parts: Partial) -> dict[str, float]:
    """`route/margin_mean` and `route/margin_p10` of the pooled margins ({} when there is none)."""
    values = parts.rows["margins"]
    if not values.numel():
        return {}
    return {ROUTE_MARGIN_MEAN: values.mean().item(), ROUTE_MARGIN_P10: values.quantile(0.1).item()}


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
        ROLLOUT_LOGP_GAP: float((gap * valid).sum()) / n,
        ROLLOUT_TOKEN_MULT_PROB_ERROR: float((gap.exp() * valid).sum() + (n - int(valid.sum()))) / n,
        ROLLOUT_LOGP_GAP_OVER_LN2: float(((gap > math.log(2)) & valid).sum()) / n,
    }
