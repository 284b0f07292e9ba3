"""Every MoE causal-LM family of the installed transformers, found automatically and built tiny.

`moe_families()` walks transformers' causal-LM auto mapping and keeps the model types whose
(text) config counts experts; `tiny_config(model_type)` shrinks a family's default config to a
small model (hidden 64, 2-3 layers, 8 experts, top-2, vocab 128; 0.1-15M parameters) by rewriting
the keys that size it, so the family survey (`moe_rl.models.survey`) can run every family on a
CPU in seconds. Nothing here lists families by hand, except `_DEFAULT_FIXES` for the default
configs transformers itself leaves unbuildable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

# Config keys that count routed experts, across families.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k", "moe_top_k")

TINY_EXPERTS, TINY_TOP_K, TINY_VOCAB, TINY_LAYERS = 8, 2, 128, 2

# Keys that size a model, shrunk wherever a config has them (values of the tiny model).
_SHRINK: dict[str, int] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "ffn_hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "sliding_window": 64,
    "attention_chunk_size": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 8,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "index_n_heads": 2,
    "zero_expert_num": 2,
    "index_head_dim": 16,
    "index_topk": 16,
    "global_attn_every_n_layers": 1,
}
_SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
# Default configs that transformers leaves unbuildable (a required per-layer list or feature size
# defaults to None): the values the tiny model needs, per model type.
_DEFAULT_FIXES: dict[str, dict[str, Any]] = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"]},  # modeling indexes layer_types
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
}


@dataclass(frozen=True)
class MoeFamily:
    model_type: str
    model_class: str  # the causal-LM class name transformers maps it to
    multimodal: bool  # the config nests a text config: the text-only `*_text` type covers the LM


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    try:
        return config.get_text_config()
    except Exception:  # ambiguous (several text sub-configs): not a plain causal LM
        return config


def _counts_experts(config: PretrainedConfig) -> bool:
    """An expert-count key set to a number (or a per-layer list). Dense families lack the keys or
    leave them None; an MoE family may default to a single expert (HunYuan-MoE) and still routes."""
    return any(
        isinstance(getattr(config, key, None), (int, list)) and not isinstance(getattr(config, key), bool)
        for key in EXPERT_COUNT_KEYS
    )


def moe_families() -> list[MoeFamily]:
    """The MoE causal-LM families of the installed transformers: every model type in
    `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` whose default (text) config has an expert-count key."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = []
    for model_type, model_class in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # a config without usable defaults cannot be built tiny either
            continue
        text = _text_config(config)
        if _counts_experts(text):
            families.append(MoeFamily(model_type, model_class, multimodal=text is not config))
    return families


def _layer_list(value: Any, old: int, new: int) -> Any:
    """A per-layer list cut to `new` layers, keeping every distinct kind of layer it had (a hybrid
    model's few full-attention layers must survive the cut)."""
    if not (isinstance(value, (list, tuple)) and len(value) == old and old > 0):
        return value
    if all(isinstance(v, str) for v in value):
        kinds = list(dict.fromkeys(value))
        kinds.sort(key=lambda v: v != "dense")  # a leading dense layer stays first
        out = (kinds + [value[-1]] * new)[:new]
        return type(value)(out)
    return type(value)(value[i % old] for i in range(new))


def _has_dense_layers(values: dict[str, Any]) -> bool:
    return bool(values.get("first_k_dense_replace") or values.get("num_dense_layers")) or any(
        isinstance(v, list) and "dense" in v for v in values.values()
    )


