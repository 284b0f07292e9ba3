"""The MegaBlocks backend: route recording and Routing Replay through MegaBlocks' router contract.

MegaBlocks needs CUDA, so the CPU tests run the real `moe_rl` code paths (block swap, hooks, rules)
on a pure-torch stand-in with the exact interface of megablocks 0.10.0: `LearnedRouter(args)`
returning `(scores, expert_weights, expert_indices)` with `scores` = softmax probabilities and rows
in the order of its input's leading dims, fed (seq, batch, hidden) by `dMoE`, whose experts count
tokens per expert from the indices the router returned and append `(tokens_per_expert, scores)`
to a module-level list in training. The `gpu` tests run the real dMoE.
"""

from __future__ import annotations

import contextlib
from types import MethodType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import PROMPTS, generated_and_forced, random_routes, replayed_loss, token_ids
from torch import nn

from moe_rl.models import build_model
from moe_rl.models.megablocks import (
    MegaBlocksMoeBlock,
    MegaBlocksUnavailable,
    _load,
    build_megablocks_model,
    megablocks_unavailable_reason,
    swap_moe_blocks,
)
from moe_rl.routing import RouteRecorder, RouteReplay, compare_routes, find_moe_layers, router_margins
from moe_rl.routing.hooks import RouteHooks
from moe_rl.routing.layers import hub_kernel_of

# --- a CPU stand-in for megablocks' dMoE --------------------------------------------------------

_LOAD_BALANCING_LOSS: list[tuple[torch.Tensor, torch.Tensor]] = []  # megablocks.layers.moe's list
_ROUTER_LOGITS: list[torch.Tensor] = []  # megablocks.layers.router's z-loss list


def _dtype(args: SimpleNamespace) -> torch.dtype | None:  # megablocks.layers.common.dtype
    return torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else None


class LearnedRouter(nn.Module):
    """megablocks/layers/router.py `LearnedRouter`, line for line (the class name is what is matched)."""

    def __init__(self, args: SimpleNamespace) -> None:
        super().__init__()
        self.args = args
        self.layer = nn.Linear(
            args.hidden_size, args.moe_num_experts, bias=False, device=args.device, dtype=_dtype(args)
        )

    def forward(self, x: torch.Tensor):
        if self.training and self.args.moe_jitter_eps is not None:
            x = x * (1.0 - self.args.moe_jitter_eps + torch.rand_like(x) * 2 * self.args.moe_jitter_eps)
        logits = self.layer(x.view(-1, x.shape[-1]))
        if self.args.moe_zloss_weight:
            _ROUTER_LOGITS.append(logits)
        scores = logits.softmax(dim=-1)
        k = self.args.moe_top_k
        expert_weights, expert_indices = scores.max(dim=-1, keepdim=True) if k == 1 else torch.topk(scores, k, dim=-1)
        if self.args.moe_normalize_expert_weights:
            expert_weights = expert_weights / torch.norm(
                expert_weights, p=self.args.moe_normalize_expert_weights, dim=-1, keepdim=True
            )
        if getattr(self.args, "uniform_expert_assignment", False):  # benchmarking mode: ids replaced after
            uniform = torch.remainder(torch.arange(expert_indices.numel(), device=x.device), self.args.moe_num_experts)
            expert_indices = uniform.view(expert_indices.shape)
        return scores, expert_weights, expert_indices


class _GLU(nn.Module):
    def __init__(self, args: SimpleNamespace) -> None:
        super().__init__()
        rows, H = args.moe_num_experts * args.ffn_hidden_size, args.hidden_size
        self.w1, self.v1, self.w2 = (
            nn.Parameter(torch.empty(rows, H, device=args.device, dtype=_dtype(args))) for _ in range(3)
        )


