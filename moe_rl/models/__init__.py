"""Tiny transformers v5 MoE models per family, and loading of local checkpoints.

Every family is a real `*ForCausalLM` class from transformers, built from a small config so that
sweeps run on a laptop CPU. The routers keep their native code; `moe_rl.routing` hooks them.
Dependencies run one way: `moe_rl.models` uses `moe_rl.routing` (to check that a model's routers can
be recorded and replayed), never the reverse.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from moe_rl.routing import find_moe_layers
from moe_rl.routing.rules import resolve_rule

# Shared tiny dimensions. Families translate them to their own config keys below.
_BASE: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.02,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def _qwen3_moe() -> PretrainedConfig:
    return Qwen3MoeConfig(
        **_BASE,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
    )


def _qwen2_moe() -> PretrainedConfig:
    return Qwen2MoeConfig(
        **_BASE,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
    )


def _mixtral() -> PretrainedConfig:
    return MixtralConfig(**_BASE, head_dim=16, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)


def _olmoe() -> PretrainedConfig:
    return OlmoeConfig(**_BASE, intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)


def _deepseek_v3() -> PretrainedConfig:
    # MLA attention, sigmoid router with correction bias and group-limited top-k; the first
    # decoder layer is dense so the MoE-layer -> decoder-layer map is not the identity.
    return DeepseekV3Config(
        **{**_BASE, "num_hidden_layers": 3, "num_key_value_heads": 4},  # MLA: no grouped KV heads
        intermediate_size=128,
        moe_intermediate_size=64,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )


def _gpt_oss() -> PretrainedConfig:
    return GptOssConfig(
        **_BASE,
        head_dim=16,
        intermediate_size=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
    )


FAMILIES = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}

# Dense controls: a dense family -> the MoE family it matches. Same hidden size, layers and attention;
# one MLP whose width is a number of experts (`_DENSE_EXPERTS`) times the expert width: `qwen3_dense` top_k
# experts, so a token passes through as many parameters (the router aside); `qwen3_dense_total` all
# num_experts, so the model holds as many parameters (the routers aside) and every one is active.
DENSE_FAMILIES = {"qwen3_dense": "qwen3_moe", "qwen3_dense_total": "qwen3_moe"}
_DENSE_CONFIGS = {"qwen3_dense": Qwen3Config, "qwen3_dense_total": Qwen3Config}
_DENSE_EXPERTS = {"qwen3_dense": "top_k", "qwen3_dense_total": "num_experts"}
# Keys of the MoE config a dense control reads (for its FFN width) or ignores: a model config written
# for the MoE model builds its dense control unchanged.
_DENSE_MATCH_KEYS = ("num_experts", "top_k", "moe_intermediate_size")

# Config keys whose name differs per family; `build_model` accepts the common spelling.
_ALIASES = {
    "num_experts": {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts", "deepseek_v3": "n_routed_experts"},
    "top_k": {"*": "num_experts_per_tok"},
    "num_layers": {"*": "num_hidden_layers"},
    # Per-expert width: families whose experts use the dense `intermediate_size` key.
    "moe_intermediate_size": {
        "mixtral": "intermediate_size",
        "gpt_oss": "intermediate_size",
        "olmoe": "intermediate_size",
    },
}

EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
# Backends other than a transformers family: MoE blocks computed by another library (GPU only).
BACKENDS = ("megablocks",)


def default_experts_implementation(dtype: torch.dtype = torch.float32) -> str:
    """Fastest correct experts kernel, measured by `benchmarks/experts_impl.py`.

    On CPU `grouped_mm` matches `eager` bitwise and is 0.9x its time, while `batched_mm`, which
    materialises one weight matrix per (token, slot), is 12-27x slower. On CUDA `grouped_mm` is
    the fused kernel (transformers itself switches to `batched_mm` inside `generate` there).
    `grouped_mm` has no float64 kernel: float64 models (equivalence tests) take `eager`.
    """
    return "eager" if dtype == torch.float64 else "grouped_mm"


def dense_config(family: str = "qwen3_dense", **overrides: Any) -> PretrainedConfig:
    """The dense control of `DENSE_FAMILIES[family]` under the same `overrides`: its hidden size, layers
    and attention, and an MLP of width `top_k * moe_intermediate_size` (`qwen3_dense`: the MoE model's
    active width) or `num_experts * moe_intermediate_size` (`qwen3_dense_total`: its total width); the
    other of the two counts is unused.

    Built in one call, not patched after, so that per-layer fields (`layer_types`) follow the depth.
    """
    moe = FAMILIES[DENSE_FAMILIES[family]]()
    experts = {
        "top_k": overrides.pop("top_k", moe.num_experts_per_tok),
        "num_experts": overrides.pop("num_experts", moe.num_experts),
    }[_DENSE_EXPERTS[family]]
    width = overrides.pop("moe_intermediate_size", moe.moe_intermediate_size)
    kwargs: dict[str, Any] = {**_BASE, "head_dim": moe.head_dim, "intermediate_size": experts * width}
    config_class = _DENSE_CONFIGS[family]
    known = config_class()
    for key, value in overrides.items():
        key = _ALIASES.get(key, {}).get("*", key)
        if not hasattr(known, key):
            raise ValueError(f"{family} config has no key {key!r}")
        kwargs[key] = value
    return config_class(**kwargs)


def family_config(family: str = "qwen3_moe", **overrides: Any) -> PretrainedConfig:
    """The tiny config of `family` with `overrides` applied (unknown keys raise)."""
    if family in DENSE_FAMILIES:
        return dense_config(family, **overrides)
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; valid: {sorted([*FAMILIES, *DENSE_FAMILIES])}")
    config = FAMILIES[family]()
    for key, value in overrides.items():
        aliases = _ALIASES.get(key, {})
        key = aliases.get(family, aliases.get("*", key))
        if not hasattr(config, key):
            raise ValueError(f"{family} config has no key {key!r}")
        setattr(config, key, value)
    if family == "gpt_oss" and "num_hidden_layers" in {_ALIASES.get(k, {}).get("*", k) for k in overrides}:
        n = config.num_hidden_layers
        config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return config


def build_model(
    family: str = "qwen3_moe",
    *,
    seed: int = 0,
    experts_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A seeded tiny `*ForCausalLM` of `family`, e.g. `build_model("mixtral", num_experts=16)`.

    Router weights are checked to be non-degenerate: all-equal logits would make top-k a tie-break.
    `family="megablocks"` builds the default family with MegaBlocks dMoE blocks (CUDA only).
    """
    if family == "megablocks":
        from moe_rl.models.megablocks import build_megablocks_model

        return build_megablocks_model(seed=seed, dtype=dtype, **config_overrides)
    config = family_config(family, **config_overrides)
    impl = experts_implementation or default_experts_implementation(dtype)
    if impl not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"unknown experts_implementation {impl!r}; valid: {list(EXPERTS_IMPLEMENTATIONS)}")
    if family not in DENSE_FAMILIES:  # a dense model has no experts kernel to choose
        config._experts_implementation = impl
    # GPT-OSS's attention sinks have no SDPA path in transformers.
    config._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _check_routers(model)
    return model.eval()


