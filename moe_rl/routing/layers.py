"""Where the routers are: every MoE layer's router module, its shape and its row order.

`find_moe_layers(model)` finds the router of every MoE layer of a transformers v5 model (the router
classes the model declares, else modules named `*Router`) and of MegaBlocks dMoE blocks, in model
order, with the decoder-layer index, expert count and k of each. In transformers v5 a router
returns `(logits, weights, indices)` (`router_output` checks that contract); MegaBlocks'
`LearnedRouter` returns `(scores, weights, indices)` with softmax probabilities as `scores` and its
rows in sequence-major order (`t * B + b`, dMoE's Megatron `(seq, batch, hidden)` layout): such a
layer is marked `seq_major`, and `rows_to_batch_major` / `rows_to_seq_major` convert between the two
orders. A hub kernel that routes inside the MoE block, never calling its router, is refused
(`refuse_hub_kernels`), because hooks on the router would see nothing.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

from torch import Tensor, nn


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


def returns_router_logits(model: nn.Module) -> bool:
    """Whether transformers returns this model's router logits (`output_router_logits=True`): its MoE layers'
    routers are of the classes it declares (a MegaBlocks router is not)."""
    declared = _router_classes(model)
    layers = find_moe_layers(model, required=False)
    return bool(declared and layers) and all(isinstance(layer.router, declared) for layer in layers)


_LAYER_CACHE: weakref.WeakKeyDictionary[nn.Module, list[MoeLayer]] = weakref.WeakKeyDictionary()


def find_moe_layers(model: nn.Module, *, required: bool = True) -> list[MoeLayer]:
    """The router module of every MoE layer, in model order. Raises if the model has none, unless
    `required=False` (a dense model: []).

    Cached per model (walking every module costs more than a tiny forward's hooks) and
    re-discovered whenever a cached router is no longer the module at its path.
    """
    layers = _LAYER_CACHE.get(model)
    if layers is None or not all(_submodule(model, layer.name) is layer.router for layer in layers):
        layers = _LAYER_CACHE[model] = _discover_moe_layers(model)
    if not layers and required:
        declared_names = [c.__name__ for c in _router_classes(model)]
        raise UnsupportedRouterError(
            "/".join(declared_names) or "*Router",
            f"{type(model).__name__} has no MoE layer (no module of the declared router class, nor one named "
            "*Router, with a layer index, num_experts and top_k)",
        )
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
        is_router = (
            isinstance(module, declared) if declared else type(module).__name__.endswith(("Router", "TopkRouter"))
        )
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
            missing = [
                w
                for w, v in (("a layer index in its path", match), ("num_experts", num_experts), ("top_k", top_k))
                if v is None
            ]
            raise UnsupportedRouterError(type(module).__name__, f"lacks {', '.join(missing)}", name)
        layers.append(MoeLayer(name, module, int(match.group(1)), int(num_experts), int(top_k), seq_major=megablocks))
    return layers


def router_output(layer_name: str, router: nn.Module, output: object) -> tuple[Tensor, Tensor, Tensor]:
    """`output` as the v5 router contract `(logits, weights, indices)`, or UnsupportedRouterError."""
    if not (isinstance(output, tuple) and len(output) == 3 and all(isinstance(x, Tensor) for x in output)):
        kind = f"a {len(output)}-tuple" if isinstance(output, tuple) else type(output).__name__
        raise UnsupportedRouterError(
            type(router).__name__,
            f"returns {kind}, not (logits, weights, indices): its routes cannot be read or forced at the router",
            layer_name,
        )
    logits, weights, indices = output
    if indices.is_floating_point() or indices.dim() != 2 or weights.shape != indices.shape:
        raise UnsupportedRouterError(
            type(router).__name__,
            f"returns indices {tuple(indices.shape)} {indices.dtype} and weights "
            f"{tuple(weights.shape)}, not (tokens, k) integer ids with matching weights",
            layer_name,
        )
    return logits, weights, indices


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


def refuse_hub_kernels(model: nn.Module, layers: list[MoeLayer]) -> None:
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
