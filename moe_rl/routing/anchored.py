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
from torch.utils.hooks import RemovableHandle

from moe_rl.routing.hooks import take_native_order
from moe_rl.routing.layers import find_moe_layers, refuse_hub_kernels, router_output
from moe_rl.routing.rules import check_rule_on_output, resolve_rule

CACHE_KWARGS = ("past_key_values", "cache")  # the forward's name for the KV cache (renamed in later v5 releases)


class AnchoredRouting:
    """Inside the context, every forward pass of `model` routes each token to the experts `anchor` picks
    for it; the hooks are removed on exit, also when the body raises.

    `anchor` is a model of the same MoE layout (layers, experts, k), in any dtype, on the same device; it
    is called with the model's own arguments, its KV cache swapped for one of its own (a cache the model
    starts empty starts the anchor's anew)."""

    def __init__(self, model: nn.Module, anchor: nn.Module) -> None:
        if model is anchor:
            raise ValueError("anchored routing needs an anchor model distinct from the routed one")
        self.model, self.anchor = model, anchor
        self.layers, self.anchor_layers = find_moe_layers(model), find_moe_layers(anchor)
        refuse_hub_kernels(model, self.layers)
        refuse_hub_kernels(anchor, self.anchor_layers)
        shape = [(layer.num_experts, layer.top_k) for layer in self.layers]
        anchor_shape = [(layer.num_experts, layer.top_k) for layer in self.anchor_layers]
        if shape != anchor_shape:
            raise ValueError(f"anchor's MoE layers (experts, k) {anchor_shape} != the model's {shape}")
        self.rules = [resolve_rule(layer) for layer in self.layers]
        self._ids: list[Tensor | None] = [None] * len(self.layers)  # per layer: the anchor's (N, k) ids, sorted
        self._cache: Any = None
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> AnchoredRouting:
        for i, layer in enumerate(self.anchor_layers):
            self._handles.append(layer.router.register_forward_hook(self._capture(i)))
        for i, layer in enumerate(self.layers):  # before any recorder, which then sees the forced routes
            self._handles.append(layer.router.register_forward_hook(self._force(i), prepend=True))
        self._handles.append(self.model.register_forward_pre_hook(self._anchor_pass, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._cache = None

    def _anchor_pass(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Model pre-hook: the anchor's pass over the same call, its routes kept for the model's routers."""
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

    def _capture(self, i: int):
        def hook(router: nn.Module, args: tuple, output: tuple) -> None:
            if self._ids[i] is None:
                _, _, indices = router_output(self.anchor_layers[i].name, router, output)
                self._ids[i] = indices.detach().long().sort(dim=-1).values  # (N, k), in the router's row order

        return hook

    def _force(self, i: int):
        layer = self.layers[i]

        def hook(router: nn.Module, args: tuple, output: tuple) -> tuple:
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

        return hook


def anchored_by(anchor: nn.Module | None, model: nn.Module) -> contextlib.AbstractContextManager:
    """`AnchoredRouting(model, anchor)`, or a context that changes nothing without an anchor."""
    return AnchoredRouting(model, anchor) if anchor is not None else contextlib.nullcontext()
