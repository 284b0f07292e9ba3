"""Routing support of every MoE family in the installed transformers, checked on tiny models.

For each family of `moe_rl.models.zoo.moe_families()` a tiny model is built and three things are
checked: routes are recorded at every MoE layer; replaying the model's own routes reproduces the
plain forward bitwise; forced routes (a fixed permutation of the model's own) reach the experts,
i.e. the experts module receives exactly the forced ids. A family either passes all three
(`exact`) or the harness refuses it with an `UnsupportedRouterError` that names the router class
and the reason (`refused`). Anything else is a bug. `python -m moe_rl.models.survey docs/families.md`
regenerates the table that the family test also renders.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from moe_rl.models.zoo import MoeFamily, moe_families, tiny_config
from moe_rl.routing import RoutedPass, RouteRecorder, Routes, UnsupportedRouterError, find_moe_layers


@dataclass
class FamilyResult:
    family: str
    model_class: str
    router: str = ""  # router class name(s)
    rule: str = ""  # gate-weight rule name(s)
    status: str = ""  # exact | refused | skipped
    reason: str = ""
    max_abs_diff: float = 0.0  # self-replay vs plain forward (0.0 when bitwise)


def _build(family: MoeFamily, seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = tiny_config(family.model_type)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for name, param in model.named_parameters():  # routers left at zeros would route by tie-break
            if param.dim() >= 1 and torch.all(param == 0) and any(s in name for s in ("gate", "router", "bias")):
                with torch.no_grad():
                    param.normal_(0, 0.02 if param.dim() > 1 else 0.1)
    return model.eval()


def _logits(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _experts_of(model: nn.Module, router_name: str) -> nn.Module | None:
    parent = model.get_submodule(router_name.rsplit(".", 1)[0])
    experts = getattr(parent, "experts", None)
    return experts if isinstance(experts, nn.Module) else None


def _permuted(routes: Routes, generator: torch.Generator) -> Routes:
    """The same positions routed to a random permutation of the experts (never the router's own
    choice where the permutation moves an expert); per layer one permutation."""
    B, T, L, k = routes.shape
    E = routes.num_experts
    ids = routes.indices.long().clone()
    for layer in range(L):
        perm = torch.randperm(E, generator=generator)
        while bool((perm == torch.arange(E)).all()):
            perm = torch.randperm(E, generator=generator)
        ids[:, :, layer] = perm[ids[:, :, layer]]
    return Routes.from_topk(ids, routes.mask, routes.layer_map, E)


def check_model(model: nn.Module, *, seed: int = 0) -> tuple[str, str, float]:
    """(rule names, status, max |self-replay - plain|) of `model`; raises UnsupportedRouterError
    when the harness refuses the model, AssertionError when a check fails."""
    layers = find_moe_layers(model)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row, like the harness's batches
    with torch.no_grad():
        plain = _logits(model, ids, mask)
        with RouteRecorder(model) as recorder:
            recorded = _logits(model, ids, mask)
        routes = recorder.routes
        assert torch.equal(plain, recorded), "recording changed the forward"
        assert routes.shape[:3] == (2, 9, len(layers)), f"routes shape {routes.shape}"
        with RoutedPass(model, routes) as routed:
            replayed = _logits(model, ids, mask)
        rules = sorted({rule.__name__ for rule in routed.replay.rules})
        diff = (replayed - plain).abs().max().item()
        assert torch.equal(routed.used.indices[routes.mask], routes.indices[routes.mask]), "replay used other routes"
        assert diff == 0.0, f"self-replay differs from the plain forward by {diff:.3g}"
        forced = _permuted(routes, generator)
        seen: list[torch.Tensor] = []
        handles = []
        real: list[int] = []  # per hooked layer, how many of the router's ids are real experts
        for layer in layers:
            experts = _experts_of(model, layer.name)
            if experts is not None:
                real.append(min(routes.num_experts, int(getattr(experts, "num_experts", routes.num_experts))))
                handles.append(
                    experts.register_forward_pre_hook(
                        lambda m, args, kwargs: seen.append(_index_arg(args, kwargs)), with_kwargs=True
                    )
                )
        try:
            with RoutedPass(model, forced) as routed:
                changed = _logits(model, ids, mask)
        finally:
            for handle in handles:
                handle.remove()
        valid = forced.mask
        assert torch.equal(routed.used.indices[valid], forced.indices[valid]), "forced routes were not used"
        assert not torch.equal(changed, plain), "forced routes left the output unchanged"
        if handles:
            assert len(seen) == len(handles), f"{len(seen)} experts calls for {len(handles)} MoE layers"
            # Each forced id of a real expert must reach the experts. Ids past the real experts
            # (LongCat's zero experts: identity, no weights) may reach them remapped, with weight 0.
            got = torch.stack([s.view(2, 9, -1) for s in seen], dim=2)  # (B, T, L, k)
            want = forced.indices.long()
            received = (want.unsqueeze(-1) == got.unsqueeze(-2)).any(-1)
            is_real = want < torch.tensor(real).view(1, 1, -1, 1)
            checked = valid[:, :, None, None] & is_real
            assert bool(received[checked].all()), "the experts did not receive the forced ids"
    return "+".join(rules), "exact", diff


def _index_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    """The top-k index tensor among an experts module's inputs."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() == 2:
            return value
    raise AssertionError("experts module received no (tokens, k) integer index tensor")


