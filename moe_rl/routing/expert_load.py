"""Expert load and router statistics: every MoE practitioner's first plot, from routes and router logits.

Pure functions of `Routes` and tensors (no hooks, no config); the loop decides when to call them.

- load of layer l: the share of the (valid token, slot) assignments that went to each expert,
  `p_l(e) = #{(t, j): S(t, l)_j = e} / (k * #valid t)`;
- `route/load/entropy`: `H(p_l) / log E` (1 = balanced, 0 = one expert takes everything);
- `route/load/max_share`: `max_e p_l(e)` (1/E when balanced);
- `route/load/dead_frac`: share of experts with `p_l(e) < 1 / (10 E)` (a tenth of their balanced share);
- `route/load/shift`: total-variation distance `1/2 sum_e |p_a(e) - p_b(e)|` between two passes' loads
  (the rollout's routes and the update's);
- `route/router/logit_rms`: root mean square of the router logits over valid tokens and experts;
- `route/router/z`: ST-MoE's z statistic (arXiv 2202.08906), mean over valid tokens of `logsumexp(logits)^2`;
- `optim/router_drift`: each router's relative distance from its cold-start weights;
- `optim/expert_step/*`: how far the optimizer moved each expert against the tokens it received (AdamW
  normalises each parameter's step, so an expert that saw few tokens may take a full-size step).
Each is per MoE layer (`.../layer_{i}`, but the expert steps) and the mean over layers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_rl.metrics.names import (
    OPTIM_EXPERT_STEP_LOW_OVER_HIGH,
    OPTIM_EXPERT_STEP_RMS,
    OPTIM_ROUTER_DRIFT,
    ROUTE_LOAD_DEAD_FRAC,
    ROUTE_LOAD_ENTROPY,
    ROUTE_LOAD_MAX_SHARE,
    ROUTE_LOAD_SHIFT,
    ROUTE_ROUTER_LOGIT_RMS,
    ROUTE_ROUTER_Z,
    layer_key,
)
from moe_rl.metrics.partial import Partial
from moe_rl.routing.routes import Routes

INSTRUMENTS = "instruments"  # the loop's Partial family of these sums
EXPERT_STEP = "expert_step"  # the loop's Partial family of the expert steps
DEAD_SHARE = 0.1  # an expert is dead below this fraction of its balanced share 1/E


def expert_load(routes: Routes) -> Tensor:
    """(L, E) float64 share of each layer's valid (token, slot) assignments that each expert received."""
    B, T, L, k = routes.indices.shape
    ids = routes.indices[routes.mask].long()  # (n, L, k)
    counts = torch.zeros(L, routes.num_experts, dtype=torch.float64)
    if ids.numel():
        layer = torch.arange(L).view(1, L, 1).expand_as(ids)
        counts.index_put_(
            (layer.reshape(-1), ids.reshape(-1)), torch.ones(ids.numel(), dtype=torch.float64), accumulate=True
        )
    return counts / counts.sum(-1, keepdim=True).clamp(min=1)


def _per_layer(name: str, values: Tensor) -> dict[str, float]:
    out = {layer_key(name, i): float(v) for i, v in enumerate(values.tolist())}
    out[name] = float(values.mean())
    return out


def load_metrics(routes: Routes) -> dict[str, float]:
    """`route/load/entropy`, `max_share` and `dead_frac`, per layer and their mean over layers."""
    p = expert_load(routes)
    E = routes.num_experts
    plogp = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
    entropy = -plogp.sum(-1) / math.log(E) if E > 1 else torch.ones(p.shape[0], dtype=torch.float64)
    return {
        **_per_layer(ROUTE_LOAD_ENTROPY, entropy),
        **_per_layer(ROUTE_LOAD_MAX_SHARE, p.max(-1).values),
        **_per_layer(ROUTE_LOAD_DEAD_FRAC, (p < DEAD_SHARE / E).double().mean(-1)),
    }


def load_shift(a: Routes, b: Routes) -> dict[str, float]:
    """`route/load/shift`: total-variation distance between the loads of two passes, per layer and mean."""
    return _per_layer(ROUTE_LOAD_SHIFT, 0.5 * (expert_load(a) - expert_load(b)).abs().sum(-1))


def router_logit_metrics(logits: Tensor, mask: Tensor) -> dict[str, float]:
    """`route/router/logit_rms` and `route/router/z` from router logits (B, T, L, E) over the valid
    positions `mask` (B, T), per layer and mean."""
    x = logits[mask].double()  # (n, L, E)
    if not x.numel():
        return {}
    rms = x.pow(2).mean(dim=(0, 2)).sqrt()
    z = torch.logsumexp(x, dim=-1).pow(2).mean(0)
    return {**_per_layer(ROUTE_ROUTER_LOGIT_RMS, rms), **_per_layer(ROUTE_ROUTER_Z, z)}


def router_drift(weights: list[Tensor], start: list[Tensor]) -> dict[str, float]:
    """`optim/router_drift`: `||W_l - W_l(0)||_F / ||W_l(0)||_F` per router, and the mean over layers."""
    drift = torch.tensor(
        [
            float((w.double() - w0.double()).norm() / w0.double().norm().clamp(min=1e-30))
            for w, w0 in zip(weights, start)
        ],
        dtype=torch.float64,
    )
    return _per_layer(OPTIM_ROUTER_DRIFT, drift)


