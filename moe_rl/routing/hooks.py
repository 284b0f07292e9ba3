"""Route recording and Routing Replay as context managers over a transformers v5 MoE model.

Both hook the router module of every MoE layer (found by `moe_rl.routing.layers`), whose outputs
feed the experts; replay recomputes the gate weights at the forced indices with the router's rule
(`moe_rl.routing.gate_rules`). Layers whose router rows are sequence-major (MegaBlocks) are permuted to
and from batch-major here. A hook on the model itself marks the start and end of each forward pass,
which gives three guarantees:
- a route is recorded once per layer per pass, so gradient-checkpointing recomputation during
  backward (which runs outside any pass) never double-records;
- a replay that did not reach every MoE layer in a pass raises instead of silently doing nothing;
- routes of successive KV-cache calls (`generate`) are assembled along time into one record.
"""

from __future__ import annotations

import copy
import functools
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from moe_rl.routing.gate_rules import check_rule_on_output, resolve_rule, selection_scores
from moe_rl.routing.layers import (
    MoeLayer,
    find_moe_layers,
    refuse_hub_kernels,
    router_output,
    rows_to_batch_major,
    rows_to_seq_major,
)
from moe_rl.routing.routes import Routes, index_dtype, sort_topk


def _input_shape(args: tuple, kwargs: dict) -> tuple[int, int]:
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None and args:
        x = args[0]
    if x is None:
        raise ValueError("forward pass without input_ids or inputs_embeds")
    return int(x.shape[0]), int(x.shape[1])


def _is_continuation(kwargs: dict) -> bool:
    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # renamed to `cache` in later v5 releases
    return cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0


def _batch_major(layer: MoeLayer, rows: Tensor, B: int, T: int) -> Tensor:
    """`layer`'s router rows in batch-major order, the order of `Routes`."""
    return rows_to_batch_major(rows, B, T) if layer.seq_major else rows


def _check_seq_major_input(layer: MoeLayer, args: tuple, B: int, T: int) -> None:
    """A sequence-major router fed (B, T, H) activations would have batch-major rows: refuse it."""
    x = args[0] if args else None
    if isinstance(x, Tensor) and x.dim() == 3 and B != T and tuple(x.shape[:2]) != (T, B):
        raise ValueError(
            f"{layer.name}: MegaBlocks router saw activations of shape {tuple(x.shape)}; it must be fed "
            f"(seq, batch, hidden) = ({T}, {B}, ...), dMoE's Megatron layout, for its rows to be t * B + b"
        )


def take_native_order(forced: Tensor, native: Tensor, keep_native: Tensor) -> Tensor:
    """`forced` (N, k) sorted ascending, with rows that equal the router's own choice as a set (or
    that `keep_native` marks) replaced by the router's `native` indices in the router's slot order.

    Slot order changes floating-point sums (weight normalisation, the experts' reduction over k),
    so replaying the router's own routes must present them in its own order to be bitwise exact.
    """
    same = (forced == native.sort(dim=-1).values).all(dim=-1, keepdim=True)
    return torch.where(same | keep_native, native, forced)


def filter_replayed(forced: Tensor, native: Tensor, scores: Tensor, ratio: float) -> tuple[Tensor, Tensor]:
    """Thresholded replay: keep a forced expert only where the live router still scores it highly.

    forced, native (N, k) expert ids (native in the router's slot order, best first); scores (N, E)
    the live router's selection scores. A forced expert e is kept where
    `scores[e] >= ratio * min_{j in native} scores[j]`; each rejected slot is refilled with the best
    live top-k expert not already kept, in the router's order. Returns the ids (N, k), distinct per
    row, and the (N, k) bool mask of the refilled slots.
    """
    weakest = scores.gather(-1, native).amin(dim=-1, keepdim=True)  # (N, 1)
    keep = scores.gather(-1, forced) >= ratio * weakest  # (N, k)
    kept_native = ((native[:, :, None] == forced[:, None, :]) & keep[:, None, :]).any(-1)  # (N, k)
    # live experts not kept, first, in the router's order (a stable sort on the kept flag)
    candidates = native.gather(-1, kept_native.to(torch.int8).argsort(dim=-1, stable=True))
    rank = (~keep).long().cumsum(dim=-1) - 1  # j-th rejected slot takes the j-th candidate
    refill = candidates.gather(-1, rank.clamp(min=0))
    return torch.where(keep, forced, refill), ~keep


