"""Route recording and Routing Replay on every supported family: exactness, alignment, errors."""

from __future__ import annotations

import base64
import copy
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import PROMPTS, generated_and_forced, planted_routes, random_routes, replayed_loss, token_ids

from moe_rl.models import FAMILIES, build_model
from moe_rl.routing import (
    MARGIN_EDGES,
    RoutedPass,
    RouteRecorder,
    RouteReplay,
    Routes,
    compare_routes,
    find_moe_layers,
    flip_margin_counts,
    router_margins,
    router_shift,
)
from moe_rl.routing.compare import router_shift_ratio
from moe_rl.routing.hooks import RouteHooks, filter_replayed
from moe_rl.routing.layers import returns_router_logits

FAMILY_NAMES = sorted(FAMILIES)


def _capture_experts(model):
    """Pre-hooks on every experts module recording the (index, weight) tensors they receive."""
    seen, handles = [], []
    for layer in find_moe_layers(model):
        experts = model.get_submodule(layer.name.rsplit(".", 1)[0]).experts

        def hook(module, args, kwargs):
            seen.append((args[1].detach().clone(), args[2].detach().clone()))

        handles.append(experts.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("top_k", [2, 4])
def test_self_replay_is_bitwise_identical(family: str, top_k: int) -> None:
    model = build_model(family, top_k=top_k)
    x = token_ids()
    plain = model(x).logits
    with RouteRecorder(model) as rec:
        recorded = model(x).logits
    with RouteReplay(model, rec.routes) as replay:
        replayed = model(x).logits
    assert replay.passes == 1
    assert torch.equal(plain, recorded)
    assert torch.equal(plain, replayed)
    assert rec.routes.indices.dtype == torch.uint8
    assert rec.routes.shape == (3, 12, len(find_moe_layers(model)), top_k)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_forced_routes_reach_experts_and_router_learns(family: str) -> None:
    model = build_model(family)
    x = token_ids(B=4, T=16)
    routes = random_routes(model, 4, 16)
    seen, handles = _capture_experts(model)
    loss = replayed_loss(model, x, RouteReplay(model, routes), handles)
    L = routes.shape[2]
    assert len(seen) == L
    for i, (idx, _) in enumerate(seen):
        got = idx.view(4, 16, -1).sort(-1).values
        assert torch.equal(got, routes.indices[:, :, i].long())
    loss.backward()
    for layer in find_moe_layers(model):
        grad = layer.router.weight.grad
        assert grad is not None and bool((grad.norm(dim=1) > 0).all()), layer.name


def _expected_weights(family: str, router, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Each family's gate weight written out by hand from the model code."""
    if family == "deepseek_v3":
        s = torch.sigmoid(logits.float()).gather(-1, idx)
        return s / (s.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
    if family == "gpt_oss":
        return torch.softmax(logits.gather(-1, idx), -1)
    p = torch.softmax(logits.float(), -1).gather(-1, idx)
    normalise = family == "mixtral" or router.norm_topk_prob
    return p / p.sum(-1, keepdim=True) if normalise else p


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_forced_expert_outside_topk_gets_true_weight(family: str) -> None:
    model = build_model(family)
    x = token_ids(B=2, T=8)
    with RouteRecorder(model) as rec:
        model(x)
    native = rec.routes
    E = native.num_experts
    # For every (position, layer) force the two lowest-numbered experts the router did NOT choose.
    chosen = F.one_hot(native.indices.long(), E).sum(-2).bool()  # (B, T, L, E)
    outside = torch.sort((~chosen).float(), dim=-1, descending=True, stable=True).indices[..., :2]
    forced = Routes.from_topk(outside, None, native.layer_map, E)
    layers = find_moe_layers(model)
    replay = RouteReplay(model, forced)  # before the capture hooks: attaching probes the routers
    logits_seen = []
    handles = [
        layer.router.register_forward_hook(lambda m, a, o: logits_seen.append(o[0].detach())) for layer in layers
    ]
    seen, ehandles = _capture_experts(model)
    try:
        with torch.no_grad(), replay:
            model(x)
    finally:
        for h in handles + ehandles:
            h.remove()
    assert compare_routes(native, forced)["expert_flip_frac"] == 1.0
    for layer, logits, (idx, weights) in zip(layers, logits_seen, seen):
        expected = _expected_weights(family, layer.router, logits, idx)
        assert bool((weights > 0).all())
        torch.testing.assert_close(weights.float(), expected.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_generate_routes_match_teacher_forced_on_left_padded_batch(family: str) -> None:
    model = build_model(family)
    prompts = PROMPTS
    rec, tf, out, full_mask = generated_and_forced(model, prompts, 6)
    routes = rec.routes
    assert len(rec.records) == 1
    assert routes.shape[:2] == (3, out.shape[1] - 1)
    assert torch.equal(routes.mask, full_mask[:, :-1].bool())
    metrics = compare_routes(routes, tf.routes)
    assert metrics["flip_rate"] == 0.0
    valid = routes.mask
    assert torch.equal(routes.indices[valid], tf.routes.indices[valid])
    assert int(valid.sum()) == sum(len(p) for p in prompts) + 3 * 5


def test_gradient_checkpointing_records_once_and_replays_exactly() -> None:
    model = build_model("qwen3_moe")
    model.train()
    x = token_ids(B=2, T=10)
    routes = random_routes(model, 2, 10)

    def grads() -> dict[str, torch.Tensor]:
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        return out

    model(x).logits.pow(2).mean().backward()
    native = grads()
    with RouteReplay(model, routes):
        reference_logits = model(x).logits
        reference_logits.pow(2).mean().backward()
    reference = grads()

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = find_moe_layers(model)
    replay = RouteReplay(model, routes, record_native=True)
    calls = []
    counters = [layer.router.register_forward_hook(lambda m, a, o: calls.append(1)) for layer in layers]
    with replay, RouteRecorder(model) as rec:
        logits = model(x).logits
        logits.pow(2).mean().backward()
    checkpointed = grads()
    for h in counters:
        h.remove()
    assert len(calls) == 2 * len(layers)  # forward + recomputation during backward
    assert len(rec.records) == 1 and rec.routes.shape == routes.shape
    assert torch.equal(rec.routes.indices, routes.indices)  # the recorder sees what replay forced
    assert replay.passes == 1
    assert torch.equal(logits, reference_logits)
    # Checkpointing only reorders the backward accumulation (differences ~1e-11); had the
    # recomputation used native routes, the expert gradients would differ by ~1e-3.
    for name in reference:
        torch.testing.assert_close(checkpointed[name], reference[name], rtol=0, atol=1e-9)
    assert max((native[n] - reference[n]).abs().max().item() for n in reference) > 1e-4


def test_recording_is_identical_under_no_grad_and_autograd() -> None:
    model = build_model("olmoe")
    x = token_ids()
    with RouteRecorder(model) as a:
        model(x)
    with torch.no_grad(), RouteRecorder(model) as b:
        model(x)
    assert torch.equal(a.routes.indices, b.routes.indices)


def test_margins_are_recorded_and_hand_checked() -> None:
    scores = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    torch.testing.assert_close(router_margins(scores, 2), torch.tensor([0.15, 0.0]))
    model = build_model("qwen3_moe")
    with torch.no_grad(), RouteRecorder(model, margins=True) as rec:
        model(token_ids())
    assert rec.margins.shape == (3, 12, 2)
    assert bool((rec.margins >= 0).all()) and bool((rec.margins > 0).any())


# --- errors, not silence ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen():
    return build_model("qwen3_moe")


def _routes_of(model, x) -> Routes:
    with torch.no_grad(), RouteRecorder(model) as rec:
        model(x)
    return rec.routes


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda r, x: (r, x[:2]), "batch size 2 != routes batch size 3"),
        (lambda r, x: (r, x[:, :5]), "sequence length 5 != routes sequence length 12"),
    ],
)
def test_replay_shape_mismatch_raises(qwen, change, match: str) -> None:
    x = token_ids()
    routes, x = change(_routes_of(qwen, x), x)
    with pytest.raises(ValueError, match=match):
        with RouteReplay(qwen, routes):
            qwen(x)
    assert _none_open(qwen)


def test_replay_validation_errors(qwen) -> None:
    routes = _routes_of(qwen, token_ids())
    one_layer = Routes(routes.indices[:, :, :1], routes.mask, routes.layer_map[:1], routes.num_experts)
    with pytest.raises(ValueError, match="routes have 1 MoE layers, the model has 2"):
        RouteReplay(qwen, one_layer)
    k1 = Routes(routes.indices[..., :1], routes.mask, routes.layer_map, routes.num_experts)
    with pytest.raises(ValueError, match="routes have k=1, MoE layer 0 .* top_k=2"):
        RouteReplay(qwen, k1)
    bad = routes.indices.clone()
    bad[0, 0, 0, 1] = 8
    with pytest.raises(ValueError, match="expert id 8 out of range for num_experts=8"):
        RouteReplay(qwen, Routes(bad, routes.mask, routes.layer_map, 8))
    with pytest.raises(ValueError, match="num_experts=16"):
        RouteReplay(qwen, Routes(routes.indices, routes.mask, routes.layer_map, 16))
    with pytest.raises(ValueError, match="layer_map"):
        RouteReplay(qwen, Routes(routes.indices, routes.mask, (3, 4), 8))
    dup = routes.indices.clone()
    dup[0, 0, 0] = torch.tensor([3, 3], dtype=dup.dtype)
    with pytest.raises(ValueError, match="repeat an expert"):
        RouteReplay(qwen, Routes(dup, routes.mask, routes.layer_map, 8))


def test_replay_not_applied_to_every_layer_raises() -> None:
    model = build_model("qwen3_moe")
    x = token_ids()
    routes = _routes_of(model, x)
    block = model.model.layers[1].mlp
    router = block.gate

    def bypass(hidden_states):  # a fused kernel that routes internally, never calling the router
        B, T, H = hidden_states.shape
        h = hidden_states.view(-1, H)
        probs = torch.softmax(F.linear(h, router.weight), -1)
        w, idx = probs.topk(router.top_k, -1)
        return block.experts(h, idx, w / w.sum(-1, keepdim=True)).view(B, T, H)

    block.forward = bypass
    with pytest.raises(RuntimeError, match=r"armed but not applied to MoE layers \['model.layers.1.mlp.gate'\]"):
        with RouteReplay(model, routes):
            model(x)
    with pytest.raises(RuntimeError, match="router was bypassed"):
        with RouteRecorder(model) as rec:
            model(x)
        _ = rec.routes


def test_replay_without_forward_pass_raises(qwen) -> None:
    routes = _routes_of(qwen, token_ids())
    with pytest.raises(RuntimeError, match="no forward pass ran"):
        with RouteReplay(qwen, routes):
            pass


def test_model_without_moe_layer_raises() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(ValueError, match="has no MoE layer"):
        RouteRecorder(dense)


def _hook_counts(model) -> list[int]:
    routers = [layer.router for layer in find_moe_layers(model)]
    return [len(model._forward_pre_hooks), len(model._forward_hooks), *(len(r._forward_hooks) for r in routers)]


def _none_open(model) -> bool:
    """No route context is open on `model`: its route hooks (registered once) run none, and none is in a pass."""
    hooks = RouteHooks.of(model)
    return not hooks.front and not hooks.back


def test_contexts_leave_the_model_when_the_body_raises(qwen) -> None:
    routes = _routes_of(qwen, token_ids())
    with pytest.raises(KeyError):
        with RouteRecorder(qwen) as rec, RouteReplay(qwen, routes) as replay:
            qwen(token_ids())
            raise KeyError("boom")
    assert _none_open(qwen) and not rec.in_pass and not replay.in_pass


def test_route_hooks_are_registered_once_per_model(qwen) -> None:
    """Opening a context registers no hook: the model's hooks are the same whatever is open (a compiled model's
    graphs so never meet a new hook), two on each router and a pre and a post hook on the model."""
    x = token_ids()
    routes = _routes_of(qwen, x)
    counts = _hook_counts(qwen)
    assert counts == [1, 1] + [2] * (len(counts) - 2)
    with RouteReplay(qwen, routes), RouteRecorder(qwen) as rec:
        assert _hook_counts(qwen) == counts
        with torch.no_grad():
            qwen(x)
    assert torch.equal(rec.routes.indices, routes.indices) and _none_open(qwen)
    with RoutedPass(qwen, routes) as routed, torch.no_grad():
        qwen(x)
    assert torch.equal(routed.used.indices, routes.indices) and _hook_counts(qwen) == counts


def test_a_deep_copy_has_route_hooks_of_its_own(qwen) -> None:
    """A copy of a model whose route hooks are registered carries hooks bound to the copy: a context on the copy
    records the copy's pass, and a context on the original sees nothing of it."""
    x = token_ids()
    routes = _routes_of(qwen, x)
    twin = copy.deepcopy(qwen)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(torch.randn_like(p))  # another model, other routes
    with RouteRecorder(qwen) as original, RouteRecorder(twin) as copied, torch.no_grad():
        twin(x)
    assert not original._records and len(copied.records) == 1
    assert compare_routes(copied.routes, routes)["expert_flip_frac"] > 0
    assert RouteHooks.of(twin) is not RouteHooks.of(qwen) and RouteHooks.of(twin).model is twin
    assert _hook_counts(twin) == _hook_counts(qwen)


def test_generic_router_rule_and_its_check() -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    class CustomRouter(Qwen3MoeTopKRouter):  # same contract, unknown class name -> generic rule
        pass

    class TemperedRouter(Qwen3MoeTopKRouter):  # weights no generic rule can reproduce
        def forward(self, hidden_states):
            logits, weights, idx = super().forward(hidden_states)
            return logits, torch.softmax(weights * 3.0, -1), idx

    for cls, ok in [(CustomRouter, True), (TemperedRouter, False)]:
        model = build_model("qwen3_moe")
        for layer in model.model.layers:
            new = cls(model.config)
            new.load_state_dict(layer.mlp.gate.state_dict())
            layer.mlp.gate = new
        x = token_ids()
        if ok:
            plain = model(x).logits
            routes = _routes_of(model, x)
            with RouteReplay(model, routes):
                assert torch.equal(model(x).logits, plain)
        else:
            with pytest.raises(ValueError, match="no gate-weight rule reproduces"):
                RouteReplay(model, _routes_of(model, x))


# --- compare_routes and Routes ----------------------------------------------------------------


def test_compare_routes_hand_built() -> None:
    # B=1, T=3, L=2, k=2. Position 0: identical; 1: layer 0 swaps one expert; 2: layer 1 swaps both.
    a = planted_routes([[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[4, 5], [6, 7]]]])
    b = planted_routes([[[[1, 0], [2, 3]], [[0, 2], [2, 3]], [[4, 5], [0, 1]]]])
    m = compare_routes(a, b)
    assert m["flip_rate"] == pytest.approx(2 / 6)
    assert m["expert_flip_frac"] == pytest.approx((0.5 + 1.0) / 6)
    assert m["token_flip_rate"] == pytest.approx(2 / 3)
    assert m["flip_rate/layer_0"] == pytest.approx(1 / 3)
    assert m["flip_rate/layer_1"] == pytest.approx(1 / 3)
    assert m["expert_flip_frac/layer_1"] == pytest.approx(1 / 3)
    # Masking out position 2 in either argument removes its flip.
    masked = compare_routes(a, planted_routes(b.indices.tolist(), [[True, True, False]]))
    assert masked["flip_rate"] == pytest.approx(1 / 4)
    assert masked["token_flip_rate"] == pytest.approx(1 / 2)


