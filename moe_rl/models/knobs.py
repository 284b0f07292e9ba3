"""Router and expert knobs of the RL phase: a frozen router, a float64 router, per-part learning rates.

Frameworks disagree on what the router does during RL fine-tuning: NeMo-RL freezes it and keeps it in
float64, verl's Megatron path freezes Qwen-MoE routers, NeMo Automodel scales its learning rate (0.1),
prime-rl routes in float32. These functions set each one on a built model, after its cold start (so
every rung of an ablation starts from the same weights), and find the parts through the MoE layer
discovery (`moe_rl.routing.find_moe_layers`), not by parameter names:

- the routers: every parameter of each MoE layer's router module;
- the experts: every parameter of the `experts` module beside each router (the routed experts; a
  shared expert, like Qwen2-MoE's, counts with the rest: every token passes through it), addressable one
  expert at a time when they are packed (E, ...) tensors or E modules (`expert_rows`);
- a dense model's MLPs: every parameter of each decoder layer's `mlp` module (the dense control's
  counterpart of the experts, `optim.mlp_lr_scale`).

`moe_rl.config.validate` refuses a knob for a family that lacks its piece (a dense model has no router)
before any work; the functions here raise the same way for a model from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from moe_rl.routing import find_moe_layers
from moe_rl.routing.layers import MoeLayer, is_megablocks_router

ROUTER_DTYPES = ("float32", "float64")
# Families whose ForCausalLM returns transformers' load-balancing loss (`aux_loss`) with
# `output_router_logits=True` (DeepSeek-V3 balances with a selection bias and returns none).
AUX_LOSS_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")
# Families with a softmax router, whose logits ST-MoE's z-loss bounds (DeepSeek-V3 scores by sigmoid).
Z_LOSS_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")
# Families whose router computes in its weights' dtype (DeepSeek-V3 casts input and weight to float32).
FLOAT64_ROUTER_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")


def _experts_of(model: nn.Module, layer: MoeLayer) -> nn.Module:
    """The routed experts beside `layer`'s router: the `experts` module of the block that holds it."""
    block = model.get_submodule(layer.name.rsplit(".", 1)[0])
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module):
        raise ValueError(f"{layer.name}: no `experts` module beside the router (its MoE block has none)")
    return experts


def _moe_layers(model: nn.Module, knob: str) -> list[MoeLayer]:
    layers = find_moe_layers(model, required=False)
    if not layers:
        raise ValueError(
            f"{knob} acts on MoE layers, but {type(model).__name__} has none (a dense model has no router)"
        )
    return layers


def router_parameters(model: nn.Module, knob: str = "the router knobs") -> list[nn.Parameter]:
    """Every parameter of every MoE layer's router, in model order (ValueError naming `knob` for a dense model)."""
    return [p for layer in _moe_layers(model, knob) for p in layer.router.parameters()]


def expert_parameters(model: nn.Module, knob: str = "the expert knobs") -> list[nn.Parameter]:
    """Every parameter of every MoE layer's routed experts, in model order (ValueError for a dense model)."""
    return [p for layer in _moe_layers(model, knob) for p in _experts_of(model, layer).parameters()]


def _expert_layout(model: nn.Module, layer: MoeLayer, knob: str) -> tuple[list[nn.Parameter], list[nn.Module]]:
    """`layer`'s routed experts as packed (E, ...) parameters (transformers v5: `gate_up_proj` (E, 2I, H),
    `down_proj` (E, H, I)) or as E expert modules (the other list empty); ValueError naming `knob` otherwise."""
    experts, E = _experts_of(model, layer), layer.num_experts
    packed = list(experts.parameters(recurse=False))
    modules = [m for m in experts.children() if any(True for _ in m.parameters())]
    if packed and not modules and all(p.shape[0] == E for p in packed):
        return packed, []
    if not packed and len(modules) == E:
        return [], modules
    raise ValueError(
        f"{knob} cannot address {layer.name}'s experts one by one: {type(experts).__name__} holds neither "
        f"packed (E, ...) tensors nor {E} expert modules"
    )


