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

The ratio split (`ratio_split_parts`): with the same weights and tokens scored under the router's own
routes (native) and under replayed routes, per token
    log r = [logp(native) - logp(replayed)] + [logp(replayed) - old_logp] = rho + w
a routing part rho and a weights part w; their variances, covariance and the routing share
(Var rho + Cov) / Var log r, and where the tokens with a changed route sit in the clipping and in
sum |log r|.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_rl.metrics.collapse import (  # noqa: F401 (re-exported)
    DEFINITIONS,
    TRIGGERS,
    CollapseEvent,
    CollapseJudgement,
    detect_collapse,
    judge_collapse,
)
from moe_rl.metrics.names import (
    CLIP_FLIPPED_SHARE,
    KL_K3,
    RATIO_ESS,
    RATIO_EXTREME_FRAC,
    RATIO_SEQ_VAR,
    RATIO_SPLIT_COV,
    RATIO_SPLIT_ENGINE_VAR,
    RATIO_SPLIT_FLIP_LOGP,
    RATIO_SPLIT_FLIPPED_MASS,
    RATIO_SPLIT_ROUTING_SHARE,
    RATIO_SPLIT_ROUTING_VAR,
    RATIO_SPLIT_WEIGHTS_VAR,
    RATIO_TOKEN_MAX,
    RATIO_TOKEN_VAR,
    ROLLOUT_K3_KL,
    ROLLOUT_LOGP_ABS_DIFF,
    ROLLOUT_LOGP_GAP,
    ROLLOUT_LOGP_GAP_OVER_LN2,
    ROLLOUT_LOGP_GAP_OVER_LN5,
    ROLLOUT_LOGP_SQ_DIFF,
    ROLLOUT_TOKEN_MULT_PROB_ERROR,
    ROUTE_MARGIN_MEAN,
    ROUTE_MARGIN_P10,
    SPLIT_KEYS,
    layer_key,
)
from moe_rl.metrics.partial import Partial

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