def test_compare_routes_against_slow_loop() -> None:
    g = torch.Generator().manual_seed(3)
    B, T, L, E, k = 3, 7, 3, 6, 2
    a_idx = torch.rand(B, T, L, E, generator=g).argsort(-1)[..., :k]
    b_idx = torch.where(
        torch.rand(B, T, L, 1, generator=g) < 0.6, a_idx, torch.rand(B, T, L, E, generator=g).argsort(-1)[..., :k]
    )
    ma, mb = torch.rand(B, T, generator=g) < 0.8, torch.rand(B, T, generator=g) < 0.8
    a = Routes.from_topk(a_idx, ma, range(L), E)
    b = Routes.from_topk(b_idx, mb, range(L), E)
    fast = compare_routes(a, b)
    flips, expert, tokens, per_layer = [], [], [], [[] for _ in range(L)]
    for i, t in itertools.product(range(B), range(T)):
        if not (ma[i, t] and mb[i, t]):
            continue
        token_flip = False
        for layer in range(L):
            sa, sb = set(a_idx[i, t, layer].tolist()), set(b_idx[i, t, layer].tolist())
            flips.append(sa != sb)
            per_layer[layer].append(sa != sb)
            expert.append(1 - len(sa & sb) / k)
            token_flip |= sa != sb
        tokens.append(token_flip)
    assert fast["flip_rate"] == pytest.approx(np.mean(flips))
    assert fast["expert_flip_frac"] == pytest.approx(np.mean(expert))
    assert fast["token_flip_rate"] == pytest.approx(np.mean(tokens))
    for layer in range(L):
        assert fast[f"flip_rate/layer_{layer}"] == pytest.approx(np.mean(per_layer[layer]))


