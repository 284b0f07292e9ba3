"""The tiny transformers families: their configs (`FAMILIES`, the dense controls `DENSE_FAMILIES`), the tiny config of
one with overrides (`family_config`) and a seeded model of it (`build_family`).

`moe_rl.models` builds and loads over these and the backends that swap their MoE blocks (`models/megablocks`), which
build on `build_family`; this module imports neither.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
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

from moe_rl.models import cpu_experts
from moe_rl.routing import find_moe_layers

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

EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm", cpu_experts.NAME)


def default_experts_implementation(dtype: torch.dtype = torch.float32) -> str:
    """Fastest correct experts kernel, measured by `benchmarks/experts_impl.py`.

    On CPU `grouped_mm` matches `eager` bitwise and is 0.9x its time, while `batched_mm`, which
    materialises one weight matrix per (token, slot), is 12-27x slower. `grouped_mm_cpu`
    (`moe_rl.models.cpu_experts`) is `grouped_mm` with its row gathers by `index_select`, bit for bit
    the same on one thread, and faster where experts are many and small; on CUDA, or for experts it
    does not cover, it is `grouped_mm` itself (the fused kernel; transformers switches to
    `batched_mm` inside `generate` there). Neither has a float64 kernel: float64 models (equivalence
    tests) take `eager`.
    """
    return "eager" if dtype == torch.float64 else cpu_experts.NAME


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


def build_family(
    family: str = "qwen3_moe",
    *,
    seed: int = 0,
    experts_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A seeded tiny `*ForCausalLM` of the transformers family `family` (`moe_rl.models.build_model` also builds
    the backends). Router weights are checked to be non-degenerate: all-equal logits would make top-k a tie-break."""
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


def _check_routers(model: PreTrainedModel) -> None:
    for layer in find_moe_layers(model, required=False):  # none in a dense control
        weight = layer.weight
        if torch.all(weight == weight.flatten()[0]):
            raise RuntimeError(f"router {layer.name} has degenerate (all-equal) weights")