class StandInExperts(nn.Module):
    """`ParallelDroplessMLP.forward(x, scores, expert_weights, top_experts)`, as a slow loop."""

    def __init__(self, args: SimpleNamespace) -> None:
        super().__init__()
        self.args = args
        self.mlp = _GLU(args)

    def forward(self, x, scores, expert_weights, top_experts):
        in_shape, H, E = x.shape, x.shape[-1], self.args.moe_num_experts
        x = x.reshape(-1, H)
        top, weights = top_experts.flatten(), expert_weights.flatten()  # (N * k,), token-major
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.args.moe_top_k)
        tokens_per_expert = torch.bincount(top, minlength=E)  # ops.histogram of the indices it was handed
        w1, v1, w2 = (w.view(E, -1, H) for w in (self.mlp.w1, self.mlp.v1, self.mlp.w2))
        out = torch.zeros_like(x)
        for e in range(E):
            rows = (top == e).nonzero().squeeze(1)
            h = x[token[rows]]
            y = (F.silu(h @ w1[e].T) * (h @ v1[e].T)) @ w2[e]
            out.index_add_(0, token[rows], y * weights[rows, None])
        if self.training and self.args.moe_loss_weight > 0:
            _LOAD_BALANCING_LOSS.append((tokens_per_expert, scores))
        return out.view(in_shape)


class StandInDMoE(nn.Module):
    """megablocks/layers/moe.py `MoE.forward`: router, then experts on the router's outputs."""

    def __init__(self, args: SimpleNamespace) -> None:
        super().__init__()
        self.router = LearnedRouter(args)
        self.experts = StandInExperts(args)

    def forward(self, x):
        scores, expert_weights, top_experts = self.router(x)
        return self.experts(x, scores, expert_weights, top_experts)


def _stand_in(kwargs: dict) -> nn.Module:
    return StandInDMoE(SimpleNamespace(**kwargs))


def standin_model(top_k: int = 2, device: str = "cpu", moe_dtype: torch.dtype = torch.float32, **overrides):
    model = build_model("qwen3_moe", top_k=top_k, **overrides)
    return swap_moe_blocks(model, _stand_in, device=device, moe_dtype=moe_dtype).to(device).eval()


def _self_replay(model, x: torch.Tensor, context) -> tuple[torch.Tensor, RouteRecorder]:
    """Logits of `x` plain, recorded and replaying the recorded routes (inside `context`): all three bitwise
    equal, the replay's native routes the recorded ones. Returns the plain logits and the recorder."""
    with context:
        plain = model(x).logits
        with RouteRecorder(model) as rec:
            recorded = model(x).logits
        with RouteReplay(model, rec.routes, record_native=True) as replay:
            replayed = model(x).logits
    assert torch.equal(plain, recorded) and torch.equal(plain, replayed)
    assert torch.equal(replay.native_routes.indices, rec.routes.indices)
    return plain, rec


def _capture(model, child: str, argno: int):
    """Forward pre-hooks on `block.moe.<child>` of every MoE block recording positional arg `argno`."""
    seen, handles = [], []
    for module in model.modules():
        if isinstance(module, MegaBlocksMoeBlock):
            target = getattr(module.moe, child)
            handles.append(target.register_forward_pre_hook(lambda m, a: seen.append(a[argno].detach().clone())))
    return seen, handles


# --- CPU: the stand-in through the real hooks ---------------------------------------------------


def test_layers_are_found_sequence_major() -> None:
    model = standin_model()
    layers = find_moe_layers(model)
    assert [layer.name for layer in layers] == ["model.layers.0.mlp.moe.router", "model.layers.1.mlp.moe.router"]
    assert all(layer.seq_major and layer.num_experts == 8 and layer.top_k == 2 for layer in layers)
    assert layers[0].weight is model.model.layers[0].mlp.moe.router.layer.weight


def test_record_matches_batch_major_reference_and_native_family() -> None:
    model, native = standin_model(), build_model("qwen3_moe")
    B, T = 3, 12
    x = token_ids(B, T)
    router_inputs, handles = _capture(model, "router", 0)
    try:
        with torch.no_grad(), RouteRecorder(model, margins=True) as rec:
            logits = model(x).logits
    finally:
        for h in handles:
            h.remove()
    routes = rec.routes
    assert routes.shape == (B, T, 2, 2) and routes.indices.dtype == torch.uint8
    for i, (layer, h) in enumerate(zip(find_moe_layers(model), router_inputs)):
        assert h.shape == (T, B, 64)  # what dMoE hands its router: (seq, batch, hidden)
        probs = torch.softmax(h.transpose(0, 1) @ layer.weight.T, -1)  # (B, T, E), batch-major by construction
        assert torch.equal(routes.indices[:, :, i].long(), probs.topk(2, -1).indices.sort(-1).values)
        torch.testing.assert_close(rec.margins[:, :, i], router_margins(probs, 2))
    # The swapped model computes the family's function: same routes, same logits up to summation order.
    with torch.no_grad(), RouteRecorder(native) as ref:
        reference = native(x).logits
    assert compare_routes(routes, ref.routes)["flip_rate"] == 0.0
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("moe_dtype", [torch.float32, torch.bfloat16])  # bf16: what grouped_gemm computes in
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_self_replay_is_bitwise_identical(top_k: int, moe_dtype: torch.dtype) -> None:
    model = standin_model(top_k=top_k, moe_dtype=moe_dtype)
    plain, _ = _self_replay(model, token_ids(), contextlib.nullcontext())
    assert plain.dtype == torch.float32


