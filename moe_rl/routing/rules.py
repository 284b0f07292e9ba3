"""Per-family gate-weight rules: the router's weights recomputed at given (forced) expert indices.

Each rule maps `(router, logits [N, E], indices [N, k]) -> weights [N, k]` and is differentiable in
`logits`, so the router still learns under Routing Replay. Forced experts outside the live top-k
get their true weight: the probabilities are gathered from the full distribution, never from a
top-k-masked one. `selection_scores` gives the scores top-k is taken over (for margins).
MegaBlocks' `LearnedRouter` hands over softmax probabilities (`scores`) where others hand logits;
its rule gathers them directly, and gradients reach its weight through them just the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

Rule = Callable[[nn.Module, Tensor, Tensor], Tensor]


def softmax_topk(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen2/3-MoE, OLMoE, Mixtral: w = softmax(logits)[idx], renormalised if `norm_topk_prob`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, indices)
    if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises and has no flag
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def softmax_topk_unnormalised(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    return torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)


def sigmoid_scaled(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """DeepSeek-V3: w = sigmoid(logits)[idx] (bias only steers selection), normalised, times the
    routed scaling factor."""
    weights = logits.float().sigmoid().gather(-1, indices)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def softmax_selected(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """GPT-OSS: softmax over the selected logits only."""
    return torch.softmax(logits.gather(-1, indices), dim=-1, dtype=logits.dtype)


def megablocks_scores(router: nn.Module, scores: Tensor, indices: Tensor) -> Tensor:
    """MegaBlocks `LearnedRouter`: w = scores[idx] with scores = softmax(logits), divided by the
    p-norm of the selected scores when `args.moe_normalize_expert_weights = p`
    (megablocks/layers/router.py). Computed in the scores' dtype, as the router does."""
    weights = scores.gather(-1, indices)
    p = router.args.moe_normalize_expert_weights
    if p:
        weights = weights / torch.norm(weights, p=p, dim=-1, keepdim=True)
    return weights


def scaling_factor(router: nn.Module) -> float:
    """The router's routed scaling factor, under the names families give it."""
    for name in ("routed_scaling_factor", "router_scaling_factor"):
        value = getattr(router, name, None)
        if value is not None:
            return value
    raise AttributeError(f"{type(router).__name__} has no routed scaling factor")


def gather_rule(score: str, norm: str, eps: float, scale: bool) -> Rule:
    """A rule of the common shape `w = score(logits)[idx]`, optionally renormalised over the k
    selected (`norm`: "flag" follows `router.norm_topk_prob`, "always", "never"; `eps` added to the
    sum as the family does) and optionally times `router.routed_scaling_factor`.

    `score` is "softmax", "sigmoid" or "score_fn" (the router's own `score_fn`, e.g. DeepSeek-V4's
    configurable scoring function). The probabilities are gathered from the full distribution, so
    forced experts outside the live top-k keep their true weight.
    """

    def rule(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
        if score == "softmax":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        elif score == "sigmoid":
            probs = logits.float().sigmoid()
        else:
            probs = router.score_fn(logits)
        weights = probs.gather(-1, indices)
        if {"flag": getattr(router, "norm_topk_prob", True), "always": True, "never": False}[norm]:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + eps) if eps else weights / total
        if scale:
            weights = weights * scaling_factor(router)
        return weights

    parts = [score, "topk", {"flag": "norm_if_flag", "always": "norm", "never": ""}[norm],
             f"eps{eps:g}" if eps and norm != "never" else "", "scaled" if scale else ""]
    rule.__name__ = "_".join(p for p in parts if p)
    return rule


FAMILY_RULES: dict[str, Rule] = {
    "Qwen3MoeTopKRouter": softmax_topk,
    "Qwen2MoeTopKRouter": softmax_topk,
    "OlmoeTopKRouter": softmax_topk,
    "MixtralTopKRouter": softmax_topk,
    "DeepseekV3TopkRouter": sigmoid_scaled,
    "GptOssTopKRouter": softmax_selected,
    "LearnedRouter": megablocks_scores,
}

# Tried in order for routers of other models that follow the v5 contract
# `router(hidden) -> (logits, weights, indices)`; the first that reproduces the router's own
# weights at its own indices is used.
# Bitwise matches are preferred over ones within rounding (`moe_rl.routing.hooks.pick_rule`), so the
# order only decides between rules that agree exactly.
GENERIC_RULES: tuple[Rule, ...] = (
    softmax_topk, softmax_topk_unnormalised, softmax_selected, sigmoid_scaled,
    *(gather_rule(score, norm, eps, scale)
      for score in ("softmax", "sigmoid", "score_fn")
      for norm in ("always", "never")
      for eps in ((0.0, 1e-20, 1e-6) if norm != "never" else (0.0,))
      for scale in (False, True)),
)


def selection_scores(router: nn.Module, logits: Tensor) -> Tensor:
    """The scores the router takes its top-k over, as probabilities where the family has them."""
    if type(router).__name__ == "DeepseekV3TopkRouter":
        return logits.float().sigmoid() + router.e_score_correction_bias
    if type(router).__name__ == "LearnedRouter":  # MegaBlocks hands over the probabilities themselves
        return logits.float()
    return torch.softmax(logits, dim=-1, dtype=torch.float)