def test_compare_routes_shape_mismatch() -> None:
    a = planted_routes([[[[0, 1]]]])
    b = planted_routes([[[[0, 1]], [[0, 1]]]])
    with pytest.raises(ValueError, match="shapes differ"):
        compare_routes(a, b)


def test_routes_dtype_sorting_and_save_load(tmp_path) -> None:
    r = Routes.from_topk(torch.tensor([[[[5, 2]], [[7, 1]]]]), torch.tensor([[True, False]]), [3], 8)
    assert r.indices.dtype == torch.uint8 and r.indices.tolist() == [[[[2, 5]], [[1, 7]]]]
    assert r.bytes_per_token_layer() == 2
    (tmp_path / "r.safetensors").write_bytes(r.to_safetensors())
    back = Routes.load(tmp_path / "r.safetensors")
    assert torch.equal(back.indices, r.indices) and torch.equal(back.mask, r.mask)
    assert back.layer_map == (3,) and back.num_experts == 8
    big = Routes.from_topk(torch.tensor([[[[299, 3]]]]), None, [0], 300)
    assert big.indices.dtype == torch.int16 and big.bytes_per_token_layer() == 4
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\)"):
        Routes.from_topk(torch.tensor([[[[9, 3]]]]), None, [0], 8)
    (tmp_path / "bad.safetensors").write_bytes(b"not a routes file")
    with pytest.raises(ValueError, match="bad.safetensors is not a readable routes file"):
        Routes.load(tmp_path / "bad.safetensors")
    truncated = (tmp_path / "r.safetensors").read_bytes()[:-3]
    (tmp_path / "trunc.safetensors").write_bytes(truncated)
    with pytest.raises(ValueError, match="trunc.safetensors"):
        Routes.load(tmp_path / "trunc.safetensors")
    from moe_rl.routing import load_snapshot

    assert load_snapshot(tmp_path / "r.safetensors")[1] is None  # saved without token ids
    (tmp_path / "t.safetensors").write_bytes(r.to_safetensors(torch.tensor([[17, 4]])))
    routes, ids = load_snapshot(tmp_path / "t.safetensors")
    assert ids.tolist() == [[17, 4]] and torch.equal(routes.indices, r.indices)
    assert torch.equal(Routes.load(tmp_path / "t.safetensors").mask, r.mask)
    with pytest.raises(ValueError, match=r"token_ids of shape \(1, 3\) for routes of \(B, T\) \(1, 2\)"):
        r.to_safetensors(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_is_tiny(family: str) -> None:
    params = sum(p.numel() for p in build_model(family).parameters())
    assert 50_000 < params < 1_000_000, params


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 8, 9])
def test_sort_topk_matches_torch_sort(k: int) -> None:
    from moe_rl.routing.routes import sort_topk

    ids = torch.rand(50, 3, 16, generator=torch.Generator().manual_seed(k)).argsort(-1)[..., :k].to(torch.uint8)
    assert torch.equal(sort_topk(ids), ids.sort(dim=-1).values)