def test_forced_routes_reach_experts_with_true_weights_and_router_learns() -> None:
    model = standin_model()
    B, T = 4, 16
    x = token_ids(B, T)
    routes = random_routes(model, B, T)
    replay = RouteReplay(model, routes)  # before the capture hooks: attaching probes the routers
    indices, handles = _capture(model, "experts", 3)
    weights, whandles = _capture(model, "experts", 2)
    scores, shandles = _capture(model, "experts", 1)
    loss = replayed_loss(model, x, replay, handles + whandles + shandles, as_float=False)
    for i, (idx, w, s) in enumerate(zip(indices, weights, scores)):  # router rows: t * B + b
        forced = idx.view(T, B, -1).transpose(0, 1).sort(-1).values
        assert torch.equal(forced, routes.indices[:, :, i].long())
        expected = s.gather(-1, idx)
        torch.testing.assert_close(w, expected / expected.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    loss.backward()
    for layer in find_moe_layers(model):
        grad = layer.weight.grad
        assert grad is not None and bool((grad.norm(dim=1) > 0).all()), layer.name


def test_generate_routes_match_teacher_forced() -> None:
    rec, tf, *_ = generated_and_forced(standin_model(), PROMPTS, 5)
    assert rec.routes.shape == tf.routes.shape
    assert compare_routes(rec.routes, tf.routes)["flip_rate"] == 0.0


def test_load_balancing_statistics_under_replay() -> None:
    """dMoE counts tokens per expert from the indices the router returned: under replay those are
    the forced ones, while `scores` stay the live probabilities that carry the router's gradient.
    One entry per MoE layer per training forward, replayed or not; the caller reads and clears."""
    model = standin_model()
    for layer in find_moe_layers(model):
        layer.router.args.moe_loss_weight = 0.1
    B, T = 2, 10
    x = token_ids(B, T)
    routes = random_routes(model, B, T)
    _LOAD_BALANCING_LOSS.clear()
    with torch.no_grad():
        model(x)  # eval mode: nothing saved
    assert _LOAD_BALANCING_LOSS == []
    model.train()
    with torch.no_grad():
        model(x)
    unreplayed_layer0_scores = _LOAD_BALANCING_LOSS[0][1]
    _LOAD_BALANCING_LOSS.clear()
    replay = RouteReplay(model, routes)
    router_scores = []
    handles = [
        layer.router.register_forward_hook(lambda m, a, o: router_scores.append(o[0]))
        for layer in find_moe_layers(model)
    ]
    with replay:
        model(x)
        for h in handles:
            h.remove()
        assert len(_LOAD_BALANCING_LOSS) == 2
        for i, (tokens_per_expert, scores) in enumerate(_LOAD_BALANCING_LOSS):
            assert torch.equal(tokens_per_expert, torch.bincount(routes.indices[:, :, i].long().flatten(), minlength=8))
            assert scores is router_scores[i]  # the router's live probabilities, passed through untouched
        assert torch.equal(_LOAD_BALANCING_LOSS[0][1].detach(), unreplayed_layer0_scores)  # same inputs at layer 0
        tokens, scores = zip(*_LOAD_BALANCING_LOSS)
        lbl = sum(torch.dot(t.float(), s.mean(0)) for t, s in zip(tokens, scores))
        lbl.backward()
    _LOAD_BALANCING_LOSS.clear()
    assert all(bool(layer.weight.grad.abs().sum() > 0) for layer in find_moe_layers(model))


def test_attaching_leaves_megablocks_state_alone() -> None:
    """The attach-time probe must not draw jitter noise nor append to the z-loss list."""
    model = standin_model()
    routes = random_routes(model, 3, 12)
    model.train()
    for layer in find_moe_layers(model):
        layer.router.args.moe_zloss_weight = 1e-3
        layer.router.args.moe_jitter_eps = 0.01
    _ROUTER_LOGITS.clear()
    state = torch.get_rng_state()
    RouteReplay(model, routes)
    assert _ROUTER_LOGITS == [] and torch.equal(torch.get_rng_state(), state)
    assert all(layer.router.training and layer.router.args.moe_zloss_weight == 1e-3 for layer in find_moe_layers(model))


def test_uniform_expert_assignment_is_refused() -> None:
    """MegaBlocks' benchmarking mode replaces the ids after taking the weights: no rule reproduces
    them, so replay would train a different function than the model computes."""
    model = standin_model()
    routes = random_routes(model, 3, 12)
    for layer in find_moe_layers(model):
        layer.router.args.uniform_expert_assignment = True
    with pytest.raises(ValueError, match=r"LearnedRouter\): no gate-weight rule reproduces its weights"):
        RouteReplay(model, routes)


def test_batch_major_input_to_sequence_major_router_raises() -> None:
    model = standin_model()
    for layer in model.model.layers:
        layer.mlp.forward = MethodType(lambda self, h: self.moe(h), layer.mlp)  # forgets the transpose
    with pytest.raises(ValueError, match=r"must be fed \(seq, batch, hidden\) = \(12, 3, \.\.\.\)"):
        with torch.no_grad(), RouteRecorder(model):
            model(token_ids(3, 12))


def test_save_and_load_round_trip(tmp_path) -> None:
    model = standin_model()
    x = token_ids()
    model.save_pretrained(tmp_path)
    back = _load(tmp_path, _stand_in, dtype=torch.float32, moe_dtype=torch.float32, device="cpu")
    assert back.config.moe_rl_backend == "megablocks"
    assert torch.equal(back(x).logits, model(x).logits)
    build_model("qwen3_moe").save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="not a megablocks-backend checkpoint"):
        _load(tmp_path / "plain", _stand_in, dtype=torch.float32, moe_dtype=torch.float32, device="cpu")