def tiny_config(
    model_type: str, *, num_layers: int = TINY_LAYERS, num_experts: int = TINY_EXPERTS, top_k: int = TINY_TOP_K
) -> PretrainedConfig:
    """`model_type`'s default (text) config shrunk to a tiny model: `num_experts` experts, top-`top_k`.

    Per-layer lists are cut to the new depth keeping each kind of layer; a family whose first
    layers are dense (DeepSeek's `first_k_dense_replace`) keeps one dense layer and gets one more
    layer. The config is rebuilt through its class so derived fields follow the new sizes.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = _text_config(CONFIG_MAPPING[model_type]())
    values = text.to_dict()
    old_layers = int(values.get("num_hidden_layers") or num_layers)
    layers = num_layers + (1 if _has_dense_layers(values) else 0)
    updates: dict[str, Any] = {"num_hidden_layers": layers, "tie_word_embeddings": False}
    for key, value in values.items():
        if key in _SHRINK and isinstance(value, int) and not isinstance(value, bool):
            updates[key] = min(value, _SHRINK[key])
        elif key in EXPERT_COUNT_KEYS and value is not None:
            updates[key] = [num_experts] * layers if isinstance(value, list) else num_experts
        elif key in TOP_K_KEYS and value is not None:
            updates[key] = [top_k] * layers if isinstance(value, list) else top_k
        elif isinstance(value, (list, tuple)) and key != "architectures":
            updates[key] = _layer_list(value, old_layers, layers)
    if "head_dim" in values and values["head_dim"] is None and "qk_rope_head_dim" not in values:
        updates["head_dim"] = _SHRINK["head_dim"]
    if "qk_rope_head_dim" in values:  # MLA: rotary part of the head and the query/key head size
        updates["num_key_value_heads"] = updates.get("num_attention_heads", 4)
        if "head_dim" in values:
            updates["head_dim"] = _SHRINK["qk_rope_head_dim"]
        if "qk_head_dim" in values:
            updates["qk_head_dim"] = _SHRINK["qk_rope_head_dim"] + _SHRINK["qk_nope_head_dim"]
    for key in ("first_k_dense_replace", "num_dense_layers"):
        if values.get(key):
            updates[key] = 1
    for key, groups in (("n_group", "topk_group"), ("num_expert_group", "topk_group")):
        if values.get(key):
            updates[key] = 2
            updates[groups] = min(values.get(groups) or 1, 2)
    for key in (
        "decoder_sparse_step",
        "moe_layer_freq",
        "moe_every_n_layers",
        "expert_layer_period",
        "attn_layer_period",
        "full_attention_interval",
    ):
        if isinstance(values.get(key), int) and values[key] > 2:
            updates[key] = 2
    for key in ("expert_layer_offset", "attn_layer_offset"):
        if isinstance(values.get(key), int) and values[key] > 1:
            updates[key] = 1
    if isinstance(values.get("mlp_only_layers"), list):
        updates["mlp_only_layers"] = []
    for i, key in enumerate(_SPECIAL_IDS):
        value = values.get(key)
        if isinstance(value, int) and value >= TINY_VOCAB:
            updates[key] = i
        elif isinstance(value, list):
            updates[key] = [v if v < TINY_VOCAB else i for v in value]
    kwargs = {k: v for k, v in values.items() if k not in ("transformers_version", "model_type", "_name_or_path")}
    kwargs.update(updates)
    for key in ("is_moe", "use_moe"):  # families whose default config is the dense variant (Doge)
        if values.get(key) is False:
            kwargs[key] = True
    if values.get("num_experts_per_tok", 0) is None:
        kwargs["num_experts_per_tok"] = top_k
    if values.get("mamba_d_head") and values.get("mamba_expand"):  # heads * head size = expand * hidden
        kwargs["mamba_n_heads"] = values["mamba_expand"] * kwargs["hidden_size"] // kwargs["mamba_d_head"]
    for key, value in values.items():  # per-layer dicts keyed by layer index
        if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            kwargs[key] = {k: v for k, v in value.items() if int(k) < layers}
    for key in ("layer_types", "mlp_layer_types"):  # derived from the sizes unless the defaults set them
        if values.get(key) is None:
            kwargs.pop(key, None)
    kwargs.update(_DEFAULT_FIXES.get(model_type, {}))
    try:
        return type(text)(**kwargs)
    except Exception as err:  # e.g. ZAYA: "supports `num_experts_per_tok=1` only"
        if top_k == 1 or "num_experts_per_tok" not in str(err):
            raise
        return tiny_config(model_type, num_layers=num_layers, num_experts=num_experts, top_k=1)
