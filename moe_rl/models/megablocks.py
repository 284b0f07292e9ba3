"""MegaBlocks backend: a tiny transformers MoE model whose sparse MoE blocks are MegaBlocks `dMoE`.

MegaBlocks (`megablocks` 0.10.0, the dropless-MoE library of large MoE training) runs on CUDA only:
its token permutation is a compiled extension (`megablocks_ops`) and, for the small expert widths
used here, its experts go through `grouped_gemm` (its `sparse` path needs widths that are multiples
of 128 and refuses triton >= 3.2). grouped_gemm 0.3.0 accepts bf16 operands only, so the dMoE blocks
hold bf16 weights and compute in bf16 (`moe_dtype`); the block wrapper casts activations in and out,
and the rest of the model keeps its dtype. This module imports megablocks lazily; on a machine
without CUDA or without the package, choosing the backend raises `MegaBlocksUnavailable`.

The model is the tiny config of a transformers family (Qwen3-MoE by default) with each
`*SparseMoeBlock` replaced by `MegaBlocksMoeBlock(dMoE)`, whose router and expert weights are copied
from the block it replaces: the same seed gives the same function as `build_model(base)` (`build_family`), up to
kernel numerics. `moe_rl.routing` finds the dMoE's `LearnedRouter`; its rows are sequence-major
because dMoE follows Megatron's (seq, batch, hidden) layout, which the block wrapper feeds it.

Auxiliary losses are off (`moe_loss_weight = moe_zloss_weight = 0`), as they are for the other
families (`output_router_logits=False`): with them on, MegaBlocks appends per-layer statistics to
module-level lists on every forward (`moe._LOAD_BALANCING_LOSS` in training mode,
`router._ROUTER_LOGITS` always) that the training loop must read and clear each step; see
`load_balancing_loss` and docs/megablocks.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from moe_rl.models.families import build_family

INSTALL_HINT = (
    "the megablocks backend needs a CUDA device and `pip install 'moe_rl[megablocks]'` "
    "(megablocks 0.10.0 with grouped_gemm; both build CUDA extensions, and megablocks pins torch 2.7.0)"
)
BACKEND = "megablocks"
# Families whose MoE block is `gate` (softmax top-k router) + `experts` (SwiGLU experts stored as
# `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I)), without a shared expert.
BASE_FAMILIES = ("qwen3_moe", "olmoe", "mixtral")


class MegaBlocksUnavailable(RuntimeError):
    """The megablocks backend was chosen where it cannot run."""


def megablocks_unavailable_reason() -> str | None:
    """Why the backend cannot run here (no CUDA, or megablocks not importable), else None."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import megablocks.layers.dmoe  # noqa: F401
    except Exception as err:  # ImportError, or the CUDA extension failing to load
        return f"megablocks is not importable ({type(err).__name__}: {err})"
    return None


def require_megablocks() -> ModuleType:
    """`megablocks`, or `MegaBlocksUnavailable` saying why not and how to install it."""
    reason = megablocks_unavailable_reason()
    if reason is not None:
        raise MegaBlocksUnavailable(f"model.family={BACKEND}: {reason}; {INSTALL_HINT}")
    import megablocks

    return megablocks


class MegaBlocksMoeBlock(nn.Module):
    """A decoder layer's MoE block computed by a MegaBlocks `dMoE`, keeping the (B, T, H) interface.

    dMoE takes Megatron's (seq, batch, hidden) activations, so its router's rows are t * B + b.
    """

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe  # .router: LearnedRouter, .experts: ParallelDroplessMLP

    def forward(self, hidden_states: Tensor) -> Tensor:  # (B, T, H)
        x = hidden_states.transpose(0, 1).to(self.moe.router.layer.weight.dtype).contiguous()  # (T, B, H)
        out = self.moe(x)
        if isinstance(out, tuple):  # Arguments(return_bias=True) returns (out, bias)
            out = out[0]
        return out.transpose(0, 1).to(hidden_states.dtype)


def dmoe_arguments(
    config: Any, *, num_moe_layers: int, device: str | torch.device, moe_dtype: torch.dtype, mlp_impl: str = "grouped"
) -> dict[str, Any]:
    """Keyword arguments of `megablocks.layers.arguments.Arguments` matching one MoE block of `config`.

    Router: softmax, top-k, then w / ||w||_p with p = 1 where the family renormalises (= w / sum w,
    as the weights are positive). Experts: GLU with the family's SiLU, no bias. Weights in
    `moe_dtype` (MegaBlocks' `fp16`/`bf16` flags; neither means float32).
    """
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"megablocks backend: hidden_act={config.hidden_act!r}, only 'silu' maps onto its GLU experts")
    renormalise = getattr(config, "norm_topk_prob", True)  # Mixtral always renormalises and has no flag
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return dict(
        hidden_size=config.hidden_size,
        ffn_hidden_size=ffn,
        num_layers=num_moe_layers,
        bias=False,
        return_bias=False,
        activation_fn=F.silu,
        mlp_type="glu",
        mlp_impl=mlp_impl,
        moe_num_experts=num_experts,
        moe_top_k=config.num_experts_per_tok,
        moe_normalize_expert_weights=1 if renormalise else None,
        moe_jitter_eps=None,
        moe_loss_weight=0.0,
        moe_zloss_weight=0.0,
        fp16=moe_dtype == torch.float16,
        bf16=moe_dtype == torch.bfloat16,
        device=torch.device(device),
    )