def test_choosing_megablocks_without_cuda_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert megablocks_unavailable_reason() == "no CUDA device (torch.cuda.is_available() is False)"
    hint = r"model.family=megablocks: no CUDA device .*pip install 'moe_rl\[megablocks\]'"
    with pytest.raises(MegaBlocksUnavailable, match=hint):
        build_megablocks_model()


# --- hub kernels that bypass the router are refused at attach -----------------------------------


def test_hub_kernel_bypass_is_refused(monkeypatch) -> None:
    """What transformers' `use_kernels=True` does to GPT-OSS: `use_kernel_forward_from_hub("MegaBlocksMoeMLP")`
    sets the class attribute `kernel_layer_name`, and `kernels.kernelize` sets the instance's `forward`
    to the hub layer's (a fallback sets the class's own forward instead)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    model = build_model("gpt_oss")
    x = token_ids()
    routes = random_routes(model, 3, 12)
    monkeypatch.setattr(GptOssMLP, "kernel_layer_name", "MegaBlocksMoeMLP", raising=False)
    blocks = [layer.mlp for layer in model.model.layers]
    for block in blocks:  # kernelize's fallback: the module's own forward, routes still pass the router
        block.forward = MethodType(GptOssMLP.forward, block)
    with RouteReplay(model, routes), RouteRecorder(model) as rec:
        model(x)
    assert torch.equal(rec.routes.indices, routes.indices)

    def hub_forward(self, hidden_states):  # a fused kernel: routes from self.router.weight, never calls it
        raise AssertionError("never reached: attaching refuses first")

    blocks[1].forward = MethodType(hub_forward, blocks[1])
    model._use_kernels = True
    for attach in (lambda: RouteRecorder(model), lambda: RouteReplay(model, routes)):
        with pytest.raises(
            RuntimeError,
            match=r"MoE block model.layers.1.mlp \(GptOssMLP\) runs the hub kernel "
            r"'MegaBlocksMoeMLP' .* never calls its router model.layers.1.mlp.router",
        ):
            attach()
    hooks = RouteHooks.of(model)  # registered by the first contexts, before the kernel: none opened since
    assert not hooks.front and not hooks.back


def test_a_loaded_checkpoint_runs_no_hub_kernel(tmp_path, monkeypatch) -> None:
    """`load_model` loads without transformers' default kernelization: a checkpoint whose MoE block a hub kernel
    would take over (here every block marked as one, as `use_kernel_forward_from_hub` marks GPT-OSS's) loads with
    `use_kernels` off and each block running its class's own forward, so recording sees the routers."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from moe_rl.models import load_model

    build_model("gpt_oss").save_pretrained(tmp_path)
    monkeypatch.setattr(GptOssMLP, "kernel_layer_name", "MegaBlocksMoeMLP", raising=False)
    model = load_model(tmp_path)
    model.train()
    model.eval()
    assert model.use_kernels is False and model.kernels_mode is None
    assert all(hub_kernel_of(layer.mlp) is None for layer in model.model.layers)
    with RouteRecorder(model) as rec:
        model(token_ids())
    assert rec.routes.indices.shape[-1] == model.config.num_experts_per_tok


# --- GPU: the real dMoE --------------------------------------------------------------------------

_REASON = megablocks_unavailable_reason()
needs_megablocks = pytest.mark.skipif(_REASON is not None, reason=f"megablocks backend unavailable: {_REASON}")


@pytest.mark.gpu
@needs_megablocks
def test_gpu_self_replay_is_bitwise_identical_and_matches_family() -> None:
    model = build_megablocks_model()
    x = token_ids(device="cuda")
    plain, rec = _self_replay(model, x, torch.no_grad())
    # The reference: the same weights in the stand-in, which follows MegaBlocks' contract in plain
    # torch (CPU-tested against the transformers family), with the dMoE in bf16 on CUDA as well.
    reference_model = standin_model(device="cuda", moe_dtype=torch.bfloat16)
    with torch.no_grad(), RouteRecorder(reference_model) as ref:
        reference = reference_model(x).logits
    # Layer 0's routers compute on bitwise the same activations: their routes must agree exactly.
    assert torch.equal(rec.routes.indices[:, :, 0], ref.routes.indices[:, :, 0])
    assert compare_routes(rec.routes, ref.routes)["flip_rate"] < 0.05
    assert (plain - reference).abs().max() < 0.05 * reference.abs().max()


@pytest.mark.gpu
@needs_megablocks
def test_gpu_forced_routes_reach_experts_and_router_learns() -> None:
    model = build_megablocks_model()
    B, T = 4, 16
    x = token_ids(B, T, device="cuda")
    routes = random_routes(model, B, T)
    replay = RouteReplay(model, routes)
    indices, handles = _capture(model, "experts", 3)
    loss = replayed_loss(model, x, replay, handles)
    for i, idx in enumerate(indices):
        assert torch.equal(idx.view(T, B, -1).transpose(0, 1).sort(-1).values.cpu(), routes.indices[:, :, i].long())
    loss.backward()
    for layer in find_moe_layers(model):
        grad = layer.weight.grad
        assert grad is not None and bool((grad.norm(dim=1) > 0).all()), layer.name


@pytest.mark.gpu
@needs_megablocks
def test_gpu_load_balancing_statistics_under_replay() -> None:
    from megablocks.layers import moe

    from moe_rl.models.megablocks import load_balancing_loss

    model = build_megablocks_model().train()
    for layer in find_moe_layers(model):
        layer.router.args.moe_loss_weight = 0.1
    B, T = 2, 10
    routes = random_routes(model, B, T)
    moe.clear_load_balancing_loss()
    with RouteReplay(model, routes):
        model(token_ids(B, T, device="cuda"))
        saved = moe.get_load_balancing_loss()
        assert len(saved) == 2
        for i, (tokens_per_expert, _) in enumerate(saved):
            expected = torch.bincount(routes.indices[:, :, i].long().flatten(), minlength=8)
            assert torch.equal(tokens_per_expert.cpu().long(), expected)
        lbl = load_balancing_loss(model)
    assert moe.get_load_balancing_loss() == []
    lbl.backward()
    assert all(bool(layer.weight.grad.abs().sum() > 0) for layer in find_moe_layers(model))