def test_routes_constructor_keeps_the_contract() -> None:
    unsorted = Routes(torch.tensor([[[[5, 1]]]], dtype=torch.uint8), torch.ones(1, 1, dtype=torch.bool), (0,), 8)
    assert unsorted.indices.tolist() == [[[[1, 5]]]]
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\), got \[1, 260\]"):
        Routes(torch.tensor([[[[260, 1]]]]), torch.ones(1, 1, dtype=torch.bool), (0,), 8)


def test_routes_from_vllm_and_sglang() -> None:
    seq0 = np.array([[[1, 0], [3, 2]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]], dtype=np.int32)  # 3 positions
    seq1 = np.array([[[7, 6], [5, 4]]], dtype=np.int32)  # 1 position
    r = Routes.from_vllm([seq0, seq1], num_experts=8)
    assert r.shape == (2, 3, 2, 2)
    assert r.mask.tolist() == [[True, True, True], [True, False, False]]
    assert r.indices[0, 0].tolist() == [[0, 1], [2, 3]] and r.indices[1, 0].tolist() == [[6, 7], [4, 5]]
    encoded = [base64.b64encode(s.tobytes()).decode() for s in (seq0, seq1)]
    s = Routes.from_sglang(encoded, num_layers=2, top_k=2, num_experts=8)
    assert torch.equal(s.indices, r.indices) and torch.equal(s.mask, r.mask)
    with pytest.raises(ValueError, match="not a multiple of num_layers"):
        Routes.from_sglang(
            base64.b64encode(np.arange(3, dtype=np.int32).tobytes()).decode(), num_layers=2, top_k=2, num_experts=8
        )
    with pytest.raises(ValueError, match="expert ids must lie"):
        Routes.from_vllm([seq0], num_experts=4)