def expert_weights(model: nn.Module, gather: Callable[[Tensor], Tensor] = Tensor.detach) -> list[Tensor]:
    """Per MoE layer, copies of its routed experts' weights, one row per expert: (E, n).

    Packed experts are split along their first dimension; a list of expert modules (one per expert) gives
    each module's parameters as a row. `gather` makes a parameter whole (an FSDP2 shard gathered).
    ValueError for experts held otherwise."""
    stacks = []
    for layer in _moe_layers(model, "optim/expert_step"):
        packed, modules = _expert_layout(model, layer, "optim/expert_step")
        E = layer.num_experts
        if packed:
            stacks.append(torch.cat([gather(p).reshape(E, -1) for p in packed], dim=1))
        else:
            stacks.append(torch.stack([torch.cat([gather(p).reshape(-1) for p in m.parameters()]) for m in modules]))
    return stacks


def expert_rows(model: nn.Module, knob: str = "optim.expert_step") -> list[list[tuple[nn.Parameter, int | None]]]:
    """Per MoE layer, each routed-expert parameter with the expert it belongs to: None for a packed (E, ...)
    tensor (its row e is expert e's), e for a parameter of expert module e. ValueError naming `knob` for a
    dense model or experts held otherwise."""
    rows = []
    for layer in _moe_layers(model, knob):
        packed, modules = _expert_layout(model, layer, knob)
        row: list[tuple[nn.Parameter, int | None]] = [(p, None) for p in packed]
        rows.append(row + [(p, e) for e, m in enumerate(modules) for p in m.parameters()])
    return rows