def weights_in_order(ids: Tensor, sorted_ids: Tensor, sorted_weights: Tensor) -> Tensor:
    """`sorted_weights` (N, k), aligned with `sorted_ids`, permuted to the slot order of `ids` (the same
    set per row in another order)."""
    slot = (ids[:, :, None] == sorted_ids[:, None, :]).to(torch.int8).argmax(dim=-1)  # (N, k)
    return sorted_weights.gather(-1, slot)


class RouteHooks:
    """The route hooks of one model, registered once (`RouteHooks.of(model)`, the first time a route context opens
    on the model, or before it is compiled: `moe_rl.loop.compiled`): on each MoE layer's router a hook at the front
    of its hooks, which runs the contexts that change routes (replay, anchored routing), and one at the back, which
    runs the contexts that read them (recorders, which so see the forced routes); on the model a pre and a post hook
    that mark each pass's start and end for every open context.

    A context opens and closes by joining and leaving `front` or `back`, never by registering a hook: the model's
    hooks are the same whatever is open, so a compiled model's graphs guard on which contexts are open and on their
    state, and a context opened inside a traced frame breaks no graph. With no context open the hooks do nothing.
    The hooks are bound methods (the routers' through `functools.partial`), so a deep copy of the model carries a
    copy of them bound to the copy, with no context open."""

    ATTRIBUTE = "_moe_rl_route_hooks"

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = find_moe_layers(model)
        refuse_hub_kernels(model, self.layers)
        self.front: list[_RouteContext] = []  # entered last runs first, as a hook registered with prepend=True
        self.back: list[_RouteContext] = []
        for i, layer in enumerate(self.layers):
            layer.router.register_forward_hook(functools.partial(self._front, i), prepend=True)
            layer.router.register_forward_hook(functools.partial(self._back, i))
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(self._post, always_call=True)

    @classmethod
    def of(cls, model: nn.Module) -> RouteHooks:
        """`model`'s route hooks, registered on the first call."""
        hooks = model.__dict__.get(cls.ATTRIBUTE)
        if hooks is None:
            hooks = model.__dict__[cls.ATTRIBUTE] = cls(model)
        return hooks

    def __deepcopy__(self, memo: dict) -> RouteHooks:
        copied = RouteHooks.__new__(RouteHooks)
        memo[id(self)] = copied  # before the model, whose copy refers back to this one
        copied.model = copy.deepcopy(self.model, memo)
        copied.layers = copy.deepcopy(self.layers, memo)
        copied.front, copied.back = [], []
        return copied

    def attach(self, context: _RouteContext, *, front: bool) -> None:
        if context in self.front or context in self.back:
            raise RuntimeError(f"{type(context).__name__} is already open on this model")
        if front:
            self.front.insert(0, context)
        else:
            self.back.append(context)

    def detach(self, context: _RouteContext) -> None:
        for contexts in (self.front, self.back):
            if context in contexts:
                contexts.remove(context)

    def _front(self, i: int, router: nn.Module, args: tuple, output: tuple) -> tuple:
        for context in self.front:
            output = context.on_router(i, router, args, output)
        return output

    def _back(self, i: int, router: nn.Module, args: tuple, output: tuple) -> tuple:
        for context in self.back:
            output = context.on_router(i, router, args, output)
        return output

    # A pass's bookkeeping (records growing by one per KV-cache step, the applied-layer checks) runs eager under
    # `compile=true`: traced, each length of those lists would be a guard and every decode step a recompile.
    @torch._dynamo.disable
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        for context in [*self.front, *self.back]:
            context.in_pass = True
            context.begin_pass(args, kwargs)

    @torch._dynamo.disable
    def _post(self, module: nn.Module, args: tuple, output: object) -> None:
        for context in [*self.front, *self.back]:
            context.in_pass = False
            context.end_pass()


