"""Per-family gate-weight rules: the router's weights recomputed at given (forced) expert indices.

Each rule maps `(router, logits [N, E], indices [N, k]) -> weights [N, k]` and is differentiable in
`logits`, so the router still learns under Routing Replay. Forced experts outside the live top-k
get their true weight: the probabilities are gathered from the full distribution, never from a
top-k-masked one. `selection_scores` gives the scores top-k is taken over (for margins).
MegaBlocks' `LearnedRouter` hands over softmax probabilities (`scores`) where others hand logits;
its rule gathers them directly, and gradients reach its weight through them just the same.

Which rule a router uses is checked, not assumed: `resolve_rule` (on a probe input when attaching a
replay) and `check_rule_on_output` (on a real call) keep only a rule that reproduces the router's own
weights at its own indices, bitwise where one does (`pick_rule`), and refuse the router otherwise.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from moe_rl.routing.layers import MoeLayer, UnsupportedRouterError, is_megablocks_router, router_output

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

    parts = [
        score,
        "topk",
        {"flag": "norm_if_flag", "always": "norm", "never": ""}[norm],
        f"eps{eps:g}" if eps and norm != "never" else "",
        "scaled" if scale else "",
    ]
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
# Bitwise matches are preferred over ones within rounding (`pick_rule`), so the
# order only decides between rules that agree exactly.
GENERIC_RULES: tuple[Rule, ...] = (
    softmax_topk,
    softmax_topk_unnormalised,
    softmax_selected,
    sigmoid_scaled,
    *(
        gather_rule(score, norm, eps, scale)
        for score in ("softmax", "sigmoid", "score_fn")
        for norm in ("always", "never")
        for eps in ((0.0, 1e-20, 1e-6) if norm != "never" else (0.0,))
        for scale in (False, True)
    ),
)


def selection_scores(router: nn.Module, logits: Tensor) -> Tensor:
    """The scores the router takes its top-k over, as probabilities where the family has them."""
    if type(router).__name__ == "DeepseekV3TopkRouter":
        return logits.float().sigmoid() + router.e_score_correction_bias
    if type(router).__name__ == "LearnedRouter":  # MegaBlocks hands over the probabilities themselves
        return logits.float()
    return torch.softmax(logits, dim=-1, dtype=torch.float)


# --- which rule a router uses -----------------------------------------------------------------

_CHECKED_RULES: weakref.WeakKeyDictionary[nn.Module, Rule] = weakref.WeakKeyDictionary()


def pick_rule(
    router: nn.Module, logits: Tensor, weights: Tensor, indices: Tensor, candidates: tuple[Rule, ...]
) -> Rule | None:
    """The first candidate that reproduces `weights` at `indices` bitwise, else the first that does
    so to float tolerance (rtol 1e-4), else None.

    Several rules can agree to within rounding (e.g. softmax over all logits then renormalised vs.
    softmax over the selected logits); only the one the router itself computes makes self-replay
    bitwise equal to the plain forward.
    """
    close = None
    for rule in candidates:
        try:
            recomputed = rule(router, logits, indices).to(weights.dtype)
        except (AttributeError, TypeError, RuntimeError):  # the rule needs a field this router lacks
            continue
        if recomputed.shape != weights.shape:
            continue
        if torch.equal(recomputed, weights):
            return rule
        if close is None and torch.allclose(recomputed.float(), weights.float(), rtol=1e-4, atol=1e-6):
            close = rule
    return close


def _candidates(router: nn.Module) -> tuple[Rule, ...]:
    name = type(router).__name__
    return (FAMILY_RULES[name],) if name in FAMILY_RULES else GENERIC_RULES


def _no_rule(layer_name: str, router: nn.Module, candidates: tuple[Rule, ...]) -> UnsupportedRouterError:
    return UnsupportedRouterError(
        type(router).__name__,
        f"no gate-weight rule reproduces its weights at its own indices (tried "
        f"{[rule.__name__ for rule in candidates]}); replay would train a different function",
        layer_name,
    )


def check_rule_on_output(layer: MoeLayer, output: object) -> Rule:
    """Resolve `layer`'s rule from one real router call (for routers a synthetic probe cannot call,
    e.g. LFM2-MoE's, which takes the MoE block's expert bias as a second input)."""
    router = layer.router
    if router in _CHECKED_RULES:
        return _CHECKED_RULES[router]
    logits, weights, indices = router_output(layer.name, router, output)
    with torch.no_grad():
        rule = pick_rule(router, logits.detach(), weights.detach(), indices, _candidates(router))
    if rule is None:
        raise _no_rule(layer.name, router, _candidates(router))
    _CHECKED_RULES[router] = rule
    return rule


def resolve_rule(layer: MoeLayer) -> Rule | None:
    """The gate-weight rule of `layer`'s router, checked on a probe input.

    Recomputing the weights at the router's own indices must reproduce the router's own weights;
    otherwise replay would train a different function than the model computes, so raise
    `UnsupportedRouterError` now. Returns None when the router cannot be called on a probe alone
    (it needs other inputs of its MoE block); `check_rule_on_output` then checks the first real call.
    """
    router = layer.router
    if router in _CHECKED_RULES:
        return _CHECKED_RULES[router]
    weight = layer.weight
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(32, weight.shape[1], generator=generator).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad(), _probe_without_side_effects(router):
        try:
            output = _call_unsharded(router, probe, layer.name)
        except (TypeError, RuntimeError, AttributeError, IndexError) as err:
            if _is_dtensor(weight) and "sharded" in str(err):
                raise
            return None
        return check_rule_on_output(layer, output)


def _call_unsharded(router: nn.Module, probe: Tensor, name: str) -> object:
    """`router(probe)` outside any forward, also when FSDP2 has sharded its parameters into DTensors.

    FSDP2 gathers a layer's parameters only inside that layer's forward, so the router's weight is a
    shard here; its full value is gathered (`DTensor.full_tensor()`, a collective every rank reaches
    because each one attaches the same replay) and passed in with `torch.func.functional_call`.
    """
    sharded = {n: p for n, p in router.named_parameters() if _is_dtensor(p)}
    if not sharded:
        return router(probe)
    try:
        full = {n: p.full_tensor() for n, p in sharded.items()}
    except Exception as err:
        raise RuntimeError(
            f"router {name}: its parameters are sharded ({type(next(iter(sharded.values()))).__name__}) and could "
            f"not be gathered for the attach-time rule check ({type(err).__name__}: {err}); attach the replay "
            "inside an unsharded context (e.g. FSDP2's module.unshard()) on every rank"
        ) from err
    return torch.func.functional_call(router, full, (probe,))


def _is_dtensor(x: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return False
    return isinstance(x, DTensor)


@contextmanager
def _probe_without_side_effects(router: nn.Module) -> Iterator[None]:
    """MegaBlocks' router jitters its input in training (drawing from the RNG) and appends its logits
    to the module-level z-loss list when `args.moe_zloss_weight` is set: the attach-time probe must
    do neither, so it runs in eval mode with the z-loss weight at 0, both restored after."""
    if not is_megablocks_router(router):
        yield
        return
    args, training, zloss = router.args, router.training, getattr(router.args, "moe_zloss_weight", 0)
    router.train(False)
    if zloss:
        args.moe_zloss_weight = 0
    try:
        yield
    finally:
        router.train(training)
        if zloss:
            args.moe_zloss_weight = zloss