def _engine(rows: list[list[list[int]]], dtype=np.int32) -> np.ndarray:
    """(n, L=1, k=2) engine routes from [[a, b], ...] rows."""
    return np.array(rows, dtype=dtype).reshape(len(rows), 1, 2)


def test_routes_from_vllm_split_joined_masked_and_left_padded() -> None:
    p0, c0 = _engine([[-1, -1], [-1, -1], [2, 1]], np.int16), _engine([[3, 4], [5, 6]], np.int16)  # 2 cached
    p1, c1 = _engine([[0, 7]]), _engine([[1, 2], [3, 4], [5, 6]])
    split = Routes.from_vllm([c0, c1], prompt_routed_experts=[p0, p1], num_experts=8)
    assert split.shape == (2, 5, 1, 2)
    assert split.mask.tolist() == [[False, False, True, True, True], [True, True, True, True, False]]
    assert split.indices[0, :, 0].tolist() == [[0, 0], [0, 0], [1, 2], [3, 4], [5, 6]]  # -1 never read as an id
    joined = Routes.from_vllm([np.concatenate([p0, c0]), np.concatenate([p1, c1])], num_experts=8)
    assert torch.equal(joined.indices, split.indices) and torch.equal(joined.mask, split.mask)
    # Left: completions start at one column (the longest prompt, 3), as in the harness's batches.
    left = Routes.from_vllm([c0, c1], prompt_routed_experts=[p0, p1], num_experts=8, padding_side="left")
    assert left.shape == (2, 6, 1, 2)
    assert left.mask.tolist() == [[False, False, True, True, True, False], [False, False, True, True, True, True]]
    assert left.indices[0, 3, 0].tolist() == [3, 4] and left.indices[1, 3, 0].tolist() == [1, 2]
    assert left.indices[1, 2, 0].tolist() == [0, 7]
    joined_left = Routes.from_vllm([c0, np.concatenate([p1, c1])], num_experts=8, padding_side="left", length=5)
    assert joined_left.mask.tolist() == [[False, False, False, True, True], [False, True, True, True, True]]
    with pytest.raises(ValueError, match="all zero"):
        Routes.from_vllm([np.zeros((4, 2, 2), dtype=np.int32)], num_experts=8)
    with pytest.raises(ValueError, match=r"repeat an expert within one top-k \(request 1, position 1\)"):
        Routes.from_vllm([c0, _engine([[1, 2], [3, 3]])], num_experts=8)
    with pytest.raises(ValueError, match="dtype torch.float32; expert ids are integers"):
        Routes.from_vllm([c0.astype(np.float32)], num_experts=8)
    with pytest.raises(ValueError, match="padding_side='middle'"):
        Routes.from_vllm([c0], num_experts=8, padding_side="middle")