def load_model(
    path: str | Path, *, experts_implementation: str | None = None, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """Load a `save_pretrained` directory or a hub id of any MoE family transformers ships, or of a
    model without MoE layers (a dense control such as `qwen3_dense`: nothing to record or replay).

    The family's routers must be ones `moe_rl.routing` can record and replay; otherwise this raises
    `UnsupportedRouterError` with the reason (see docs/families.md). Offline (HF_HUB_OFFLINE) a hub
    id that is not in the local cache is a clear error, not a network timeout.
    """
    local = Path(path).expanduser()
    if local.exists() and not (local / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a save_pretrained checkpoint (no config.json)")
    source = str(local) if local.exists() else str(path)
    # HF_HUB_OFFLINE read now, not only when huggingface_hub was imported: set later (a notebook, a test),
    # it still means the cache alone, not a network attempt that times out
    cache_only = local.exists() or bool(os.environ.get("HF_HUB_OFFLINE"))
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=cache_only)
    except OSError as err:
        if os.environ.get("HF_HUB_OFFLINE"):
            raise ValueError(
                f"model.checkpoint={str(path)!r} is no local directory and HF_HUB_OFFLINE is set, so the hub "
                f"model {str(path)!r} cannot be downloaded (and is not in the local cache); download it first "
                "or unset HF_HUB_OFFLINE"
            ) from err
        raise ValueError(
            f"model.checkpoint={str(path)!r}: neither a local checkpoint nor a loadable hub model: {err}"
        ) from err
    if getattr(config, "moe_rl_backend", None) == "megablocks":
        from moe_rl.models.megablocks import load_megablocks_model

        return load_megablocks_model(source, dtype=dtype)
    kwargs: dict[str, Any] = {"experts_implementation": experts_implementation or default_experts_implementation(dtype)}
    if config.model_type == "gpt_oss":  # attention sinks have no SDPA path
        kwargs["attn_implementation"] = "eager"
    try:
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=cache_only, dtype=dtype, **kwargs)
    except (ValueError, TypeError) as err:
        if "experts implementation" not in str(err).replace("_", " "):  # a dense model: "... experts implementation."
            raise
        kwargs.pop("experts_implementation")  # a family without a switchable experts kernel
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=cache_only, dtype=dtype, **kwargs)
    for layer in find_moe_layers(model, required=False):  # refuse now, with the reason, rather than mid-run
        resolve_rule(layer)
    return model.eval()


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(total, active) parameters of `model`: a token passes through `top_k` of the `num_experts`
    experts of each MoE layer, and through everything else (embeddings, attention, norms, routers,
    shared experts). A dense model's two counts are equal."""
    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for layer in find_moe_layers(model, required=False):
        experts = getattr(model.get_submodule(layer.name.rsplit(".", 1)[0]), "experts", None)
        if not isinstance(experts, torch.nn.Module):
            raise ValueError(f"{layer.name}: no `experts` module beside the router to count")
        size = sum(p.numel() for p in experts.parameters())
        idle += size * (layer.num_experts - layer.top_k) // layer.num_experts
    return total, total - idle


def _check_routers(model: PreTrainedModel) -> None:
    for layer in find_moe_layers(model, required=False):  # none in a dense control
        weight = layer.weight
        if torch.all(weight == weight.flatten()[0]):
            raise RuntimeError(f"router {layer.name} has degenerate (all-equal) weights")
