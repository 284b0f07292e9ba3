"""Route comparison metrics of DESIGN §3, as pure functions of two `Routes`."""

from __future__ import annotations

import torch
from torch import Tensor

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


def compare_routes(a: Routes, b: Routes) -> dict[str, float]:
    """Flip metrics between two routings of the same tokens, over positions valid in both.

    flip_rate        = mean_{t,l} 1[S_a != S_b]
    expert_flip_frac = mean_{t,l} 1 - |S_a ∩ S_b| / k
    token_flip_rate  = mean_t 1[exists l: S_a != S_b]
    each also per MoE layer as `<name>/layer_<i>`. NaN when no position is valid in both.
    """
    overlap = route_overlap(a, b).float()  # (B, T, L)
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
    out = {
        "flip_rate": per_layer_flip.mean().item(),
        "expert_flip_frac": per_layer_expert.mean().item(),
        "token_flip_rate": token_flip.item(),
    }
    for i in range(L):
        out[f"flip_rate/layer_{i}"] = per_layer_flip[i].item()
        out[f"expert_flip_frac/layer_{i}"] = per_layer_expert[i].item()
    return out


def route_metrics(pair: str, a: Routes, b: Routes) -> dict[str, float]:
    """`compare_routes(a, b)` under the metric names `route/{pair}/...` (DESIGN §3)."""
    return {f"route/{pair}/{k}": v for k, v in compare_routes(a, b).items()}