def test_routes_from_sglang_meta_info_with_cached_positions() -> None:
    rows = _engine([[-1, -1], [4, 1], [6, 2]])
    meta_info = {"routed_experts": base64.b64encode(rows.tobytes()).decode()}
    r = Routes.from_sglang([meta_info], num_layers=1, top_k=2, num_experts=8, padding_side="left", length=4)
    assert r.mask.tolist() == [[False, False, True, True]]
    assert r.indices[0, 2:, 0].tolist() == [[1, 4], [2, 6]]
    with pytest.raises(ValueError, match="request 0: routed_experts is not base64"):
        Routes.from_sglang("***", num_layers=1, top_k=2, num_experts=8)


def test_engine_routes_replay_keeps_the_live_router_at_masked_positions() -> None:
    model = build_model("qwen3_moe")
    x = token_ids(B=1, T=10)
    with RouteRecorder(model) as rec:
        model(x)
    native = rec.routes
    forced = random_routes(model, 1, 10, seed=5)
    engine = forced.indices[0].numpy().astype(np.int32).copy()  # (T, L, k)
    engine[:4] = -1  # prefix-cached: no route returned
    routes = Routes.from_vllm([engine], num_experts=8, layer_map=native.layer_map)
    from moe_rl.routing import RoutedPass

    with RoutedPass(model, routes) as routed:
        model(x)
    used = routed.used.indices
    assert torch.equal(used[0, :4], native.indices[0, :4])  # live router where the engine had no route
    assert torch.equal(used[0, 4:], forced.indices[0, 4:])
    with RoutedPass(model, routes, threshold=0.0) as routed:  # thresholded: the masked ids are never read
        model(x)
    assert torch.equal(routed.used.indices, used)
    assert routed.fallback.tolist() == [0, 6 * routes.shape[2] * routes.top_k]  # slots of the 6 routed positions


# --- router shift and flip-vs-margin (hand-built inputs) ----------------------------------------


def test_router_shift_hand_computed() -> None:
    # B=1, T=2, L=2, k=1, E=4. Token 0: layer 0's old expert keeps p=0.5, layer 1's goes 0.4 -> 0.2.
    old = planted_routes([[[[0], [1]], [[2], [3]]]], num_experts=4)
    p_old = torch.tensor([[[[0.5, 0.2, 0.2, 0.1], [0.3, 0.4, 0.2, 0.1]], [[0.1, 0.1, 0.7, 0.1], [0.1, 0.1, 0.1, 0.7]]]])
    p_new = p_old.clone()
    p_new[0, 0, 1] = torch.tensor([0.3, 0.2, 0.4, 0.1])  # layer 1, token 0: expert 1 at 0.2
    mask = torch.tensor([[True, True]])
    m = router_shift(p_old, p_new, old, mask)
    gamma0 = math.exp(-(0.0 + abs(math.log(0.2 / 0.4))) / 2)  # mean over layers of |log ratio|
    assert m["shift/mean"] == pytest.approx((gamma0 + 1.0) / 2)
    assert m["shift/p10"] == pytest.approx(torch.tensor([gamma0, 1.0], dtype=torch.float64).quantile(0.1).item())
    assert m["shift/layer_0"] == pytest.approx(1.0)
    assert m["shift/layer_1"] == pytest.approx((0.5 + 1.0) / 2)
    # The unchanged token alone: no shift. No valid token: NaN.
    assert router_shift(p_old, p_new, old, torch.tensor([[False, True]]))["shift/mean"] == pytest.approx(1.0)
    assert math.isnan(router_shift(p_old, p_new, old, torch.tensor([[False, False]]))["shift/mean"])
    # Identical routers: exactly 1 everywhere.
    assert router_shift(p_old, p_old, old, mask)["shift/p10"] == 1.0


