"""Route comparison metrics of DESIGN §3, as pure functions of two `Routes`."""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl.bins import MARGIN_EDGES, MOVE_EDGES
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
    _check_comparable(a, b)
    overlap = (route_overlap(a, b) if overlap is None else overlap).float()  # (B, T, L)
    k, L = a.top_k, a.shape[2]
    valid = a.mask & b.mask.to(a.mask.device)  # (B, T)
    n = valid.sum()
    flipped = (overlap < k).float()
    expert_flip = 1.0 - overlap / k
    w = valid.unsqueeze(-1).float()

    def mean_over_tokens(x: Tensor) -> Tensor:  # (B, T, ...) -> (...)
        return (x * w.view(*w.shape[:2], *([1] * (x.dim() - 2)))).sum(dim=(0, 1)) / n

    per_layer_flip = mean_over_tokens(flipped) if n else torch.full((L,), float("nan"))
    per_layer_expert = mean_over_tokens(expert_flip) if n else torch.full((L,), float("nan"))
    token_flip = (flipped.amax(dim=-1) * valid).sum() / n if n else torch.tensor(float("nan"))
    # One transfer for all values (float32 -> float exactly, as .item() of each would give).
    values = torch.cat([torch.stack([per_layer_flip.mean(), per_layer_expert.mean(), token_flip]),
                        per_layer_flip, per_layer_expert]).tolist()
    out = {"flip_rate": values[0], "expert_flip_frac": values[1], "token_flip_rate": values[2]}
    for i in range(L):
        out[f"flip_rate/layer_{i}"] = values[3 + i]
        out[f"expert_flip_frac/layer_{i}"] = values[3 + L + i]
    return out


def route_metrics(pair: str, a: Routes, b: Routes, *, overlap: Tensor | None = None) -> dict[str, float]:
    """`compare_routes(a, b)` under the metric names `route/{pair}/...` (DESIGN §3)."""
    return {f"route/{pair}/{k}": v for k, v in compare_routes(a, b, overlap=overlap).items()}


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
        raise ValueError(f"score shapes {tuple(old_scores.shape)}, {tuple(new_scores.shape)} do not match "
                         f"routes {old.shape}")
    valid = mask.to(torch.bool) & old.mask  # (B, T)
    idx = old.indices.to(torch.int64)[valid]  # (n, L, k)
    tiny = torch.finfo(torch.float64).tiny
    p_old = old_scores[valid].double().gather(-1, idx).clamp(min=tiny)  # (n, L, k)
    p_new = new_scores[valid].double().gather(-1, idx).clamp(min=tiny)
    return (p_new.log() - p_old.log()).abs().mean(-1)  # (n, L)


def shift_summary(per_layer: Tensor) -> dict[str, float]:
    """`shift/mean`, `shift/p10` and `shift/layer_{i}` of `router_shift` from its (n, L) gaps."""
    L = per_layer.shape[1]
    if not per_layer.shape[0]:
        return {"shift/mean": float("nan"), "shift/p10": float("nan"),
                **{f"shift/layer_{i}": float("nan") for i in range(L)}}
    gamma = torch.exp(-per_layer.mean(-1))  # (n,)
    values = torch.cat([torch.stack([gamma.mean(), gamma.quantile(0.1)]), torch.exp(-per_layer).mean(0)]).tolist()
    out = {"shift/mean": values[0], "shift/p10": values[1]}
    out.update({f"shift/layer_{i}": v for i, v in enumerate(values[2:])})
    return out


def flip_margin_counts(
    old: Routes, new: Routes, margins: Tensor, edges: tuple[float, ...] = MARGIN_EDGES, *,
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
    bins = torch.bucketize(m, torch.tensor(edges[1:-1], dtype=m.dtype), right=True)  # (n,) in [0, len-2]
    n_bins = len(edges) - 1
    n = torch.bincount(bins, minlength=n_bins)
    flips = torch.bincount(bins, weights=f.double(), minlength=n_bins).round().long()
    return n, flips


def boundary_gaps(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(gap, experts) at the top-k boundary of router selection probabilities `scores` (..., E).

    gap = log p(k-th) - log p((k+1)-th) >= 0, float64 (...): for a softmax router the logit gap, which
    does not depend on the softmax normaliser. experts (..., 2) int64 are the k-th and (k+1)-th ids.
    """
    if not 0 < k < scores.shape[-1]:
        raise ValueError(f"top_k {k} needs 0 < k < experts ({scores.shape[-1]}) to have a boundary")
    top = scores.double().topk(k + 1, dim=-1)
    logp = top.values[..., k - 1:].clamp(min=torch.finfo(torch.float64).tiny).log()  # (..., 2)
    return logp[..., 0] - logp[..., 1], top.indices[..., k - 1:]


def boundary_movement(
    old_scores: Tensor, new_scores: Tensor, old: Routes, new: Routes, *, overlap: Tensor | None = None,
    edges: tuple[float, ...] = MOVE_EDGES,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """How far an update moved the router logits at the old top-k boundary, and flips per gap/movement.

    Per (t, l) valid in both routes, with e_k, e_{k+1} the old router's k-th and (k+1)-th experts and
    g = log p_old(e_k) - log p_old(e_{k+1}) the old logit gap (`boundary_gaps`), the update moves it by
    delta = [log p_new(e_k) - log p_new(e_{k+1})] - g; a flip needs delta < -g. Returns
    sigma = sqrt(mean delta^2) over all valid (t, l) (float64 scalar), sigma_l, the same per layer (L,),
    and (n, flips) int64 per bin of x = g / sigma_l in `edges` (flip: the top-k set changed,
    `route_overlap` < k). Layers move at different rates (deeper ones more), hence the per-layer scale;
    a layer that did not move (sigma_l = 0) puts its (t, l) at x = +inf.
    """
    _check_comparable(old, new)
    if old_scores.shape != new_scores.shape or old_scores.shape[:3] != old.shape[:3]:
        raise ValueError(f"score shapes {tuple(old_scores.shape)}, {tuple(new_scores.shape)} do not match "
                         f"routes {old.shape}")
    valid = old.mask & new.mask.to(old.mask.device)  # (B, T)
    gap, experts = boundary_gaps(old_scores[valid], old.top_k)  # (n, L), (n, L, 2)
    p_new = new_scores[valid].double().gather(-1, experts).clamp(min=torch.finfo(torch.float64).tiny)
    delta = (p_new[..., 0].log() - p_new[..., 1].log()) - gap  # (n, L)
    n_bins = len(edges) - 1
    if not delta.numel():
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        zeros = torch.zeros(n_bins, dtype=torch.int64)
        return nan, torch.full((old.shape[2],), float("nan"), dtype=torch.float64), zeros, zeros.clone()
    sigma, sigma_layer = delta.pow(2).mean().sqrt(), delta.pow(2).mean(0).sqrt()  # (), (L,)
    flipped = ((route_overlap(old, new) if overlap is None else overlap) < old.top_k)[valid]  # (n, L)
    x = torch.where(sigma_layer > 0, gap / sigma_layer, float("inf")).flatten()
    bins = torch.bucketize(x, torch.tensor(edges[1:-1], dtype=x.dtype), right=True)
    n = torch.bincount(bins, minlength=n_bins)
    flips = torch.bincount(bins, weights=flipped.flatten().double(), minlength=n_bins).round().long()
    return sigma, sigma_layer, n, flips
