"""Route recording and Routing Replay as context managers over a transformers v5 MoE model.

Both hook the router module of every MoE layer, which in transformers v5 returns
`(logits, weights, indices)` and whose outputs feed the experts. MegaBlocks' `LearnedRouter` returns
`(scores, weights, indices)` with `scores` already softmax probabilities, and its rows in
sequence-major order (`t * B + b`, dMoE's Megatron `(seq, batch, hidden)` layout): such a layer is
marked `seq_major` and its rows are permuted to and from batch-major here. A hook on the model itself marks
the start and end of each forward pass, which gives three guarantees:
- a route is recorded once per layer per pass, so gradient-checkpointing recomputation during
  backward (which runs outside any pass) never double-records;
- a replay that did not reach every MoE layer in a pass raises instead of silently doing nothing;
- routes of successive KV-cache calls (`generate`) are assembled along time into one record.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from moe_rl.routing.routes import Routes, index_dtype, sort_topk
from moe_rl.routing.rules import FAMILY_RULES, GENERIC_RULES, Rule, selection_scores


class UnsupportedRouterError(ValueError):
    """The harness cannot record or replay this router; the message names its class and why."""

    def __init__(self, router: str, reason: str, name: str = "") -> None:
        self.router, self.reason, self.name = router, reason, name
        where = f"router {name} ({router})" if name else f"router {router}"
        super().__init__(f"{where}: {reason}" if router else reason)


@dataclass
class MoeLayer:
    name: str  # module path of the router, e.g. "model.layers.3.mlp.gate"
    router: nn.Module
    decoder_layer: int
    num_experts: int
    top_k: int
    seq_major: bool = False  # router rows are t * B + b (MegaBlocks' (seq, batch, hidden)), not b * T + t

    @property
    def weight(self) -> Tensor:
        """The router's (num_experts, hidden) weight."""
        return router_weight(self.router)


# MegaBlocks (megablocks/layers/router.py): `LearnedRouter(args)` keeps its config in `args`
# (`moe_num_experts`, `moe_top_k`, `moe_normalize_expert_weights`) and its weight in `layer`.
MEGABLOCKS_ROUTERS = ("LearnedRouter",)


def is_megablocks_router(module: nn.Module) -> bool:
    args = getattr(module, "args", None)
    return type(module).__name__ in MEGABLOCKS_ROUTERS and all(
        hasattr(args, key) for key in ("moe_top_k", "moe_num_experts", "moe_normalize_expert_weights")
    )