def test_flip_margin_counts_hand_built() -> None:
    # B=1, T=3, L=2, k=1; flips at (t=0, l=1) and (t=2, l=0).
    old = planted_routes([[[[0], [1]], [[2], [3]], [[1], [1]]]], num_experts=4)
    new = planted_routes([[[[0], [2]], [[2], [3]], [[3], [1]]]], num_experts=4)
    margins = torch.tensor([[[0.5, 5e-5], [2e-3, 2e-3], [5e-5, 0.02]]])
    n, flips = flip_margin_counts(old, new, margins, edges=(0.0, 1e-4, 1e-2, float("inf")))
    assert n.tolist() == [2, 2, 2]
    assert flips.tolist() == [2, 0, 0]
    # A masked position leaves every bin.
    new_masked = planted_routes(new.indices.tolist(), [[True, True, False]], 4)
    n, flips = flip_margin_counts(old, new_masked, margins, edges=(0.0, 1e-4, 1e-2, float("inf")))
    assert n.tolist() == [1, 2, 1] and flips.tolist() == [1, 0, 0]
    # Default edges: counts add up to the valid (t, l) and the flips to compare_routes' flip rate.
    n, flips = flip_margin_counts(old, new, margins)
    assert n.sum() == 6 and flips.sum() / 6 == pytest.approx(compare_routes(old, new)["flip_rate"])
    assert len(n) == len(MARGIN_EDGES) - 1


def test_recorder_scores_are_router_probabilities() -> None:
    model = build_model("qwen3_moe")
    with torch.no_grad(), RouteRecorder(model, scores=True, margins=True) as rec:
        model(token_ids())
    scores = rec.scores  # (B, T, L, E)
    assert scores.shape == (3, 12, 2, 8)
    torch.testing.assert_close(scores.sum(-1), torch.ones(3, 12, 2))
    # The recorded top-k are the top-k of the recorded scores; margins agree with the scores.
    top = scores.topk(2, dim=-1).indices.sort(-1).values
    assert torch.equal(top, rec.routes.indices.long())
    torch.testing.assert_close(rec.margins, router_margins(scores, 2))


# ---------------------------------------------------------------- thresholded replay and Total Router Recall


def test_filter_replayed_hand_built() -> None:
    # live scores of one token, native top-2 {0, 1}: the weakest live top-k score is 0.30, so with
    # ratio 0.5 a replayed expert stays where its score is >= 0.15
    scores = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05]]).expand(3, 5)
    native = torch.tensor([[0, 1], [0, 1], [0, 1]])
    forced = torch.tensor([[2, 3], [1, 4], [3, 4]])
    ids, refilled = filter_replayed(forced, native, scores, 0.5)
    # row 0: 2 (0.15) kept, 3 (0.10) refilled with the best live expert, 0
    # row 1: 1 (0.30) kept, 4 (0.05) refilled with the best live expert not kept: 0
    # row 2: neither kept: the live choice 0, 1
    assert ids.tolist() == [[2, 0], [1, 0], [0, 1]]
    assert refilled.tolist() == [[False, True], [False, True], [True, True]]
    ids0, refilled0 = filter_replayed(forced, native, scores, 0.0)  # ratio 0: plain replay
    assert torch.equal(ids0, forced) and not refilled0.any()


def test_thresholded_replay_keeps_or_falls_back_by_the_live_scores() -> None:
    model = build_model("qwen3_moe")
    x = token_ids(B=2, T=8)
    plain = model(x).logits
    routes = random_routes(model, 2, 8)
    with RouteReplay(model, routes) as replay:
        forced = model(x).logits
    with RouteReplay(model, routes, threshold=0.0) as replay:
        assert torch.equal(model(x).logits, forced)  # ratio 0 keeps every replayed expert
    assert replay.fallback.tolist() == [0, 2 * 8 * routes.shape[2] * routes.top_k]
    with RouteReplay(model, routes, threshold=1e9) as replay:
        assert torch.equal(model(x).logits, plain)  # nothing passes: the live routes, bitwise
    assert replay.fallback.tolist() == [2 * 8 * routes.shape[2] * routes.top_k] * 2
    # in between, the experts receive exactly what filter_replayed keeps on the live scores
    with RoutedPass(model, routes, threshold=0.9, scores=True) as routed:
        model(x)
    layers = find_moe_layers(model)
    refilled_total = 0
    for i in range(len(layers)):
        native = routed.native.indices[:, :, i].reshape(16, -1).long()
        by_score = routed.scores[:, :, i].reshape(16, -1).gather(-1, native).argsort(-1, descending=True)
        ids, refilled = filter_replayed(
            routes.indices[:, :, i].reshape(16, -1).long(),
            native.gather(-1, by_score),
            routed.scores[:, :, i].reshape(16, -1),
            0.9,  # the tiny router's scores are near uniform: a ratio near 1 rejects some
        )
        assert torch.equal(routed.used.indices[:, :, i].reshape(16, -1).long(), ids.sort(-1).values)
        refilled_total += int(refilled.sum())
    assert routed.fallback.tolist() == [refilled_total, 2 * 8 * len(layers) * routes.top_k]
    assert 0 < refilled_total < 2 * 8 * len(layers) * routes.top_k  # the case exercises both branches


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_total_router_recall_self_replay_is_bitwise_identical(family: str) -> None:
    model = build_model(family)
    x = token_ids()
    plain = model(x).logits
    with RouteRecorder(model, weights=True) as rec:
        model(x)
    assert rec.weights.dtype == torch.float32 and rec.weights.shape == rec.routes.shape
    with RouteReplay(model, rec.routes, weights=rec.weights):
        assert torch.equal(model(x).logits, plain)


