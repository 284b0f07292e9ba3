"""Route comparison metrics of docs/design.md §3, as pure functions of two `Routes`."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_rl.metrics.bins import MARGIN_EDGES, MOVE_EDGES
from moe_rl.metrics.names import route_key
from moe_rl.metrics.partial import Partial
from moe_rl.routing.routes import Routes


def _check_comparable(a: Routes, b: Routes) -> None:
    if a.shape != b.shape:
        raise ValueError(f"routes shapes differ: {a.shape} vs {b.shape}")
    if a.layer_map != b.layer_map:
        raise ValueError(f"routes layer maps differ: {a.layer_map} vs {b.layer_map}")


def route_overlap(a: Routes, b: Routes) -> Tensor:
    """|S_a ∩ S_b| per (B, T, L), as int64. Both index sets are duplicate-free along k."""
    _check_comparable(a, b)
    x, y = a.indices.to(torch.int64), b.indices.to(torch.int64).to(a.indices.device)
    return (x.unsqueeze(-1) == y.unsqueeze(-2)).sum(dim=(-1, -2))


def compare_routes(a: Routes, b: Routes, *, overlap: Tensor | None = None) -> dict[str, float]:
    """Flip metrics between two routings of the same tokens, over positions valid in both.

    flip_rate        = mean_{t,l} 1[S_a != S_b]
    expert_flip_frac = mean_{t,l} 1 - |S_a ∩ S_b| / k
    token_flip_rate  = mean_t 1[exists l: S_a != S_b]
    each also per MoE layer as `<name>/layer_<i>`. NaN when no position is valid in both.
    `overlap` is `route_overlap(a, b)` when the caller has it already.
    """
    return compare_finalize(compare_parts(a, b, overlap=overlap))


def compare_parts(a: Routes, b: Routes, *, overlap: Tensor | None = None) -> Partial:
    """Sums behind `compare_routes(a, b)`: valid positions `n`, and float32 sums over them of the flip
    indicator and of 1 - |S_a ∩ S_b| / k per layer (L,), and of the token flip indicator."""
    _check_comparable(a, b)
    overlap = (route_overlap(a, b) if overlap is None else overlap).float()  # (B, T, L)
    k = a.top_k
    valid = a.mask & b.mask.to(a.mask.device)  # (B, T)
    flipped = (overlap < k).float()
    w = valid.unsqueeze(-1).float()  # (B, T, 1)
    return Partial(
        sums={
            "n": valid.sum(),
            "flips": (flipped * w).sum(dim=(0, 1)),
            "expert_flips": ((1.0 - overlap / k) * w).sum(dim=(0, 1)),
            "token_flips": (flipped.amax(dim=-1) * valid).sum(),
        }
    )


def compare_finalize(parts: Partial) -> dict[str, float]:
    """`compare_routes` keys from pooled `compare_parts` (NaN when no position is valid)."""
    sums = parts.sums
    n, L = sums["n"], sums["flips"].shape[0]
    nan = torch.full((L,), float("nan"))
    per_layer_flip = sums["flips"] / n if n else nan
    per_layer_expert = sums["expert_flips"] / n if n else nan
    token_flip = sums["token_flips"] / n if n else torch.tensor(float("nan"))
    # One transfer for all values (float32 -> float exactly, as .item() of each would give).
    values = torch.cat(
        [torch.stack([per_layer_flip.mean(), per_layer_expert.mean(), token_flip]), per_layer_flip, per_layer_expert]
    ).tolist()
    out = {"flip_rate": values[0], "expert_flip_frac": values[1], "token_flip_rate": values[2]}
    for i in range(L):
        out[f"flip_rate/layer_{i}"] = values[3 + i]
        out[f"expert_flip_frac/layer_{i}"] = values[3 + L + i]
    return out


def flip_by_position(
    a: Routes,
    b: Routes,
    response_mask: Tensor,
    start: int,
    bucket: int,
    *,
    buckets: int | None = None,
    overlap: Tensor | None = None,
) -> dict[str, float]:
    """`flip_rate/pos_{p}`: the flip rate over valid response positions, bucketed by `bucket`.

    Position p counts from the input that predicts the first completion token (`start`); a position's
    value is the fraction of its layers that flipped. `overlap` is `route_overlap(a, b)` when the
    caller has it already; `buckets` defaults to as many as the batch's width holds.
    """
    return position_finalize(
        position_parts(a, b, response_mask, start, bucket, buckets=buckets, overlap=overlap), bucket
    )


def position_parts(
    a: Routes,
    b: Routes,
    response_mask: Tensor,
    start: int,
    bucket: int,
    *,
    buckets: int | None = None,
    overlap: Tensor | None = None,
) -> Partial:
    """Per position bucket (buckets,): the float32 sum of the fraction of flipped layers and the count
    of valid response positions."""
    overlap = route_overlap(a, b) if overlap is None else overlap
    flipped = (overlap < a.top_k).float().mean(-1)  # (B, T): fraction of layers flipped
    valid = response_mask.to(torch.bool) & a.mask & b.mask.to(a.mask.device)
    if buckets is None:
        buckets = -(-max(flipped.shape[1] - start, 0) // bucket)
    cols = [slice(start + j * bucket, start + (j + 1) * bucket) for j in range(buckets)]
    flips = [(flipped[:, c] * valid[:, c]).sum() for c in cols]
    counts = [valid[:, c].sum() for c in cols]
    return Partial(
        sums={
            "flips": torch.stack(flips) if cols else torch.zeros(0),
            "n": torch.stack(counts) if cols else torch.zeros(0, dtype=torch.int64),
        }
    )


def position_finalize(parts: Partial, bucket: int) -> dict[str, float]:
    """`flip_rate/pos_{p}` of each bucket (of width `bucket`) with a valid position, from pooled
    `position_parts`."""
    sums = parts.sums
    keep = [j for j, n in enumerate(sums["n"].tolist()) if n]
    if not keep:
        return {}
    rates = torch.stack([sums["flips"][j] / sums["n"][j] for j in keep]).tolist()  # one transfer
    return {f"flip_rate/pos_{j * bucket}": r for j, r in zip(keep, rates)}


def route_metrics(pair: str, a: Routes, b: Routes, *, overlap: Tensor | None = None) -> dict[str, float]:
    """`compare_routes(a, b)` under the metric names `route/{pair}/...` (docs/design.md §3)."""
    return {route_key(pair, k): v for k, v in compare_routes(a, b, overlap=overlap).items()}


def router_shift(old_scores: Tensor, new_scores: Tensor, old: Routes, mask: Tensor) -> dict[str, float]:
    """Router-shift ratio on the old policy's activated experts (RSPO, arXiv 2510.23027).

    With p_old, p_new the routers' selection probabilities (B, T, L, E) and S_old(t, l) the old
    policy's top-k set, per valid token t

        gamma_t = exp( -(1/L) sum_l (1/k) sum_{e in S_old(t,l)} |log p_new(e) - log p_old(e)| )

    in (0, 1]: 1 when the router puts the same probability on every previously activated expert,
    smaller the more it moved. Returns `shift/mean` and `shift/p10` (10th percentile over tokens:
    the most shifted tail) of gamma, and `shift/layer_{i}`, the mean of the per-layer ratio.
    NaN when no token is valid.
    """
    return shift_summary(router_shift_gaps(old_scores, new_scores, old, mask))


def router_shift_gaps(old_scores: Tensor, new_scores: Tensor, old: Routes, mask: Tensor) -> Tensor:
    """(n, L) float64: (1/k) sum_{e in S_old(t,l)} |log p_new(e) - log p_old(e)| for the n valid tokens, in
    row-major order (what `router_shift` summarises; rows of several batches concatenate)."""
    if old_scores.shape != new_scores.shape or old_scores.shape[:3] != old.shape[:3]:
        raise ValueError(
            f"score shapes {tuple(old_scores.shape)}, {tuple(new_scores.shape)} do not match routes {old.shape}"
        )
    valid = mask.to(torch.bool) & old.mask  # (B, T)
    idx = old.indices.to(torch.int64)[valid]  # (n, L, k)
    tiny = torch.finfo(torch.float64).tiny
    p_old = old_scores[valid].double().gather(-1, idx).clamp(min=tiny)  # (n, L, k)
    p_new = new_scores[valid].double().gather(-1, idx).clamp(min=tiny)
    return (p_new.log() - p_old.log()).abs().mean(-1)  # (n, L)


def router_shift_ratio(old_scores: Tensor, new_scores: Tensor, old: Routes, mask: Tensor) -> Tensor:
    """(B, T) float64 router-shift ratio gamma_t of `router_shift` per position, 1 where `mask` or the
    old routes are invalid (RSPO, arXiv 2510.23027, rescales the token ratio by max(gamma_t, floor))."""
    if old_scores.shape != new_scores.shape or old_scores.shape[:3] != old.shape[:3]:
        raise ValueError(
            f"score shapes {tuple(old_scores.shape)}, {tuple(new_scores.shape)} do not match routes {old.shape}"
        )
    valid = mask.to(torch.bool) & old.mask.to(mask.device)  # (B, T)
    idx = old.indices.to(device=old_scores.device, dtype=torch.int64)  # (B, T, L, k)
    tiny = torch.finfo(torch.float64).tiny
    p_old = old_scores.detach().double().gather(-1, idx).clamp(min=tiny)  # (B, T, L, k)
    p_new = new_scores.detach().double().gather(-1, idx).clamp(min=tiny)
    gamma = torch.exp(-(p_new.log() - p_old.log()).abs().mean(-1).mean(-1))  # (B, T)
    return torch.where(valid, gamma, torch.ones_like(gamma))


def shift_summary(per_layer: Tensor) -> dict[str, float]:
    """`shift/mean`, `shift/p10` and `shift/layer_{i}` of `router_shift` from its (n, L) gaps."""
    L = per_layer.shape[1]
    if not per_layer.shape[0]:
        return {
            "shift/mean": float("nan"),
            "shift/p10": float("nan"),
            **{f"shift/layer_{i}": float("nan") for i in range(L)},
        }
    gamma = torch.exp(-per_layer.mean(-1))  # (n,)
    values = torch.cat([torch.stack([gamma.mean(), gamma.quantile(0.1)]), torch.exp(-per_layer).mean(0)]).tolist()
    out = {"shift/mean": values[0], "shift/p10": values[1]}
    out.update({f"shift/layer_{i}": v for i, v in enumerate(values[2:])})
    return out


def flip_margin_counts(
    old: Routes,
    new: Routes,
    margins: Tensor,
    edges: tuple[float, ...] = MARGIN_EDGES,
    *,
    overlap: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(n, flips) per margin bin, both int64 of shape (len(edges) - 1,), over (t, l) valid in both.

    `margins` (B, T, L) are the old router's k-th vs (k+1)-th probability gaps; a (t, l) flips when
    its top-k set under `new` differs from `old`. Bin b holds margins in [edges[b], edges[b+1]).
    `overlap` is `route_overlap(old, new)` (symmetric) when the caller has it already.
    """
    _check_comparable(old, new)
    flipped = (route_overlap(old, new) if overlap is None else overlap) < old.top_k  # (B, T, L)
    valid = (old.mask & new.mask.to(old.mask.device)).unsqueeze(-1).expand_as(flipped)  # (B, T, L)
    m = margins.to(flipped.device).float()[valid]
    f = flipped[valid]
    bins = torch.bucketize(
        m, torch.tensor(edges[1:-1], dtype=m.dtype, device=m.device), right=True
    )  # (n,) in [0, len-2]
    n_bins = len(edges) - 1
    n = torch.bincount(bins, minlength=n_bins)
    flips = torch.bincount(bins, weights=f.double(), minlength=n_bins).round().long()
    return n, flips