def mlp_parameters(model: nn.Module, knob: str = "optim.mlp_lr_scale") -> list[nn.Parameter]:
    """Every parameter of a dense model's MLPs (each decoder layer's `mlp` module), in model order; ValueError
    naming `knob` for a model with MoE layers (its MLPs are experts and routers) or without `mlp` modules."""
    if find_moe_layers(model, required=False):
        raise ValueError(
            f"{knob} scales a dense model's MLPs; {type(model).__name__} routes its MLPs to experts "
            "(use optim.expert_lr_scale and optim.router_lr_scale)"
        )
    params = [p for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp" for p in m.parameters()]
    if not params:
        raise ValueError(f"{knob}: {type(model).__name__} has no `mlp` module in its decoder layers")
    return params


def freeze_routers(model: nn.Module) -> list[nn.Parameter]:
    """`model.router_frozen`: the routers take no gradient (requires_grad False), so they keep the values
    they have (the cold start's) while the rest trains; returns the frozen parameters."""
    params = router_parameters(model, "model.router_frozen")
    for p in params:
        p.requires_grad_(False)
    return params


def param_groups(
    model: nn.Module,
    lr: float,
    *,
    router_lr_scale: float = 1.0,
    expert_lr_scale: float = 1.0,
    mlp_lr_scale: float = 1.0,
) -> list[dict[str, Any]]:
    """Optimizer parameter groups at `lr` x each part's scale: routers, experts, a dense model's MLPs, the rest.

    Every scale 1.0: one group of every parameter in model order, the optimizer the loop always built
    (so default runs and their checkpoints are unchanged). Otherwise groups named `rest`, `routers` and
    `experts` (when a router or expert scale is set) and `mlp` (when `mlp_lr_scale` is), an empty one left
    out; a scheduler scales every group's lr.
    """
    parts: dict[str, tuple[float, Callable[[nn.Module, str], list[nn.Parameter]], str]] = {}
    if router_lr_scale != 1.0 or expert_lr_scale != 1.0:
        parts["routers"] = (router_lr_scale, router_parameters, "optim.router_lr_scale")
        parts["experts"] = (expert_lr_scale, expert_parameters, "optim.expert_lr_scale")
    if mlp_lr_scale != 1.0:
        parts["mlp"] = (mlp_lr_scale, mlp_parameters, "optim.mlp_lr_scale")
    if not parts:
        return [{"params": list(model.parameters()), "lr": lr}]
    owner = {id(p): name for name, (_, find, knob) in parts.items() for p in find(model, knob)}
    groups: dict[str, list[nn.Parameter]] = {"rest": [], **{name: [] for name in parts}}
    for p in model.parameters():
        groups[owner.get(id(p), "rest")].append(p)
    scale = {"rest": 1.0, **{name: s for name, (s, _, _) in parts.items()}}
    return [{"params": ps, "lr": lr * scale[name], "name": name} for name, ps in groups.items() if ps]


# --- router_dtype ---------------------------------------------------------------------------------


class _Float64Softmax(TorchFunctionMode):
    """Active only inside a float64 router's forward (and the hooks that recompute its weights there):
    a softmax asked for in float32 of float64 logits runs in float64 instead. transformers' routers write
    `softmax(logits, dtype=torch.float)`; this keeps their code and moves the softmax to the logits' dtype."""

    _SOFTMAX = (torch.softmax, torch.nn.functional.softmax, Tensor.softmax, torch.special.softmax)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (
            func in self._SOFTMAX
            and kwargs.get("dtype") == torch.float32
            and args
            and isinstance(args[0], Tensor)
            and args[0].dtype == torch.float64
        ):
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


_ACTIVATION_DTYPE = "_moe_rl_activation_dtype"
_MODE = "_moe_rl_float64_softmax"


def _router_in(router: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: the router's input (its first argument) cast to its weights' dtype, and the
    float64 softmax on."""
    dtype = next(router.parameters()).dtype
    if args:
        x, args = args[0], (args[0].to(dtype), *args[1:])
    else:
        key = next(iter(kwargs))
        x, kwargs = kwargs[key], {**kwargs, key: kwargs[key].to(dtype)}
    setattr(router, _ACTIVATION_DTYPE, x.dtype)
    mode = _Float64Softmax()
    mode.__enter__()
    setattr(router, _MODE, mode)
    return args, kwargs


def _router_out(router: nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook (always called): the float64 softmax off, the combine weights back in the activations'
    dtype (the experts compute in the model's dtype; only the routing decision is float64)."""
    mode = router.__dict__.pop(_MODE, None)
    if mode is not None:
        mode.__exit__(None, None, None)
    dtype = router.__dict__.pop(_ACTIVATION_DTYPE, None)
    if dtype is None or not (isinstance(output, tuple) and len(output) == 3):
        return output
    logits, weights, indices = output
    return logits, weights.to(dtype), indices


def set_router_dtype(model: nn.Module, dtype: str) -> None:
    """`model.router_dtype`: float32 leaves the family's router as it is (its GEMM in the weights' dtype,
    float32 by default, and its softmax in float32, as transformers writes it); float64 keeps the router
    weights in float64, casts the router's input to float64 (a forward pre-hook), so the router GEMM runs
    in float64, and runs the router's softmax, top-k and renormalisation in float64 (`_Float64Softmax`,
    active during the router's forward and its hooks, which is where route replay recomputes the weights);
    the combine weights leave the router in the activations' dtype. Route recording and replay hook the
    same router modules and see float64 logits.

    Raises ValueError for a model without routers, for MegaBlocks, and for a router that computes in
    float32 whatever its weights (DeepSeek-V3), checked on a probe input."""
    if dtype not in ROUTER_DTYPES:
        raise ValueError(f"model.router_dtype={dtype!r} is not valid; valid: {list(ROUTER_DTYPES)}")
    if dtype == "float32":
        return
    layers = _moe_layers(model, f"model.router_dtype={dtype}")
    for layer in layers:
        if is_megablocks_router(layer.router):
            raise ValueError(f"model.router_dtype={dtype}: MegaBlocks' router ({layer.name}) has no float64 path")
        layer.router.to(torch.float64)
        layer.router.register_forward_pre_hook(_router_in, with_kwargs=True)
        layer.router.register_forward_hook(_router_out, always_call=True)
        _check_float64(layer)


def _check_float64(layer: MoeLayer) -> None:
    """The router's logits on a probe are float64 (a router that casts to float32 itself is refused)."""
    weight = layer.weight
    probe = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device)
    with torch.no_grad():
        logits = layer.router(probe)[0]
    if logits.dtype != torch.float64:
        raise ValueError(
            f"model.router_dtype=float64: router {layer.name} ({type(layer.router).__name__}) computes its logits "
            f"in {logits.dtype} whatever its weights' dtype; use model.router_dtype=float32"
        )
