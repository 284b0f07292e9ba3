"""Tiny transformers v5 MoE models per family, and loading of local checkpoints: `build_model` and `load_model` over
the families (`models/families`) and the MegaBlocks backend (`models/megablocks`, which builds on the families).

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
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from moe_rl.models.families import DENSE_FAMILIES as DENSE_FAMILIES
from moe_rl.models.families import EXPERTS_IMPLEMENTATIONS as EXPERTS_IMPLEMENTATIONS
from moe_rl.models.families import FAMILIES as FAMILIES
from moe_rl.models.families import build_family
from moe_rl.models.families import default_experts_implementation as default_experts_implementation
from moe_rl.models.families import dense_config as dense_config
from moe_rl.models.families import family_config as family_config
from moe_rl.routing import find_moe_layers
from moe_rl.routing.gate_rules import resolve_rule

# Backends other than a transformers family: MoE blocks computed by another library (GPU only).
BACKENDS = ("megablocks",)


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
    return build_family(
        family, seed=seed, experts_implementation=experts_implementation, dtype=dtype, **config_overrides
    )


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
    # transformers kernelizes every from_pretrained by default (`use_kernels`): hub kernels, where the hub is reachable,
    # would replace the family's own layers (a fused MoE block never calls its router: refused at attach), so a run's
    # numbers would hang on the network; and every train()/eval() would re-kernelize (1.1 ms a pair, 0.36 without)
    kwargs: dict[str, Any] = {
        "experts_implementation": experts_implementation or default_experts_implementation(dtype),
        "use_kernels": False,
    }
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