def _sparse_blocks(model: PreTrainedModel) -> list[tuple[nn.Module, str, nn.Module]]:
    """(decoder layer, attribute, block) of every MoE block with a `gate` router and `experts`."""
    found = []
    for layer in model.model.layers:
        for attr in ("mlp", "block_sparse_moe"):
            block = getattr(layer, attr, None)
            experts = getattr(block, "experts", None)
            if hasattr(block, "gate") and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
                found.append((layer, attr, block))
    return found


@torch.no_grad()
def swap_moe_blocks(
    model: PreTrainedModel, make_moe: Callable[[dict[str, Any]], nn.Module], **arguments: Any
) -> PreTrainedModel:
    """Replace every sparse MoE block of `model` by `MegaBlocksMoeBlock(make_moe(kwargs))`, copying weights.

    `make_moe` builds a dMoE from `dmoe_arguments(...)`; tests pass a CPU stand-in with the same
    parameter layout: router.layer.weight (E, H); experts.mlp.w1, v1, w2 (E*I, H), where expert e
    computes (silu(x w1_e^T) * (x v1_e^T)) w2_e.
    """
    blocks = _sparse_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no MoE block with `gate` and `experts` to swap")
    kwargs = dmoe_arguments(model.config, num_moe_layers=len(blocks), **arguments)
    for layer, attr, block in blocks:
        moe = make_moe(kwargs)
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj  # (E, 2I, H), (E, H, I)
        E, two_i, H = gate_up.shape
        mlp = moe.experts.mlp
        moe.router.layer.weight.copy_(block.gate.weight)
        mlp.w1.copy_(gate_up[:, : two_i // 2].reshape(-1, H))
        mlp.v1.copy_(gate_up[:, two_i // 2 :].reshape(-1, H))
        mlp.w2.copy_(down.transpose(1, 2).reshape(-1, H))
        setattr(layer, attr, MegaBlocksMoeBlock(moe))
    model.config.moe_rl_backend = BACKEND
    return model


def _make_dmoe(kwargs: dict[str, Any]) -> nn.Module:
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE

    return dMoE(Arguments(**kwargs))


def build_megablocks_model(
    base: str = "qwen3_moe",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    moe_dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    mlp_impl: str = "grouped",
    **config_overrides: Any,
) -> PreTrainedModel:
    """`build_family(base, seed=seed, **config_overrides)` with its MoE blocks computed by MegaBlocks dMoE
    in `moe_dtype` (bf16: grouped_gemm takes nothing else). Raises `MegaBlocksUnavailable` without
    CUDA or megablocks.
    """
    require_megablocks()
    if base not in BASE_FAMILIES:
        raise ValueError(f"megablocks backend: unknown base family {base!r}; valid: {list(BASE_FAMILIES)}")
    model = build_family(base, seed=seed, dtype=dtype, **config_overrides)
    swap_moe_blocks(model, _make_dmoe, device=device, moe_dtype=moe_dtype, mlp_impl=mlp_impl)
    return model.to(device).eval()


def load_megablocks_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    moe_dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    mlp_impl: str = "grouped",
) -> PreTrainedModel:
    """Load a `save_pretrained` checkpoint of a megablocks-backend model (config `moe_rl_backend`)."""
    require_megablocks()
    return _load(Path(path), _make_dmoe, dtype=dtype, moe_dtype=moe_dtype, device=device, mlp_impl=mlp_impl)


def _load(
    path: Path, make_moe: Callable[[dict[str, Any]], nn.Module], *, dtype: torch.dtype, **arguments: Any
) -> PreTrainedModel:
    from safetensors.torch import load_file

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "moe_rl_backend", None) != BACKEND:
        raise ValueError(f"{path} is not a {BACKEND}-backend checkpoint (config has no moe_rl_backend={BACKEND!r})")
    index = path / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():  # a sharded save
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state = {k: v for f in files for k, v in load_file(path / f).items()}
    with torch.random.fork_rng(devices=[]):  # the skeleton's random init is overwritten below
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    swap_moe_blocks(model, make_moe, **arguments)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match the model (missing {missing}, unexpected {unexpected})")
    return model.to(arguments["device"]).eval()


def load_balancing_loss(model: PreTrainedModel) -> Tensor | float:
    """MegaBlocks' batched load-balancing loss of the last training forward, then its list cleared.

    Only for models built with `moe_loss_weight > 0`. MegaBlocks appends (tokens_per_expert, scores)
    per MoE layer per training-mode forward and `batched_load_balancing_loss` demands exactly one
    entry per layer, so call this once after each training forward (including replayed ones: there
    tokens_per_expert counts the forced experts and scores are the live probabilities).
    """
    from megablocks.layers import moe

    args = next(m.moe.router.args for m in model.modules() if isinstance(m, MegaBlocksMoeBlock))
    try:
        return moe.batched_load_balancing_loss(args)
    finally:
        moe.clear_load_balancing_loss()