def survey_family(family: MoeFamily) -> FamilyResult:
    result = FamilyResult(family.model_type, family.model_class)
    if family.multimodal:
        result.status, result.reason = "skipped", "multimodal config; its text model is surveyed as its `*_text` type"
        return result
    try:
        model = _build(family)
    except Exception as err:
        result.status = "skipped"
        result.reason = f"tiny config does not build: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        return result
    try:
        result.router = "+".join(sorted({type(layer.router).__name__ for layer in find_moe_layers(model)}))
    except UnsupportedRouterError:
        pass
    try:
        result.rule, result.status, result.max_abs_diff = check_model(model)
    except UnsupportedRouterError as err:
        result.status, result.reason = "refused", str(err)
        result.router = result.router or err.router
    except Exception as err:  # a bug: the test fails on it
        result.status, result.reason = "error", f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    return result


def survey() -> list[FamilyResult]:
    return [survey_family(family) for family in moe_families()]


def render_markdown(results: list[FamilyResult]) -> str:
    import transformers

    counts = {s: sum(r.status == s for r in results) for s in ("exact", "refused", "skipped")}
    lines = [
        "# MoE families of transformers: routing support",
        "",
        "Generated by `tests/test_families.py` (`python -m moe_rl.models.survey docs/families.md`); do not edit.",
        f"transformers {transformers.__version__}, torch {torch.__version__}.",
        "",
        "Each family is built from its default config shrunk to a tiny model (`moe_rl.models.zoo.tiny_config`).",
        "`exact`: routes recorded, self-replay bitwise equal to the plain forward, forced routes reach the",
        "experts. `refused`: `UnsupportedRouterError` with the reason. `skipped`: not a text-only causal LM,",
        "or its tiny config does not build.",
        "",
        f"**{len(results)} families: {counts['exact']} exact, {counts['refused']} refused, "
        f"{counts['skipped']} skipped.**",
        "",
        "| family | router | rule | status | reason |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        reason = r.reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.family} | {r.router} | {r.rule} | {r.status} | {reason} |")
    return "\n".join([*lines, "", *presets_markdown()]) + "\n"


def presets_markdown() -> list[str]:
    """The harness's own tiny presets (`model.family`) with their total and active parameters
    (`moe_rl.models.param_counts`), built as a run builds them: default model config, the synthetic
    tasks' character vocabulary."""
    from moe_rl.models import DENSE_FAMILIES, FAMILIES, build_model, param_counts
    from moe_rl.tasks import make_tokenizer

    vocab = len(make_tokenizer())
    lines = [
        "## The harness's presets and the dense control",
        "",
        f"Parameters of each `model.family` as a run builds it (default `model.*`, vocabulary {vocab} characters).",
        "Active: what one token passes through, top-k of the routed experts plus everything else (embeddings,",
        "attention, norms, routers, shared experts). `qwen3_dense` is the dense control of `qwen3_moe`: the same",
        "hidden size, layers and attention, and one MLP of width top_k x expert width (2 x 64 = 128), so its",
        "parameters equal `qwen3_moe`'s active ones less the routers (layers x experts x hidden = 2 x 8 x 64 = 1,024).",
        "`qwen3_dense_total` is the same with an MLP of width num_experts x expert width (8 x 64 = 512): `qwen3_moe`'s",
        "total parameters less the routers, every one active. `qwen3_moe (top-8)` is `model=qwen3_moe_soft`: the",
        "default model routing every token to all 8 experts at the router's softmax weights (soft routing).",
        "",
        "| family | class | layers | MoE layers | experts, top-k | total parameters | active per token |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for label, family, overrides in [
        *((family, family, {}) for family in [*FAMILIES, *DENSE_FAMILIES]),
        ("qwen3_moe (top-8)", "qwen3_moe", SOFT_ROUTING),
    ]:
        model = build_model(family, vocab_size=vocab, **overrides)
        layers = find_moe_layers(model, required=False)
        total, active = param_counts(model)
        routing = f"{layers[0].num_experts}, top-{layers[0].top_k}" if layers else "dense"
        lines.append(
            f"| {label} | {type(model).__name__} | {model.config.num_hidden_layers} | {len(layers)} | {routing} | "
            f"{total:,} | {active:,} |"
        )
    return lines


# experiments/conf/model/qwen3_moe_soft.yaml: the default model with top_k = num_experts
SOFT_ROUTING = {"top_k": 8}


def main(argv: list[str]) -> int:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    results = survey()
    text = render_markdown(results)
    if argv:
        Path(argv[0]).write_text(text)
    else:
        print(text)
    bad = [asdict(r) for r in results if r.status not in ("exact", "refused", "skipped")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