def router_weight(router: nn.Module) -> Tensor:
    """The router's (num_experts, hidden) weight: `.weight` for most families, the one linear it
    wraps otherwise (MegaBlocks' `layer`, HunYuan-MoE's `wg`)."""
    if is_megablocks_router(router):
        return router.layer.weight
    weight = getattr(router, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return weight
    matrices = [p for p in router.parameters() if p.dim() == 2]
    num_experts = getattr(router, "num_experts", None)
    if num_experts is not None and any(p.shape[0] == num_experts for p in matrices):
        matrices = [p for p in matrices if p.shape[0] == num_experts]
    if len(matrices) != 1:
        raise UnsupportedRouterError(
            type(router).__name__, f"no single (num_experts, hidden) weight found ({len(matrices)} candidates)"
        )
    return matrices[0]


def _router_classes(model: nn.Module) -> tuple[type, ...]:
    """Router classes the model declares through v5's `_can_record_outputs["router_logits"]`."""
    recorder = getattr(model, "_can_record_outputs", None) or {}
    spec = recorder.get("router_logits")
    specs = spec if isinstance(spec, (list, tuple)) else [spec]
    return tuple(s.target_class for s in specs if getattr(s, "target_class", None) is not None)


_LAYER_CACHE: weakref.WeakKeyDictionary[nn.Module, list[MoeLayer]] = weakref.WeakKeyDictionary()


def find_moe_layers(model: nn.Module) -> list[MoeLayer]:
    """The router module of every MoE layer, in model order. Raises if the model has none.

    Cached per model (walking every module costs more than a tiny forward's hooks) and
    re-discovered whenever a cached router is no longer the module at its path.
    """
    cached = _LAYER_CACHE.get(model)
    if cached is not None and all(_submodule(model, layer.name) is layer.router for layer in cached):
        return list(cached)
    layers = _discover_moe_layers(model)
    _LAYER_CACHE[model] = layers
    return list(layers)


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _discover_moe_layers(model: nn.Module) -> list[MoeLayer]:
    declared = _router_classes(model)
    layers = []
    for name, module in model.named_modules():
        megablocks = is_megablocks_router(module)  # found also where the model declares other router classes
        is_router = isinstance(module, declared) if declared else type(module).__name__.endswith(("Router", "TopkRouter"))
        if not (is_router or megablocks):
            continue
        match = re.search(r"layers\.(\d+)\.", name)
        if megablocks:
            num_experts, top_k = module.args.moe_num_experts, module.args.moe_top_k
        else:
            # The router's output width, where its weight is found: it also counts ids that are no
            # parameterised expert (LongCat-Flash's zero experts).
            try:
                num_experts = router_weight(module).shape[0]
            except UnsupportedRouterError:
                num_experts = getattr(module, "num_experts", None)
            top_k = getattr(module, "top_k", None)
        if match is None or num_experts is None or top_k is None:
            missing = [w for w, v in (("a layer index in its path", match), ("num_experts", num_experts),
                                      ("top_k", top_k)) if v is None]
            raise UnsupportedRouterError(type(module).__name__, f"lacks {', '.join(missing)}", name)
        layers.append(MoeLayer(name, module, int(match.group(1)), int(num_experts), int(top_k), seq_major=megablocks))
    if not layers:
        declared_names = [c.__name__ for c in declared]
        raise UnsupportedRouterError(
            "/".join(declared_names) or "*Router",
            f"{type(model).__name__} has no MoE layer (no module of the declared router class, nor one named "
            "*Router, with a layer index, num_experts and top_k)",
        )
    return layers


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


def hub_kernel_of(module: nn.Module) -> str | None:
    """The hub kernel whose forward replaced `module`'s own, else None.

    transformers marks kernel-capable classes with `use_kernel_forward_from_hub(name)`, which sets
    the class attribute `kernel_layer_name`; `kernels.kernelize` (run by `use_kernels=True`) then sets
    the instance attribute `forward = MethodType(kernel.forward, module)`, or the class's own forward
    when it falls back.
    """
    name = getattr(type(module), "kernel_layer_name", None)
    forward = module.__dict__.get("forward")
    if name is None or forward is None or getattr(forward, "__func__", forward) is type(module).forward:
        return None
    return str(name)


def _path_modules(model: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """(path, module) of `model` and every module above `name` on its path, outermost first, in one
    walk (hooks are set up once per pass, so `get_submodule` per depth was a visible cost)."""
    parts = name.split(".")
    out, module = [("", model)], model
    for depth in range(1, len(parts)):
        module = module.get_submodule(parts[depth - 1])
        out.append((".".join(parts[:depth]), module))
    return out


def _refuse_hub_kernels(model: nn.Module, layers: list[MoeLayer]) -> None:
    """Raise if a module around a router runs a hub kernel: it routes internally (e.g. GPT-OSS's
    `MegaBlocksMoeMLP` under `use_kernels=True`), so hooks on the router would see nothing."""
    for layer in layers:
        for owner, module in reversed(_path_modules(model, layer.name)):  # innermost first
            kernel = hub_kernel_of(module)
            if kernel is not None:
                raise RuntimeError(
                    f"MoE block {owner or '<model>'} ({type(module).__name__}) runs "
                    f"the hub kernel {kernel!r} (transformers `use_kernels=True`), which routes internally and "
                    f"never calls its router {layer.name}: routes can be neither recorded nor replayed. Load the "
                    "model without `use_kernels=True`."
                )


def rows_to_batch_major(rows: Tensor, B: int, T: int) -> Tensor:
    """(T*B, ...) rows in sequence-major order (t * B + b) -> (B*T, ...) batch-major (b * T + t)."""
    return rows.reshape(T, B, *rows.shape[1:]).transpose(0, 1).reshape(B * T, *rows.shape[1:])


def rows_to_seq_major(rows: Tensor, B: int, T: int) -> Tensor:
    """(B*T, ...) batch-major rows -> (T*B, ...) sequence-major, the inverse of `rows_to_batch_major`."""
    return rows.reshape(B, T, *rows.shape[1:]).transpose(0, 1).reshape(T * B, *rows.shape[1:])


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


class _ModelHooks:
    """Registers hooks on enter and always removes them on exit, also when the body raises."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = find_moe_layers(model)
        _refuse_hub_kernels(model, self.layers)
        self._handles: list[RemovableHandle] = []
        self.in_pass = False

    def _hook_layers(self, hook_for_layer, prepend: bool = False) -> None:
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.router.register_forward_hook(hook_for_layer(i), prepend=prepend))
        self._handles.append(self.model.register_forward_pre_hook(self._pre, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._post, always_call=True))

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.in_pass = True
        self.begin_pass(args, kwargs)

    def _post(self, module: nn.Module, args: tuple, output: object) -> None:
        self.in_pass = False
        self.end_pass()

    def begin_pass(self, args: tuple, kwargs: dict) -> None: ...

    def end_pass(self) -> None: ...

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
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


class RouteRecorder(_ModelHooks):
    """Record the top-k expert ids of every MoE layer for every position of every forward pass.

    >>> with RouteRecorder(model) as rec:
    ...     out = model.generate(**batch)
    >>> rec.routes.indices.shape   # (B, T, L, k), T = out.shape[1] - 1

    A pass without a KV cache starts a new record; KV-cache continuations (`generate`'s decode
    steps) extend the current one along time. `routes` is the latest record, `records` all.
    Pad positions (attention_mask == 0) are masked. With `margins=True`, `margins` holds the gap
    between the k-th and (k+1)-th router probability per (B, T, L); with `scores=True`, `scores`
    holds the router's selection probabilities per (B, T, L, E) (for the router-shift metric).
    """

    def __init__(self, model: nn.Module, *, margins: bool = False, scores: bool = False) -> None:
        super().__init__(model)
        self._dtype = index_dtype(self.num_experts)
        self.record_margins = margins
        self.record_scores = scores
        self._records: list[_Record] = []

    def __enter__(self) -> RouteRecorder:
        self._hook_layers(self._make_hook)
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
        record.masks.append(mask)
        record.passes.append([None] * len(self.layers))
        record.margins.append([None] * len(self.layers))
        record.scores.append([None] * len(self.layers))

    def _make_hook(self, i: int):
        def hook(router: nn.Module, args: tuple, output: tuple) -> None:
            if not self.in_pass:  # gradient-checkpointing recomputation or a call outside the model
                return
            record, layer = self._records[-1], self.layers[i]
            current = record.passes[-1]
            if current[i] is not None:
                return
            B, T = record.masks[-1].shape
            if layer.seq_major:
                _check_seq_major_input(layer, args, B, T)
            indices = _router_output(layer.name, router, output)[2]
            current[i] = _batch_major(layer, indices.detach().to(self._dtype), B, T)  # compact at once
            if self.record_margins or self.record_scores:
                scores = selection_scores(router, output[0].detach())
                if self.record_margins:
                    record.margins[-1][i] = _batch_major(layer, router_margins(scores, layer.top_k), B, T)
                if self.record_scores:
                    record.scores[-1][i] = _batch_major(layer, scores, B, T)

        return hook

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


def _along_time(masks: list[Tensor], passes: list[list[Tensor]]) -> Tensor:
    """Per-pass, per-layer rows (B*T, ...) of a record -> one (B, T_total, L, ...) tensor along time."""
    steps = []
    for mask, per_layer in zip(masks, passes):
        B, T = mask.shape
        stacked = torch.stack(per_layer, dim=1)  # (B*T, L, ...)
        steps.append(stacked.view(B, T, *stacked.shape[1:]))
    return torch.cat(steps, dim=1)


def router_margins(scores: Tensor, k: int) -> Tensor:
    """Gap between the k-th and (k+1)-th largest router score along the last dim.

    Small margins predict route flips: a small update can swap the k-th and (k+1)-th expert.
    """
    top = scores.float().topk(k + 1, dim=-1).values
    return top[..., k - 1] - top[..., k]


class RouteReplay(_ModelHooks):
    """Force `routes.indices` into every MoE layer; gate weights come from the live router.

    Only the indices are forced. The weights are recomputed from the router's logits at the forced
    indices by the family's own rule (`moe_rl.routing.rules`), so gradients reach the router and a
    forced expert outside the live top-k keeps its true, non-zero weight. Masked positions keep
    their native routes. With `record_native=True`, `native_routes` is what the router would have
    chosen in the last pass (for `route/native_vs_replayed`).

    Every forward pass in the context must be a teacher-forced pass of the routes' (B, T): a pass
    that misses an MoE layer raises RuntimeError, mismatched shapes raise ValueError.
    """

    def __init__(self, model: nn.Module, routes: Routes, *, record_native: bool = False) -> None:
        super().__init__(model)
        self.routes = routes
        self.record_native = record_native
        self._validate(routes)
        self.rules = [resolve_rule(layer) for layer in self.layers]
        self._applied: list[bool] = []
        self._native: list[Tensor | None] = []
        self.passes = 0

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
        if any(layer.seq_major for layer in self.layers):  # the same rows in MegaBlocks' t * B + b order
            self._forced_seq = [rows_to_seq_major(f, B, T) for f in self._forced]
            self._keep_native_seq = rows_to_seq_major(self._keep_native, B, T)
        self._hook_layers(self._make_hook, prepend=True)  # before any recorder, which then sees forced routes
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

    def __exit__(self, exc_type: object, *exc: object) -> None:
        super().__exit__(exc_type, *exc)
        if exc_type is None and self.passes == 0:
            raise RuntimeError("routing replay was armed but no forward pass ran inside it")

    def _make_hook(self, i: int):
        layer = self.layers[i]

        def hook(router: nn.Module, args: tuple, output: tuple) -> tuple:
            logits, weights, native = _router_output(layer.name, router, output)  # MegaBlocks: softmax scores
            rule = self.rules[i] if self.rules[i] is not None else check_rule_on_output(layer, output)
            self.rules[i] = rule
            B, T = self.routes.shape[:2]
            if layer.seq_major:
                _check_seq_major_input(layer, args, B, T)
                forced, keep_native = self._forced_seq[i], self._keep_native_seq
            else:
                forced, keep_native = self._forced[i], self._keep_native
            if forced.shape[0] != logits.shape[0]:
                raise ValueError(f"{layer.name}: router saw {logits.shape[0]} tokens, routes hold {forced.shape[0]}")
            forced = take_native_order(forced, native, keep_native)
            new_weights = rule(router, logits, forced).to(weights.dtype)
            if self.in_pass:
                self._applied[i] = True
                if self.record_native and self._native[i] is None:
                    self._native[i] = _batch_major(layer, native.detach(), B, T)
            return logits, new_weights, forced.to(native.dtype)

        return hook

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

    `used` are the routes the experts received (the recorder runs after the replay hook), `native`
    what the router itself would have chosen, `margins` its k-th vs (k+1)-th gaps and `scores` its
    selection probabilities when asked for (both are the live router's, whatever was replayed).
    """

    def __init__(
        self, model: nn.Module, routes: Routes | None = None, *, margins: bool = False, scores: bool = False
    ) -> None:
        self.replay = RouteReplay(model, routes, record_native=True) if routes is not None else None
        self.recorder = RouteRecorder(model, margins=margins, scores=scores)
        self._stack = ExitStack()

    def __enter__(self) -> RoutedPass:
        if self.replay is not None:
            self._stack.enter_context(self.replay)
        self._stack.enter_context(self.recorder)
        return self

    def __exit__(self, *exc: object) -> bool | None:
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


_CHECKED_RULES: weakref.WeakKeyDictionary[nn.Module, Rule] = weakref.WeakKeyDictionary()


def _router_output(layer_name: str, router: nn.Module, output: object) -> tuple[Tensor, Tensor, Tensor]:
    """`output` as the v5 router contract `(logits, weights, indices)`, or UnsupportedRouterError."""
    if not (isinstance(output, tuple) and len(output) == 3 and all(isinstance(x, Tensor) for x in output)):
        kind = f"a {len(output)}-tuple" if isinstance(output, tuple) else type(output).__name__
        raise UnsupportedRouterError(
            type(router).__name__, f"returns {kind}, not (logits, weights, indices): its routes cannot be "
            "read or forced at the router", layer_name,
        )
    logits, weights, indices = output
    if indices.is_floating_point() or indices.dim() != 2 or weights.shape != indices.shape:
        raise UnsupportedRouterError(
            type(router).__name__, f"returns indices {tuple(indices.shape)} {indices.dtype} and weights "
            f"{tuple(weights.shape)}, not (tokens, k) integer ids with matching weights", layer_name,
        )
    return logits, weights, indices


def pick_rule(router: nn.Module, logits: Tensor, weights: Tensor, indices: Tensor,
              candidates: tuple[Rule, ...]) -> Rule | None:
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
        type(router).__name__, f"no gate-weight rule reproduces its weights at its own indices (tried "
        f"{[rule.__name__ for rule in candidates]}); replay would train a different function", layer_name,
    )


def check_rule_on_output(layer: MoeLayer, output: object) -> Rule:
    """Resolve `layer`'s rule from one real router call (for routers a synthetic probe cannot call,
    e.g. LFM2-MoE's, which takes the MoE block's expert bias as a second input)."""
    router = layer.router
    if router in _CHECKED_RULES:
        return _CHECKED_RULES[router]
    logits, weights, indices = _router_output(layer.name, router, output)
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