def expert_step_rms(before: list[Tensor], after: list[Tensor]) -> Tensor:
    """(L, E): the RMS of each expert's step, from its weights before and after (`models.knobs.expert_weights`:
    per MoE layer, one row per expert)."""
    return torch.stack([(a.double() - b.double()).pow(2).mean(1).sqrt() for b, a in zip(before, after)]).cpu()


def expert_step_metrics(rms: Tensor, tokens: Tensor) -> dict[str, float]:
    """How far the optimizer moved each expert against the tokens routed to it.

    `rms` (L, E): each expert's step RMS (`expert_step_rms`); `tokens` (L, E): the (token, slot) assignments
    each expert received. Logs the mean step RMS, and the mean step RMS of the experts below their layer's
    median token count over that of the rest."""
    median = torch.quantile(tokens.double(), 0.5, dim=-1, keepdim=True)
    low, high = tokens.double() < median, tokens.double() >= median
    ratio = rms[low].mean() / rms[high].mean() if low.any() and rms[high].mean() > 0 else torch.tensor(math.nan)
    return {OPTIM_EXPERT_STEP_RMS: float(rms.mean()), OPTIM_EXPERT_STEP_LOW_OVER_HIGH: float(ratio)}


# --- the loop's form: partial sums pooled over processes, then the metrics -------------------------------


def expert_counts(routes: Routes) -> Tensor:
    """(L, E) float64 (token, slot) assignments per expert over the valid positions."""
    ids = routes.indices[routes.mask].long()  # (n, L, k)
    L = routes.indices.shape[2]
    counts = torch.zeros(L, routes.num_experts, dtype=torch.float64)
    if ids.numel():
        layer = torch.arange(L).view(1, L, 1).expand_as(ids).reshape(-1)
        counts.index_put_((layer, ids.reshape(-1)), torch.ones(ids.numel(), dtype=torch.float64), accumulate=True)
    return counts


def instrument_parts(native: Routes, router_logits: tuple[Tensor, ...] | None, rollout: Routes | None) -> Partial:
    """The old pass's instruments as sums a process adds to the others': expert counts of its native routes
    (and of the rollout's routes, when recorded, for `route/load/shift`), and the router logits' squares and
    squared logsumexp over the valid positions (`router_logits`: per MoE layer, (B*T, E) as transformers
    returns them)."""
    sums = {"counts": expert_counts(native)}
    if rollout is not None:
        sums["rollout_counts"] = expert_counts(rollout.with_mask(native.mask))
    if router_logits:
        B, T = native.mask.shape
        x = torch.stack([g.reshape(B, T, -1) for g in router_logits], dim=2)[native.mask].double()  # (n, L, E)
        sums["logit_sq"] = x.pow(2).sum(dim=(0, 2))
        sums["lse_sq"] = torch.logsumexp(x, dim=-1).pow(2).sum(0)
        sums["positions"] = torch.tensor([float(x.shape[0])], dtype=torch.float64)
        sums["cells"] = torch.tensor([float(x.shape[0] * x.shape[-1])], dtype=torch.float64)  # logits per layer
    return Partial(sums=sums)


def _shares(counts: Tensor) -> Tensor:
    return counts / counts.sum(-1, keepdim=True).clamp(min=1)


def instrument_finalize(parts: Partial) -> dict[str, float]:
    """The load and router metrics from pooled `instrument_parts` (every process's sums added)."""
    s = parts.sums
    if "counts" not in s:
        return {}
    p = _shares(s["counts"])
    E = p.shape[-1]
    plogp = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
    entropy = -plogp.sum(-1) / math.log(E) if E > 1 else torch.ones(p.shape[0], dtype=torch.float64)
    out = {
        **_per_layer(ROUTE_LOAD_ENTROPY, entropy),
        **_per_layer(ROUTE_LOAD_MAX_SHARE, p.max(-1).values),
        **_per_layer(ROUTE_LOAD_DEAD_FRAC, (p < DEAD_SHARE / E).double().mean(-1)),
    }
    if "rollout_counts" in s:
        out.update(_per_layer(ROUTE_LOAD_SHIFT, 0.5 * (_shares(s["rollout_counts"]) - p).abs().sum(-1)))
    if "positions" in s and float(s["positions"][0]) > 0:
        n = float(s["positions"][0])
        out.update(_per_layer(ROUTE_ROUTER_LOGIT_RMS, (s["logit_sq"] / float(s["cells"][0])).sqrt()))
        out.update(_per_layer(ROUTE_ROUTER_Z, s["lse_sq"] / n))
    return out


def expert_step_parts(rms: Tensor, routes: Routes, *, owner: bool) -> Partial:
    """The step's expert steps as sums a process adds to the others': the expert counts of its rows' `routes`
    (the routes the updates followed), and the step RMS from the one process that `owner`s it (the weights,
    and so their steps, are the same on every process)."""
    return Partial(sums={"rms": rms if owner else torch.zeros_like(rms), "tokens": expert_counts(routes)})


def expert_step_finalize(parts: Partial) -> dict[str, float]:
    """`optim/expert_step/*` from pooled `expert_step_parts`."""
    return expert_step_metrics(parts.sums["rms"], parts.sums["tokens"]) if "rms" in parts.sums else {}