@torch.no_grad()
def ratio_split_tokens(
    *, native_logp: Tensor, replayed_logp: Tensor, old_logp: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """(rho, w), float64 (B, T), 0 off `mask`: the routing part logp(native) - logp(replayed) and the
    weights part logp(replayed) - old_logp of each token's log-ratio."""
    mask = mask.to(torch.bool)
    rho = torch.where(mask, native_logp.double() - replayed_logp.double(), 0.0)
    w = torch.where(mask, replayed_logp.double() - old_logp.double(), 0.0)
    return rho, w


@torch.no_grad()
def ratio_split_parts(
    *,
    native_logp: Tensor,
    replayed_logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    flipped: Tensor,
    clipped: Tensor,
) -> Partial:
    """What `ratio_split_finalize` needs from these rows, per valid token in row-major order: rho and w
    (`ratio_split_tokens`), and as 0/1 whether its route changed (`flipped`: (B, T) bool, in some MoE
    layer; or (B, T, L), per MoE layer, which also gives the per-layer shares) and whether the loss
    clipped it (`clipped`, (B, T) bool)."""
    for name, x in (("replayed_logp", replayed_logp), ("old_logp", old_logp), ("mask", mask), ("flipped", flipped)):
        if x.shape[:2] != native_logp.shape or x.dim() > (3 if name == "flipped" else 2):
            raise ValueError(f"{name} shape {tuple(x.shape)} != native_logp shape {tuple(native_logp.shape)}")
    rho, w = ratio_split_tokens(native_logp=native_logp, replayed_logp=replayed_logp, old_logp=old_logp, mask=mask)
    mask = mask.to(torch.bool)
    flipped = flipped.to(mask.device)[mask]  # (n,) or (n, L)
    rows = {"rho": rho[mask], "w": w[mask], "clipped": clipped.to(mask.device)[mask].double()}
    if flipped.dim() == 2:
        rows["flipped_layers"] = flipped.double()
        flipped = flipped.any(dim=-1)
    return Partial(rows={**rows, "flipped": flipped.double()})


def ratio_split_finalize(parts: Partial) -> dict[str, float]:
    """SPLIT_KEYS from the pooled `ratio_split_parts` (population moments, float64; NaN where undefined)."""
    rows = parts.rows
    rho, w, flipped, clipped = rows["rho"], rows["w"], rows["flipped"], rows["clipped"]
    if not rho.numel():
        return {k: math.nan for k in SPLIT_KEYS}
    d_rho, d_w = rho - rho.mean(), w - w.mean()
    var_rho, var_w, cov = (d_rho**2).mean(), (d_w**2).mean(), (d_rho * d_w).mean()
    total = (rho + w).var(correction=0)
    mass = (rho + w).abs()
    mass_total, n_clipped = mass.sum(), clipped.sum()
    has_mass, has_clipped = bool(mass_total > 0), bool(n_clipped > 0)
    nan = torch.tensor(math.nan, dtype=torch.float64)

    def shares(changed: Tensor) -> tuple[Tensor, Tensor]:
        """(share of sum |log r|, share of the clipped tokens) on the tokens flagged in `changed`."""
        return (
            (mass * changed).sum() / mass_total if has_mass else nan,
            (clipped * changed).sum() / n_clipped if has_clipped else nan,
        )

    stats = {
        RATIO_SPLIT_ROUTING_VAR: var_rho,
        RATIO_SPLIT_WEIGHTS_VAR: var_w,
        RATIO_SPLIT_COV: cov,
        RATIO_SPLIT_ROUTING_SHARE: (var_rho + cov) / total if total > 0 else nan,
    }
    stats[RATIO_SPLIT_FLIPPED_MASS], stats[CLIP_FLIPPED_SHARE] = shares(flipped)
    routes = _changed_routes(rows)
    stats[RATIO_SPLIT_FLIP_LOGP] = (rho.abs() * flipped).sum() / routes if routes > 0 else nan
    if "flipped_layers" in rows:  # the same two shares with "changed in MoE layer i"
        per_layer = rows["flipped_layers"]
        for i in range(per_layer.shape[1]):
            stats[layer_key(RATIO_SPLIT_FLIPPED_MASS, i)], stats[layer_key(CLIP_FLIPPED_SHARE, i)] = shares(
                per_layer[:, i]
            )
    return dict(zip(stats, torch.stack(list(stats.values())).tolist()))


def _changed_routes(rows: dict[str, Tensor]) -> Tensor:
    """The (token, MoE layer) routes that changed; where only "in some layer" was given, the tokens."""
    return (rows["flipped_layers"] if "flipped_layers" in rows else rows["flipped"]).sum()


# The shares pool over a step's updates by their denominators (`ratio_split_weights`), so an update
# without spread (update 1: rounding-level log-ratios) weighs nothing instead of a share of noise; the
# log-probability change per changed route pools by the changed routes.
SPLIT_SHARE_KEYS = (RATIO_SPLIT_ROUTING_SHARE, RATIO_SPLIT_FLIPPED_MASS, CLIP_FLIPPED_SHARE, RATIO_SPLIT_FLIP_LOGP)


def ratio_split_weights(parts: Partial) -> dict[str, float]:
    """The denominator of each share in SPLIT_SHARE_KEYS on the pooled rows: n Var(rho + w), sum |rho + w|,
    the clipped tokens and the changed routes; a step's share is the mean of its updates' shares weighted by these."""
    rows = parts.rows
    log_r = rows["rho"] + rows["w"]
    n = log_r.numel()
    values = [
        n * log_r.var(correction=0) if n else torch.tensor(0.0),
        log_r.abs().sum(),
        rows["clipped"].sum(),
        _changed_routes(rows),
    ]
    weights = dict(zip(SPLIT_SHARE_KEYS, torch.stack([v.double() for v in values]).tolist()))
    for i in range(rows["flipped_layers"].shape[1] if "flipped_layers" in rows else 0):  # per layer: the same
        for key in (RATIO_SPLIT_FLIPPED_MASS, CLIP_FLIPPED_SHARE):
            weights[layer_key(key, i)] = weights[key]
    return weights


def ratio_split(
    *,
    native_logp: Tensor,
    replayed_logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    flipped: Tensor,
    clipped: Tensor,
) -> dict[str, float]:
    """The ratio split of one process's rows (SPLIT_KEYS): `ratio_split_finalize(ratio_split_parts(...))`."""
    return ratio_split_finalize(
        ratio_split_parts(
            native_logp=native_logp,
            replayed_logp=replayed_logp,
            old_logp=old_logp,
            mask=mask,
            flipped=flipped,
            clipped=clipped,
        )
    )


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


GAP_KEYS = (
    ROLLOUT_LOGP_GAP,
    ROLLOUT_TOKEN_MULT_PROB_ERROR,
    ROLLOUT_LOGP_GAP_OVER_LN2,
    ROLLOUT_LOGP_GAP_OVER_LN5,
    ROLLOUT_K3_KL,
    ROLLOUT_LOGP_ABS_DIFF,
    ROLLOUT_LOGP_SQ_DIFF,
    RATIO_SPLIT_ENGINE_VAR,
)


@torch.no_grad()
def rollout_gap_stats(*, rollout_logp: Tensor, train_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Engine/trainer gap over response tokens (GAP_KEYS), with e = train_logp - rollout_logp and g = |e| per token:
        rollout/logp_gap               mean g (also as rollout/logp_abs_diff, AReaL's name)
        rollout/token_mult_prob_error  mean exp(g): 1 when the rollout policy is the trained one
        rollout/logp_gap_over_ln2      fraction of tokens with g > ln 2 (probabilities off by more than 2x)
        rollout/logp_gap_over_ln5      fraction of tokens with g > ln 5
        rollout/k3_kl                  mean exp(e) - 1 - e: k3 estimate of KL(rollout || train) on rollout samples
        rollout/logp_sq_diff           mean e^2
        ratio/split/engine_var         population variance of e, the engine part of the log-ratio
    `train_logp` is the old-policy pass (the pi_old of the ratio). Float64. With no valid token every
    mean is 0 (mult error 1) and the variance 0."""
    return rollout_gap_finalize(rollout_gap_parts(rollout_logp=rollout_logp, train_logp=train_logp, mask=mask))


@torch.no_grad()
def rollout_gap_parts(*, rollout_logp: Tensor, train_logp: Tensor, mask: Tensor) -> Partial:
    """e = train_logp - rollout_logp of each valid token, float64, in row-major order."""
    if rollout_logp.shape != train_logp.shape or mask.shape != rollout_logp.shape:
        raise ValueError(
            f"shapes differ: rollout_logp {tuple(rollout_logp.shape)}, train_logp {tuple(train_logp.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    valid = mask.to(torch.bool)
    return Partial(rows={"e": (train_logp.double() - rollout_logp.double())[valid]})


def rollout_gap_finalize(parts: Partial) -> dict[str, float]:
    """GAP_KEYS from the pooled `rollout_gap_parts`."""
    e = parts.rows["e"]
    if not e.numel():
        return {**{k: 0.0 for k in GAP_KEYS}, ROLLOUT_TOKEN_MULT_PROB_ERROR: 1.0}
    g = e.abs()
    stats = {
        ROLLOUT_LOGP_GAP: g.mean(),
        ROLLOUT_TOKEN_MULT_PROB_ERROR: g.exp().mean(),
        ROLLOUT_LOGP_GAP_OVER_LN2: (g > math.log(2.0)).double().mean(),
        ROLLOUT_LOGP_GAP_OVER_LN5: (g > math.log(5.0)).double().mean(),
        ROLLOUT_K3_KL: (e.exp() - 1.0 - e).mean(),
        ROLLOUT_LOGP_ABS_DIFF: g.mean(),
        ROLLOUT_LOGP_SQ_DIFF: (e**2).mean(),
        RATIO_SPLIT_ENGINE_VAR: e.var(correction=0),
    }
    return dict(zip(stats, torch.stack(list(stats.values())).tolist()))