class _RouteContext:
    """A context open on a model's `RouteHooks`: `on_router` sees (and may replace) each MoE layer's router output,
    `begin_pass` and `end_pass` bracket each forward pass of the model; it leaves the hooks on exit, also when the
    body raises."""

    front = False  # changes routes: runs before the router's other hooks and before every reading context

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.hooks = RouteHooks.of(model)
        self.layers = self.hooks.layers
        refuse_hub_kernels(model, self.layers)
        self.in_pass = False

    def _attach(self) -> None:
        self.hooks.attach(self, front=self.front)

    def on_router(self, i: int, router: nn.Module, args: tuple, output: tuple) -> tuple:
        return output

    def begin_pass(self, args: tuple, kwargs: dict) -> None: ...

    def end_pass(self) -> None: ...

    def __exit__(self, *exc: object) -> None:
        self.hooks.detach(self)
        self.in_pass = False

    @property
    def layer_map(self) -> tuple[int, ...]:
        return tuple(layer.decoder_layer for layer in self.layers)

    @property
    def num_experts(self) -> int:
        return self.layers[0].num_experts


@dataclass
class _Record:
    """Routes of one sequence batch, as successive passes (prefill, then decode steps)."""

    passes: list[list[Tensor | None]] = field(default_factory=list)  # per pass, per layer: (B*T, k)
    masks: list[Tensor] = field(default_factory=list)  # per pass: (B, T)
    margins: list[list[Tensor | None]] = field(default_factory=list)
    scores: list[list[Tensor | None]] = field(default_factory=list)
    weights: list[list[Tensor | None]] = field(default_factory=list)


