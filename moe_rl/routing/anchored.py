"""Anchored routing: every forward pass of a model takes the routes a frozen anchor model chooses for the
same inputs (`replay.mode=anchored`, docs/routes.md).

`AnchoredRouting(model, anchor)` runs, before each pass of `model`, a no-grad pass of `anchor` over the
same call (the same ids, attention mask and positions; a KV-cache continuation continues the anchor's own
cache), records the anchor's top-k ids at every MoE layer, and forces them into `model`'s routers, the
gate weights recomputed from `model`'s live router logits by the family's rule (as `RouteReplay` does).
So a sampler decoding token by token needs no change: each decoded token's routes are the anchor's at
that position, computed from its own KV cache alongside the model's, at the price of one anchor forward
per model forward. A teacher-forced pass is anchored the same way; the loop's updates instead replay
routes of one teacher-forced anchor pass (`Routes`) with `RouteReplay`, which also records what the live
router would have chosen.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from moe_rl.routing.gate_rules import check_rule_on_output, resolve_rule
from moe_rl.routing.hooks import _RouteContext, take_native_order
from moe_rl.routing.layers import router_output

CACHE_KWARGS = ("past_key_values", "cache")  # the forward's name for the KV cache (renamed in later v5 releases)


class AnchoredRouting(_RouteContext):
    """Inside the context, every forward pass of `model` routes each token to the experts `anchor` picks
    for it; it leaves both models' route hooks on exit, also when the body raises.

    `anchor` is a model of the same MoE layout (layers, experts, k), in any dtype, on the same device; it
    is called with the model's own arguments, its KV cache swapped for one of its own (a cache the model
    starts empty starts the anchor's anew)."""

    front = True  # every recorder then sees the forced routes

    def __init__(self, model: nn.Module, anchor: nn.Module) -> None:
        if model is anchor:
            raise ValueError("anchored routing needs an anchor model distinct from the routed one")
        super().__init__(model)
        self.anchor = anchor
        self.capture = _AnchorCapture(anchor, self)
        self.anchor_layers = self.capture.layers
        shape = [(layer.num_experts, layer.top_k) for layer in self.layers]
        anchor_shape = [(layer.num_experts, layer.top_k) for layer in self.anchor_layers]
        if shape != anchor_shape:
            raise ValueError(f"anchor's MoE layers (experts, k) {anchor_shape} != the model's {shape}")
        self.rules = [resolve_rule(layer) for layer in self.layers]
        self._ids: list[Tensor | None] = [None] * len(self.layers)  # per layer: the anchor's (N, k) ids, sorted
        self._cache: Any = None

    def __enter__(self) -> AnchoredRouting:
        self.capture._attach()
        self._attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.capture.__exit__(*exc)
        super().__exit__(*exc)
        self._cache = None

    def begin_pass(self, args: tuple, kwargs: dict) -> None:
        """The anchor's pass over the same call, its routes kept for the model's routers."""
        kwargs = dict(kwargs)
        for key in CACHE_KWARGS:
            cache = kwargs.get(key)
            if cache is not None and hasattr(cache, "get_seq_length"):
                if cache.get_seq_length() == 0:  # a new sequence: a new anchor cache
                    config: Any = self.anchor.config
                    self._cache = type(cache)(config=config.get_text_config(decoder=True))
                elif self._cache is None:
                    raise RuntimeError("anchored routing entered in the middle of a KV-cache sequence")
                kwargs[key] = self._cache
        self._ids = [None] * len(self.layers)
        with torch.no_grad():
            self.anchor(*args, **kwargs)
        missing = [self.anchor_layers[i].name for i, ids in enumerate(self._ids) if ids is None]
        if missing:
            raise RuntimeError(f"the anchor's pass recorded no route at MoE layers {missing}")

    def on_router(self, i: int, router: nn.Module, args: tuple, output: tuple) -> tuple:
        layer = self.layers[i]
        logits, weights, native = router_output(layer.name, router, output)
        forced = self._ids[i]
        if forced is None:
            raise RuntimeError(f"{layer.name}: a forward pass reached the router outside an anchored pass")
        if forced.shape[0] != logits.shape[0]:
            raise ValueError(f"{layer.name}: router saw {logits.shape[0]} tokens, the anchor {forced.shape[0]}")
        rule = self.rules[i]
        if rule is None:
            rule = self.rules[i] = check_rule_on_output(layer, output)
        forced = forced.to(native.device)
        keep_native = torch.zeros(forced.shape[0], 1, dtype=torch.bool, device=forced.device)
        forced = take_native_order(forced, native.long(), keep_native)  # bitwise where the sets agree
        return logits, rule(router, logits, forced).to(weights.dtype), forced.to(native.dtype)


class _AnchorCapture(_RouteContext):
    """The anchor's side: each MoE layer's top-k ids of the anchor's pass, kept for the routed model's routers."""

    def __init__(self, anchor: nn.Module, routing: AnchoredRouting) -> None:
        super().__init__(anchor)
        self.routing = routing

    def on_router(self, i: int, router: nn.Module, args: tuple, output: tuple) -> tuple:
        if self.routing._ids[i] is None:
            _, _, indices = router_output(self.layers[i].name, router, output)
            self.routing._ids[i] = indices.detach().long().sort(dim=-1).values  # (N, k), in the router's row order
        return output


def anchored_by(anchor: nn.Module | None, model: nn.Module) -> contextlib.AbstractContextManager:
    """`AnchoredRouting(model, anchor)`, or a context that changes nothing without an anchor."""
    return AnchoredRouting(model, anchor) if anchor is not None else contextlib.nullcontext()
