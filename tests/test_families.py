"""Every MoE causal-LM family of the installed transformers: exact record/replay, or a clear refusal.

The families are discovered from transformers' auto mapping (`moe_rl.models.zoo.moe_families`),
not listed by hand. `docs/families.md` is rendered by the same survey: run
`MOE_RL_WRITE_FAMILIES=1 pytest tests/test_families.py` (or `python -m moe_rl.models.survey
docs/families.md`) to regenerate it after a transformers upgrade.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from helpers import ROOT

from moe_rl.models.survey import _build, render_markdown, survey
from moe_rl.models.zoo import moe_families, tiny_config
from moe_rl.routing import RouteRecorder, RouteReplay, UnsupportedRouterError, find_moe_layers
from moe_rl.routing.gate_rules import GENERIC_RULES, pick_rule, softmax_selected, softmax_topk

DOC = ROOT / "docs" / "families.md"


@pytest.fixture(scope="module")
def results():
    transformers.utils.logging.set_verbosity_error()
    return {r.family: r for r in survey()}


def test_discovery_finds_families_without_a_hand_kept_list():
    found = {f.model_type: f for f in moe_families()}
    for known in (
        "qwen3_moe",
        "mixtral",
        "olmoe",
        "deepseek_v3",
        "gpt_oss",
        "granitemoe",
        "hunyuan_v1_moe",
        "lfm2_moe",
    ):
        assert known in found
    assert "llama" not in found and "qwen3" not in found  # dense families are not MoE
    assert len(found) >= 20


def test_every_family_is_exact_or_refused_with_reason(results):
    errors = {f: r.reason for f, r in results.items() if r.status not in ("exact", "refused", "skipped")}
    assert not errors, errors
    for r in results.values():
        if r.status == "refused":
            assert r.router and r.reason, r  # names the router class and why
        if r.status == "skipped":
            assert r.reason
        if r.status == "exact":
            assert r.max_abs_diff == 0.0 and r.rule
    exact = [f for f, r in results.items() if r.status == "exact"]
    text_only = [f for f, r in results.items() if not r.reason.startswith("multimodal")]
    assert len(exact) > 0.7 * len(text_only), f"only {len(exact)} of {len(text_only)} text-only families exact"


def test_known_cases(results):
    # HunYuan-MoE keeps its gate weight in `wg`, not `.weight`.
    assert results["hunyuan_v1_moe"].status == "exact"
    # LFM2-MoE's router takes the block's expert bias as a second input: no probe, checked on the first call.
    assert results["lfm2_moe"].status == "exact"
    assert results["lfm2_moe"].rule == "sigmoid_topk_norm_eps1e-06"
    # GraniteMoe: softmax over the selected logits is bitwise; softmax-then-renormalise is only close.
    assert results["granitemoe"].status == "exact" and results["granitemoe"].rule == "softmax_selected"
    for family in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"):
        assert results[family].status == "exact", family


def test_docs_families_md_is_current(results):
    text = render_markdown(list(results.values()))
    if os.environ.get("MOE_RL_WRITE_FAMILIES"):
        DOC.write_text(text)
    committed = DOC.read_text()
    if f"transformers {transformers.__version__}," not in committed:
        pytest.skip(f"docs/families.md was generated with another transformers than {transformers.__version__}")
    assert committed == text, "docs/families.md is stale: rerun with MOE_RL_WRITE_FAMILIES=1"


def test_hunyuan_weight_is_found_where_it_lives():
    family = next(f for f in moe_families() if f.model_type == "hunyuan_v1_moe")
    model = _build(family)
    layer = find_moe_layers(model)[0]
    assert layer.weight is layer.router.wg.weight


def test_pick_rule_prefers_the_bitwise_rule():
    """GraniteMoe's weights are softmax(top-k logits): softmax_topk matches to ~1e-7, softmax_selected exactly."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 8, generator=g)
    top, idx = logits.topk(2, dim=-1)
    weights = torch.softmax(top, dim=-1)
    router = torch.nn.Module()
    assert not torch.equal(softmax_topk(router, logits, idx), weights)  # the tempting near-miss
    assert torch.allclose(softmax_topk(router, logits, idx), weights, rtol=1e-5)
    assert pick_rule(router, logits, weights, idx, GENERIC_RULES) is softmax_selected


def test_refusal_is_a_value_error_naming_the_router_and_reason():
    family = next(f for f in moe_families() if f.model_type == "llama4_text")
    model = _build(family)
    x = torch.randint(3, 100, (1, 5))
    with pytest.raises(UnsupportedRouterError, match=r"Llama4Router.*not \(logits, weights, indices\)") as err:
        with RouteRecorder(model):
            model(x, use_cache=False)
    assert isinstance(err.value, ValueError) and err.value.router == "Llama4Router"


def test_tiny_config_shrinks_and_keeps_layer_kinds():
    config = tiny_config("qwen3_next")  # hybrid linear/full attention: both kinds survive the cut
    assert config.num_hidden_layers == 2 and config.hidden_size == 64 and config.num_experts == 8
    assert set(config.layer_types) == {"linear_attention", "full_attention"}
    config = tiny_config("deepseek_v3")  # first layer dense: one more layer
    assert config.num_hidden_layers == 3 and config.first_k_dense_replace == 1 and config.vocab_size == 128


def test_replay_on_a_refused_model_raises_the_refusal_not_an_internal_error():
    family = next(f for f in moe_families() if f.model_type == "phimoe")
    model = _build(family)
    layers = find_moe_layers(model)
    from moe_rl.routing import Routes

    routes = Routes.from_topk(
        torch.zeros(1, 4, len(layers), 2, dtype=torch.long) + torch.tensor([0, 1]),
        None,
        [layer.decoder_layer for layer in layers],
        layers[0].num_experts,
    )
    with pytest.raises(UnsupportedRouterError, match="PhimoeTopKRouter.*no gate-weight rule"):
        RouteReplay(model, routes)