def test_total_router_recall_forces_the_recorded_weights_and_the_router_gets_no_gradient() -> None:
    model = build_model("qwen3_moe")
    x = token_ids(B=2, T=8)
    with RouteRecorder(model, weights=True) as rec:
        model(x)
    layers = find_moe_layers(model)
    with torch.no_grad():  # move the routers: their live weights now differ from the recorded ones
        for layer in layers:
            layer.router.weight.add_(torch.randn_like(layer.router.weight, generator=None) * 0.5)
    replay = RouteReplay(model, rec.routes, weights=rec.weights)
    seen, handles = _capture_experts(model)
    loss = replayed_loss(model, x, replay, handles)
    for i, (idx, weights) in enumerate(seen):
        order = idx.argsort(-1)
        assert torch.equal(idx.gather(-1, order).view(2, 8, -1), rec.routes.indices[:, :, i].long())
        assert torch.equal(weights.gather(-1, order).view(2, 8, -1), rec.weights[:, :, i])  # bitwise
    loss.backward()
    for layer in layers:
        assert layer.router.weight.grad is not None and layer.router.weight.grad.eq(0).all(), layer.name
        assert any(
            p.grad is not None and p.grad.abs().sum() > 0
            for p in model.get_submodule(layer.name.rsplit(".", 1)[0]).experts.parameters()
        )


def test_total_router_recall_rejects_a_threshold_and_mismatched_weights(qwen) -> None:
    x = token_ids(B=2, T=8)
    with RouteRecorder(qwen, weights=True) as rec:
        qwen(x)
    with pytest.raises(ValueError, match="thresholded replay changes the ids"):
        RouteReplay(qwen, rec.routes, threshold=0.5, weights=rec.weights)
    with pytest.raises(ValueError, match=r"weights shape \(2, 8, 2, 1\) != routes shape"):
        RouteReplay(qwen, rec.routes, weights=rec.weights[..., :1])


def test_router_shift_ratio_on_a_planted_shift() -> None:
    # one layer, k = 2, old top-2 {0, 1} with p_old = [0.4, 0.3, 0.2, 0.1]; token 0's router moves to
    # [0.2, 0.6, 0.1, 0.1]: |ln(0.2/0.4)| = |ln(0.6/0.3)| = ln 2, mean ln 2, gamma = 1/2. Token 1 keeps
    # its probabilities (gamma = 1); token 2 is masked (gamma 1 whatever its scores)
    old_scores = torch.tensor([0.4, 0.3, 0.2, 0.1]).expand(1, 3, 1, 4)
    new_scores = torch.stack(
        [torch.tensor([0.2, 0.6, 0.1, 0.1]), torch.tensor([0.4, 0.3, 0.2, 0.1]), torch.tensor([0.9, 0.0, 0.05, 0.05])]
    ).view(1, 3, 1, 4)
    old = Routes.from_topk(torch.tensor([[[[0, 1]], [[0, 1]], [[0, 1]]]]), None, [0], 4)
    mask = torch.tensor([[True, True, False]])
    gamma = router_shift_ratio(old_scores, new_scores, old, mask)
    torch.testing.assert_close(gamma, torch.tensor([[0.5, 1.0, 1.0]], dtype=torch.float64), rtol=1e-15, atol=0)
    # the same gamma the router-shift metric summarises
    assert router_shift(old_scores, new_scores, old, mask)["shift/mean"] == pytest.approx(0.75, rel=1e-14)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_recorded_router_logits_are_what_transformers_returns(family: str) -> None:
    """The old pass's router instruments read the logits the route hooks record, bitwise transformers'
    `output_router_logits=True` (which also computes the load-balancing loss, and whose output capture breaks a
    compiled graph)."""
    model = build_model(family)
    x = token_ids()
    with torch.no_grad(), RouteRecorder(model, logits=True) as rec:
        returned = model(input_ids=x, output_router_logits=True).router_logits
    assert returns_router_logits(model) and len(returned) == len(rec.logits) == len(find_moe_layers(model))
    assert all(torch.equal(a, b) for a, b in zip(returned, rec.logits))