class RouteRecorder(_RouteContext):
    """Record the top-k expert ids of every MoE layer for every position of every forward pass.

    >>> with RouteRecorder(model) as rec:
    ...     out = model.generate(**batch)
    >>> rec.routes.indices.shape   # (B, T, L, k), T = out.shape[1] - 1

    A pass without a KV cache starts a new record; KV-cache continuations (`generate`'s decode
    steps) extend the current one along time. `routes` is the latest record, `records` all.
    Pad positions (attention_mask == 0) are masked. With `margins=True`, `margins` holds the gap
    between the k-th and (k+1)-th router probability per (B, T, L); with `scores=True`, `scores`
    holds the router's selection probabilities per (B, T, L, E) (for the router-shift metric); with
    `weights=True`, `weights` holds the combine weights the experts received, (B, T, L, k) float32,
    aligned with the ascending ids of `routes` (what `trr` replays); with `logits=True`, `logits` holds each layer's
    router logits of the latest pass as the router returned them (what transformers' `output_router_logits=True`
    returns, without asking the model for them).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        margins: bool = False,
        scores: bool = False,
        weights: bool = False,
        logits: bool = False,
    ) -> None:
        super().__init__(model)
        self._dtype = index_dtype(self.num_experts)
        self.record_margins = margins
        self.record_scores = scores
        self.record_weights = weights
        self.record_logits = logits
        self._records: list[_Record] = []

    def __enter__(self) -> RouteRecorder:
        self._attach()
        return self

    def begin_pass(self, args: tuple, kwargs: dict) -> None:
        B, T = _input_shape(args, kwargs)
        if not self._records or not _is_continuation(kwargs):
            self._records.append(_Record())
        record = self._records[-1]
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is not None and attention_mask.dim() == 2:
            mask = attention_mask[:, -T:].bool()
        else:
            mask = torch.ones(B, T, dtype=torch.bool, device=self.layers[0].weight.device)
        # The hooks write this pass's slots through these attributes, never by indexing the growing lists.
        self._mask: Tensor = mask
        self._pass: list[Tensor | None] = [None] * len(self.layers)
        self._pass_margins: list[Tensor | None] = [None] * len(self.layers)
        self._pass_scores: list[Tensor | None] = [None] * len(self.layers)
        self._pass_weights: list[Tensor | None] = [None] * len(self.layers)
        self._pass_logits: list[Tensor | None] = [None] * len(self.layers)
        record.masks.append(mask)
        record.passes.append(self._pass)
        record.margins.append(self._pass_margins)
        record.scores.append(self._pass_scores)
        record.weights.append(self._pass_weights)

    def on_router(self, i: int, router: nn.Module, args: tuple, output: tuple) -> tuple:
        if self.in_pass and self._pass[i] is None:  # not gradient-checkpointing recomputation, a call outside the
            self._record(i, router, args, output)  # model or a second call in one pass
        return output

    def _record(self, i: int, router: nn.Module, args: tuple, output: tuple) -> None:
        layer, current = self.layers[i], self._pass
        B, T = self._mask.shape
        if layer.seq_major:
            _check_seq_major_input(layer, args, B, T)
        logits, weights, indices = router_output(layer.name, router, output)
        current[i] = _batch_major(layer, indices.detach().to(self._dtype), B, T)  # compact at once
        if self.record_logits:
            self._pass_logits[i] = _batch_major(layer, logits.detach(), B, T)
        if self.record_weights:  # in the ascending id order of `routes`
            ordered = weights.detach().gather(-1, indices.argsort(dim=-1)).float()
            self._pass_weights[i] = _batch_major(layer, ordered, B, T)
        if self.record_margins or self.record_scores:
            scores = selection_scores(router, output[0].detach())
            if self.record_margins:
                self._pass_margins[i] = _batch_major(layer, router_margins(scores, layer.top_k), B, T)
            if self.record_scores:
                self._pass_scores[i] = _batch_major(layer, scores, B, T)

    @property
    def records(self) -> list[Routes]:
        return [self._assemble(r) for r in self._records]

    @property
    def routes(self) -> Routes:
        if not self._records:
            raise RuntimeError("RouteRecorder saw no forward pass")
        return self._assemble(self._records[-1])

    @property
    def margins(self) -> Tensor:
        """(B, T, L) float32 margins of the latest record (needs `margins=True`)."""
        if not self.record_margins:
            raise RuntimeError("construct RouteRecorder(model, margins=True) to record margins")
        record = self._records[-1]
        return _along_time(record.masks, record.margins)

    @property
    def scores(self) -> Tensor:
        """(B, T, L, E) float32 router selection probabilities of the latest record (needs `scores=True`)."""
        if not self.record_scores:
            raise RuntimeError("construct RouteRecorder(model, scores=True) to record router scores")
        record = self._records[-1]
        return _along_time(record.masks, record.scores)

    @property
    def weights(self) -> Tensor:
        """(B, T, L, k) float32 combine weights of the latest record, aligned with `routes.indices`
        (needs `weights=True`)."""
        if not self.record_weights:
            raise RuntimeError("construct RouteRecorder(model, weights=True) to record combine weights")
        record = self._records[-1]
        return _along_time(record.masks, record.weights)

    @property
    def logits(self) -> tuple[Tensor, ...]:
        """Per MoE layer, the router's logits (B*T, E) of the latest pass, rows batch-major (needs `logits=True`)."""
        if not self.record_logits:
            raise RuntimeError("construct RouteRecorder(model, logits=True) to record router logits")
        missing = [self.layers[i].name for i, x in enumerate(self._pass_logits) if x is None]
        if missing:
            raise RuntimeError(f"no router logits recorded for MoE layers {missing} in the latest pass")
        return tuple(x for x in self._pass_logits if x is not None)

    def _assemble(self, record: _Record) -> Routes:
        steps = []
        for p, (mask, per_layer) in enumerate(zip(record.masks, record.passes)):
            missing = [self.layers[i].name for i, x in enumerate(per_layer) if x is None]
            if missing:
                raise RuntimeError(
                    f"pass {p}: no route recorded for MoE layers {missing}; their router was bypassed "
                    "(e.g. a hub kernel that routes internally)"
                )
            B, T = mask.shape
            steps.append(torch.stack(per_layer, dim=1).view(B, T, len(self.layers), -1))
        mask = torch.cat([m.to(steps[0].device) for m in record.masks], dim=1)
        # Router outputs are in range by construction, so skip from_topk's range check.
        indices = sort_topk(torch.cat(steps, dim=1))  # compact dtype since the hook, now sorted
        return Routes._checked(indices, mask.bool(), self.layer_map, self.num_experts)