def flip_margin_parts(old: Routes, new: Routes, margins: Tensor, *, overlap: Tensor | None = None) -> Partial:
    """`flip_margin_counts` as sums: (t, l) seen (`n`) and flipped per old-margin bin."""
    n, flips = flip_margin_counts(old, new, margins, overlap=overlap)
    return Partial(sums={"n": n, "flips": flips})


def flip_margin_finalize(parts: Partial) -> dict[str, float]:
    """`flip_vs_margin/{n,flips}/bin_{b}` from pooled `flip_margin_parts`."""
    return {
        f"flip_vs_margin/{kind}/bin_{b}": float(v)
        for kind in ("n", "flips")
        for b, v in enumerate(parts.sums[kind].tolist())
    }


def boundary_gaps(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(gap, experts) at the top-k boundary of router selection probabilities `scores` (..., E).

    gap = log p(k-th) - log p((k+1)-th) >= 0, float64 (...): for a softmax router the logit gap, which
    does not depend on the softmax normaliser. experts (..., 2) int64 are the k-th and (k+1)-th ids.
    """
    if not 0 < k < scores.shape[-1]:
        raise ValueError(f"top_k {k} needs 0 < k < experts ({scores.shape[-1]}) to have a boundary")
    top = scores.double().topk(k + 1, dim=-1)
    logp = top.values[..., k - 1 :].clamp(min=torch.finfo(torch.float64).tiny).log()  # (..., 2)
    return logp[..., 0] - logp[..., 1], top.indices[..., k - 1 :]


def boundary_movement(
    old_scores: Tensor,
    new_scores: Tensor,
    old: Routes,
    new: Routes,
    *,
    overlap: Tensor | None = None,
    edges: tuple[float, ...] = MOVE_EDGES,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """How far an update moved the router logits at the old top-k boundary, and flips per gap/movement.

    Per (t, l) valid in both routes, with e_k, e_{k+1} the old router's k-th and (k+1)-th experts and
    g = log p_old(e_k) - log p_old(e_{k+1}) the old logit gap (`boundary_gaps`), the update moves it by
    delta = [log p_new(e_k) - log p_new(e_{k+1})] - g; a flip needs delta < -g. Returns
    sigma = sqrt(mean delta^2) over all valid (t, l) (float64 scalar), sigma_l, the same per layer (L,),
    and (n, flips) int64 per bin of x = g / sigma_l in `edges` (flip: the top-k set changed,
    `route_overlap` < k). Layers move at different rates (deeper ones more), hence the per-layer scale;
    a layer that did not move (sigma_l = 0) puts its (t, l) at x = +inf. With every expert chosen (k = E,
    soft routing) there is no boundary: like an empty batch, NaN movement and empty bins.
    """
    _check_comparable(old, new)
    if old_scores.shape != new_scores.shape or old_scores.shape[:3] != old.shape[:3]:
        raise ValueError(
            f"score shapes {tuple(old_scores.shape)}, {tuple(new_scores.shape)} do not match routes {old.shape}"
        )
    valid = old.mask & new.mask.to(old.mask.device)  # (B, T)
    n_bins = len(edges) - 1
    delta = torch.empty(0)
    if old.top_k < old_scores.shape[-1]:  # else no top-k boundary to move
        gap, experts = boundary_gaps(old_scores[valid], old.top_k)  # (n, L), (n, L, 2)
        p_new = new_scores[valid].double().gather(-1, experts).clamp(min=torch.finfo(torch.float64).tiny)
        delta = (p_new[..., 0].log() - p_new[..., 1].log()) - gap  # (n, L)
    if not delta.numel():
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        zeros = torch.zeros(n_bins, dtype=torch.int64)
        return nan, torch.full((old.shape[2],), float("nan"), dtype=torch.float64), zeros, zeros.clone()
    sigma, sigma_layer = delta.pow(2).mean().sqrt(), delta.pow(2).mean(0).sqrt()  # (), (L,)
    flipped = ((route_overlap(old, new) if overlap is None else overlap) < old.top_k)[valid]  # (n, L)
    x = torch.where(sigma_layer > 0, gap / sigma_layer, float("inf")).flatten()
    bins = torch.bucketize(x, torch.tensor(edges[1:-1], dtype=x.dtype, device=x.device), right=True)
    n = torch.bincount(bins, minlength=n_bins)
    flips = torch.bincount(bins, weights=flipped.flatten().double(), minlength=n_bins).round().long()
    return sigma, sigma_layer, n, flips


def movement_parts(
    old_scores: Tensor, new_scores: Tensor, old: Routes, new: Routes, *, overlap: Tensor | None = None
) -> Partial:
    """`boundary_movement` as sums: squared boundary movement per layer (L,), the valid positions behind
    it, and (n, flips) per gap/movement bin (binned with this process's per-layer movement)."""
    sigma, per_layer, n, flips = boundary_movement(old_scores, new_scores, old, new, overlap=overlap)
    count = (old.mask & new.mask.to(old.mask.device)).sum().double().cpu()
    if old.top_k >= old_scores.shape[-1]:  # every expert chosen: no boundary, nothing counted
        count = torch.zeros_like(count)
    sq = torch.nan_to_num(per_layer.cpu() ** 2) * count  # (L,)
    return Partial(sums={"sq": sq, "count": count, "n": n.cpu(), "flips": flips.cpu()})


def movement_finalize(parts: Partial) -> dict[str, float]:
    """`old_vs_new/move/{rms,layer_i}` and `flip_vs_margin/move/{n,flips}/bin_b` from pooled `movement_parts`."""
    sq, count = parts.sums["sq"].double(), float(parts.sums["count"])
    per_layer = (sq / count).sqrt().tolist() if count else [math.nan] * sq.numel()
    out = {"old_vs_new/move/rms": math.sqrt(float(sq.mean()) / count) if count else math.nan}
    out.update({f"old_vs_new/move/layer_{i}": v for i, v in enumerate(per_layer)})
    out.update(
        {
            f"flip_vs_margin/move/{kind}/bin_{b}": float(v)
            for kind in ("n", "flips")
            for b, v in enumerate(parts.sums[kind].tolist())
        }
    )
    return out


def confidence_parts(scores: Tensor, routes: Routes) -> Partial:
    """Sums behind `route/confidence`: over the valid (t, l) of `routes`, the count `n` and the float64 sum
    of the selected experts' selection scores, `sum_{e in S(t, l)} p(e)` (`scores`: (B, T, L, E))."""
    if scores.shape[:3] != routes.shape[:3]:
        raise ValueError(f"scores shape {tuple(scores.shape)} does not match routes {routes.shape}")
    valid = routes.mask.to(scores.device)  # (B, T)
    mass = scores.double().gather(-1, routes.indices.to(device=scores.device, dtype=torch.int64)).sum(-1)  # (B, T, L)
    return Partial(sums={"n": (valid.sum() * routes.shape[2]).double(), "mass": (mass * valid.unsqueeze(-1)).sum()})


def confidence_finalize(parts: Partial) -> float:
    """Routing confidence (prime-rl's `routing_confidence`, after Step 3.5 Flash, arXiv 2602.10604): the mean
    over valid (token, MoE layer) of the router probability mass on its selected top-k experts; NaN when
    nothing is valid."""
    n = parts.sums["n"].item()
    return parts.sums["mass"].item() / n if n else math.nan


def fallback_parts(replayed: Routes, valid: Tensor) -> Partial:
    """Sums behind `route/r3_fallback_frac`: the real input tokens `n` (`valid`, (B, T) bool) and those of
    them the replayed routes leave to the live router (masked: vLLM's -1 prefix-cached positions)."""
    valid = valid.to(torch.bool).to(replayed.mask.device)
    return Partial(sums={"n": valid.sum(), "fallback": (valid & ~replayed.mask).sum()})


def fallback_finalize(parts: Partial) -> float:
    """Share of the real input tokens routed by the live router instead of the replayed routes (NaN: none)."""
    n = parts.sums["n"].item()
    return parts.sums["fallback"].item() / n if n else math.nan