def _along_time(masks: list[Tensor], passes: list[list[Any]]) -> Tensor:
    """Per-pass, per-layer rows (B*T, ...) of a record -> one (B, T_total, L, ...) tensor along time."""
    steps = []
    for mask, per_layer in zip(masks, passes):
        B, T = mask.shape
        stacked = torch.stack(per_layer, dim=1)  # (B*T, L, ...)
        steps.append(stacked.view(B, T, *stacked.shape[1:]))
    return torch.cat(steps, dim=1)


def router_margins(scores: Tensor, k: int) -> Tensor:
    """Gap between the k-th and (k+1)-th largest router score along the last dim.

    Small margins predict route flips: a small update can swap the k-th and (k+1)-th expert. With every
    expert chosen (k = E, soft routing) no route can flip; the (k+1)-th score counts as 0, so the margin is
    the k-th score.
    """
    if k >= scores.shape[-1]:
        return scores.float().amin(dim=-1)
    top = scores.float().topk(k + 1, dim=-1).values
    return top[..., k - 1] - top[..., k]


class RouteReplay(_RouteContext):
    """Force `routes.indices` into every MoE layer; gate weights come from the live router.

    Only the indices are forced. The weights are recomputed from the router's logits at the forced
    indices by the family's own rule (`moe_rl.routing.gate_rules`), so gradients reach the router and a
    forced expert outside the live top-k keeps its true, non-zero weight. Masked positions keep
    their native routes. With `record_native=True`, `native_routes` is what the router would have
    chosen in the last pass (for `route/native_vs_replayed`).

    Every forward pass in the context must be a teacher-forced pass of the routes' (B, T): a pass
    that misses an MoE layer raises RuntimeError, mismatched shapes raise ValueError.

    `threshold=ratio` keeps a forced expert only where the live router's score on it is at least
    `ratio` times its weakest live top-k score (`filter_replayed`); `fallback` then counts the
    refilled slots and all slots over valid positions. `weights` (B, T, L, k), aligned with
    `routes.indices`, forces the combine weights too (Total Router Recall): they reach the experts
    bitwise (in the router's weight dtype), and the router's live weights enter only times 0, so its
    gradient is exactly zero while every parameter stays in the graph (DDP needs that).
    """

    front = True

    def __init__(
        self,
        model: nn.Module,
        routes: Routes,
        *,
        record_native: bool = False,
        threshold: float | None = None,
        weights: Tensor | None = None,
    ) -> None:
        super().__init__(model)
        self.routes = routes
        self.record_native = record_native
        if threshold is not None and weights is not None:
            raise ValueError("thresholded replay changes the ids, so recorded weights cannot be replayed with it")
        if weights is not None and tuple(weights.shape) != routes.shape:
            raise ValueError(f"weights shape {tuple(weights.shape)} != routes shape {routes.shape}")
        self.threshold = threshold
        self.weights = weights
        self._validate(routes)
        self.rules = [resolve_rule(layer) for layer in self.layers]
        self._applied: list[bool] = []
        self._native: list[Tensor | None] = []
        self.passes = 0
        self._fallback: list[Tensor] = []  # per pass and layer: (refilled slots, valid slots)

    def _validate(self, routes: Routes) -> None:
        B, T, L, k = routes.shape
        if L != len(self.layers):
            raise ValueError(f"routes have {L} MoE layers, the model has {len(self.layers)}")
        if routes.layer_map != self.layer_map:
            raise ValueError(f"routes layer_map {routes.layer_map} != model's MoE layers {self.layer_map}")
        for i, layer in enumerate(self.layers):
            if k != layer.top_k:
                raise ValueError(f"routes have k={k}, MoE layer {i} ({layer.name}) routes top_k={layer.top_k}")
        if routes.num_experts != self.num_experts:
            raise ValueError(f"routes are for num_experts={routes.num_experts}, the model has {self.num_experts}")
        # Over valid positions only, without gathering them (a boolean gather per pass was a visible
        # cost): the largest id, and whether any sorted top-k row repeats an id, in one transfer.
        valid = routes.mask[:, :, None, None]  # (B, T, 1, 1)
        ids = routes.indices
        top = torch.where(valid, ids, torch.zeros((), dtype=ids.dtype, device=ids.device)).amax() if ids.numel() else 0
        repeats = ((ids[..., 1:] == ids[..., :-1]) & valid).any() if k > 1 else torch.tensor(False)
        top, repeats = torch.stack([torch.as_tensor(top).long().cpu(), repeats.long().cpu()]).tolist()
        if top >= self.num_experts:
            raise ValueError(f"expert id {top} out of range for num_experts={self.num_experts}")
        if repeats:
            raise ValueError("routes repeat an expert within one position's top-k")

    def __enter__(self) -> RouteReplay:
        device = self.layers[0].weight.device
        B, T, L, k = self.routes.shape
        forced = self.routes.indices.to(device=device, dtype=torch.int64)  # (B, T, L, k)
        self._forced = [forced[:, :, i].reshape(B * T, k) for i in range(L)]
        self._keep_native = ~self.routes.mask.to(device).reshape(B * T, 1)
        self._weights: list[Tensor] = []
        if self.weights is not None:
            w = self.weights.to(device=device, dtype=torch.float32)
            self._weights = [w[:, :, i].reshape(B * T, k) for i in range(L)]
        if any(layer.seq_major for layer in self.layers):  # the same rows in MegaBlocks' t * B + b order
            self._forced_seq = [rows_to_seq_major(f, B, T) for f in self._forced]
            self._keep_native_seq = rows_to_seq_major(self._keep_native, B, T)
            self._weights_seq = [rows_to_seq_major(w, B, T) for w in self._weights]
        self._attach()  # at the front: every recorder then sees the forced routes
        return self

    def begin_pass(self, args: tuple, kwargs: dict) -> None:
        B, T = _input_shape(args, kwargs)
        rb, rt = self.routes.shape[:2]
        if _is_continuation(kwargs):
            raise ValueError("RouteReplay covers whole teacher-forced passes, not KV-cache continuations")
        if B != rb:
            raise ValueError(f"batch size {B} != routes batch size {rb}")
        if T != rt:
            raise ValueError(f"sequence length {T} != routes sequence length {rt}")
        self._applied = [False] * len(self.layers)
        self._native = [None] * len(self.layers)

    def end_pass(self) -> None:
        missing = [self.layers[i].name for i, done in enumerate(self._applied) if not done]
        if missing:
            raise RuntimeError(f"routing replay was armed but not applied to MoE layers {missing}")
        self.passes += 1

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if exc[0] is None and self.passes == 0:
            raise RuntimeError("routing replay was armed but no forward pass ran inside it")

    def on_router(self, i: int, router: nn.Module, args: tuple, output: tuple) -> tuple:
        layer = self.layers[i]
        logits, weights, native = router_output(layer.name, router, output)  # MegaBlocks: softmax scores
        rule = self.rules[i]
        if rule is None:
            rule = self.rules[i] = check_rule_on_output(layer, output)
        B, T = self.routes.shape[:2]
        if layer.seq_major:
            _check_seq_major_input(layer, args, B, T)
            forced, keep_native = self._forced_seq[i], self._keep_native_seq
            recorded = self._weights_seq[i] if self._weights else None
        else:
            forced, keep_native = self._forced[i], self._keep_native
            recorded = self._weights[i] if self._weights else None
        if forced.shape[0] != logits.shape[0]:
            raise ValueError(f"{layer.name}: router saw {logits.shape[0]} tokens, routes hold {forced.shape[0]}")
        sorted_forced = forced
        if self.threshold is not None:
            scores = selection_scores(router, logits.detach())
            live = native.long()
            forced = torch.where(keep_native, live, forced)  # masked rows may hold any id: never gather them
            forced, refilled = filter_replayed(forced, live, scores, self.threshold)
            forced = sort_topk(forced)  # take_native_order compares sorted rows
            if self.in_pass and not self._applied[i]:
                valid = ~keep_native
                self._fallback.append(torch.stack([(refilled & valid).sum(), valid.sum() * forced.shape[1]]))
        forced = take_native_order(forced, native, keep_native)
        new_weights = rule(router, logits, forced).to(weights.dtype)
        if recorded is not None:  # Total Router Recall: the recorded weights, with a zero-gradient path
            replayed = weights_in_order(forced, sorted_forced, recorded).to(weights.dtype) + 0.0 * new_weights
            new_weights = torch.where(keep_native, new_weights, replayed)
        if self.in_pass:
            self._applied[i] = True
            if self.record_native and self._native[i] is None:
                self._native[i] = _batch_major(layer, native.detach(), B, T)
        return logits, new_weights, forced.to(native.dtype)

    @property
    def fallback(self) -> Tensor:
        """Thresholded replay: int64 (refilled slots, valid slots) summed over this context's passes and
        layers (zeros without a threshold)."""
        if not self._fallback:
            return torch.zeros(2, dtype=torch.int64)
        return torch.stack(self._fallback).sum(dim=0).cpu()

    @property
    def native_routes(self) -> Routes:
        """What the router would have chosen in the last pass, on the replayed routes' mask."""
        if not self.record_native or any(x is None for x in self._native):
            raise RuntimeError("construct RouteReplay(..., record_native=True) and run a forward pass")
        B, T = self.routes.shape[:2]
        topk = torch.stack(self._native, dim=1).view(B, T, len(self.layers), -1)
        # The router's own top-k ids are in range by construction: compact and sort, skip the checks.
        indices = sort_topk(topk.to(index_dtype(self.num_experts)))
        return Routes._checked(indices, self.routes.mask, self.layer_map, self.num_experts)


class RoutedPass:
    """One recorded forward pass, replaying `routes` when given (None: the router's own routes).

    `used` are the routes the experts received (the recorder runs after the replay hook) and
    `weights` their combine weights when asked for, `native` what the router itself would have chosen, `margins` its k-th vs (k+1)-th gaps and `scores` its
    selection probabilities when asked for (both are the live router's, whatever was replayed).
    """

    def __init__(
        self,
        model: nn.Module,
        routes: Routes | None = None,
        *,
        margins: bool = False,
        scores: bool = False,
        weights: bool = False,
        logits: bool = False,
        threshold: float | None = None,
        replay_weights: Tensor | None = None,
    ) -> None:
        self.replay = (
            RouteReplay(model, routes, record_native=True, threshold=threshold, weights=replay_weights)
            if routes is not None
            else None
        )
        self.recorder = RouteRecorder(model, margins=margins, scores=scores, weights=weights, logits=logits)
        self._stack = ExitStack()

    def __enter__(self) -> RoutedPass:
        if self.replay is not None:
            self._stack.enter_context(self.replay)
        self._stack.enter_context(self.recorder)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stack.__exit__(*exc)

    @property
    def used(self) -> Routes:
        return self.recorder.routes

    @property
    def native(self) -> Routes:
        return self.replay.native_routes if self.replay is not None else self.recorder.routes

    @property
    def margins(self) -> Tensor:
        return self.recorder.margins

    @property
    def scores(self) -> Tensor:
        return self.recorder.scores

    @property
    def weights(self) -> Tensor:
        """The combine weights the experts received, aligned with `used` (needs `weights=True`)."""
        return self.recorder.weights

    @property
    def logits(self) -> tuple[Tensor, ...]:
        """Per MoE layer, the router's logits of the pass (needs `logits=True`)."""
        return self.recorder.logits

    @property
    def fallback(self) -> Tensor:
        """(refilled slots, valid slots) of a thresholded replay (zeros otherwise)."""
        return self.replay.fallback if self.replay is not None else torch.zeros(2, dtype=torch.int64)
