"""The router and expert knobs (moe_rl.models.knobs, moe_rl.algos.router_losses): each off by default, each
asserting numbers when on, and refused for a model that lacks the piece it acts on."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ROOT, tiny_config
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from moe_rl.algos.losses import LossMetrics
from moe_rl.algos.router_losses import add_router_terms, router_z_loss
from moe_rl.config import ModelConfig, TrainConfig, to_train_config, validate
from moe_rl.loop.cold_start import expected_key
from moe_rl.loop.policy import set_router_knobs
from moe_rl.metrics.names import LOSS, LOSS_AUX, LOSS_POLICY, LOSS_ROUTER_Z, defines
from moe_rl.models import build_model, param_counts
from moe_rl.models.knobs import (
    AUX_LOSS_FAMILIES,
    FLOAT64_ROUTER_FAMILIES,
    Z_LOSS_FAMILIES,
    expert_parameters,
    expert_weights,
    freeze_routers,
    param_groups,
    router_parameters,
    set_router_dtype,
)
from moe_rl.rollout.generate import forward_logp_router
from moe_rl.rollout.sampler import position_ids
from moe_rl.routing import RoutedPass, RouteRecorder, compare_routes, find_moe_layers
from moe_rl.routing.expert_load import expert_step_rms
from moe_rl.tasks import make_tokenizer
from moe_rl.train import Batch, Trainer

V = len(make_tokenizer())
CONF = ROOT / "experiments" / "conf"
RUNGS = sorted(p.stem for p in (CONF / "rung").glob("*.yaml"))


def _names(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[str]:
    ids = {id(p) for p in params}
    return [n for n, p in model.named_parameters() if id(p) in ids]


# --- the parts, found through the MoE layers ---------------------------------------------------------------


def test_routers_and_experts_are_found_through_the_moe_layers() -> None:
    model = build_model("qwen3_moe", vocab_size=V)
    assert _names(model, router_parameters(model)) == [f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)]
    assert _names(model, expert_parameters(model)) == [
        f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("gate_up_proj", "down_proj")
    ]
    qwen2 = build_model("qwen2_moe", vocab_size=V)  # its shared expert counts with the rest
    assert not any("shared_expert" in n for n in _names(qwen2, expert_parameters(qwen2)))
    dense = build_model("qwen3_dense", vocab_size=V)
    for find in (router_parameters, expert_parameters, freeze_routers):
        with pytest.raises(ValueError, match="Qwen3ForCausalLM has none"):
            find(dense)


def test_expert_weights_stack_one_row_per_expert_packed_or_as_modules() -> None:
    """A planted move of one expert shows in its row only, for packed experts (transformers v5) and for a
    list of expert modules alike; a dense model has none."""
    model = build_model("qwen3_moe", vocab_size=V)
    before = expert_weights(model)
    experts = model.model.layers[1].mlp.experts
    E, two_i, H = experts.gate_up_proj.shape
    assert [s.shape for s in before] == [(E, two_i * H + experts.down_proj[0].numel())] * 2
    with torch.no_grad():
        experts.down_proj[3] += 1.0
    moved = [(a - b).abs().amax(dim=1) for a, b in zip(expert_weights(model), before)]
    assert moved[0].tolist() == [0.0] * E
    assert moved[1].tolist() == [1.0 if e == 3 else 0.0 for e in range(E)]

    layer = find_moe_layers(model)[0]
    listed = torch.nn.ModuleList(torch.nn.Linear(2, 3) for _ in range(layer.num_experts))
    model.get_submodule(layer.name.rsplit(".", 1)[0]).experts = listed
    rows = expert_weights(model)[0]
    assert rows.shape == (layer.num_experts, 2 * 3 + 3)
    assert torch.equal(rows[5], torch.cat([listed[5].weight.detach().reshape(-1), listed[5].bias.detach()]))
    with pytest.raises(ValueError, match="has none"):
        expert_weights(build_model("qwen3_dense", vocab_size=V))


def test_param_groups_are_one_group_at_the_defaults_and_scale_each_part_otherwise() -> None:
    model = build_model("qwen3_moe", vocab_size=V)
    (group,) = param_groups(model, 1e-3)
    assert group["lr"] == 1e-3 and [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]
    groups = param_groups(model, 1e-3, router_lr_scale=0.1, expert_lr_scale=0.5)
    assert [(g["name"], g["lr"]) for g in groups] == [("rest", 1e-3), ("routers", 1e-3 * 0.1), ("experts", 1e-3 * 0.5)]
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in model.parameters())
    assert [sum(p.numel() for p in g["params"]) for g in groups] == [229376 - 1024 - 2 * 98304, 1024, 2 * 98304]
    # the scheduler scales every group alike
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([2.5e-4, 2.5e-5, 1.25e-4])
    optimizer.step()  # no gradient: moves nothing
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-4, 5e-5, 2.5e-4])
    with pytest.raises(ValueError, match="optim.router_lr_scale acts on MoE layers"):
        param_groups(build_model("qwen3_dense", vocab_size=V), 1e-3, router_lr_scale=0.1)


FINE = {"num_experts": 64, "top_k": 8, "num_layers": 4, "moe_intermediate_size": 16}  # conf/model/qwen3_*_fine.yaml


def test_parameter_counts_of_the_ladders_models() -> None:
    counts = {
        "qwen3_moe": param_counts(build_model("qwen3_moe", vocab_size=V)),
        "qwen3_dense": param_counts(build_model("qwen3_dense", vocab_size=V)),
        "qwen3_dense_total": param_counts(build_model("qwen3_dense_total", vocab_size=V)),
        "qwen3_moe_soft": param_counts(build_model("qwen3_moe", vocab_size=V, top_k=8)),
        "qwen3_moe_soft_narrow": param_counts(
            build_model("qwen3_moe", vocab_size=V, top_k=8, moe_intermediate_size=16)
        ),
        "qwen3_dense_w256": param_counts(build_model("qwen3_dense", vocab_size=V, moe_intermediate_size=128)),
        "qwen3_moe_fine": param_counts(build_model("qwen3_moe", vocab_size=V, **FINE)),
        "qwen3_dense_fine": param_counts(build_model("qwen3_dense", vocab_size=V, **FINE)),
    }
    assert counts == {
        "qwen3_moe": (229376, 81920),
        "qwen3_dense": (80896, 80896),
        "qwen3_dense_total": (228352, 228352),
        "qwen3_moe_soft": (229376, 229376),
        "qwen3_moe_soft_narrow": (81920, 81920),
        "qwen3_dense_w256": (130048, 130048),
        "qwen3_moe_fine": (859456, 171328),
        "qwen3_dense_fine": (154944, 154944),
    }
    assert counts["qwen3_moe_fine"][1] - counts["qwen3_dense_fine"][1] == 4 * 64 * 64  # the routers
    total = build_model("qwen3_dense_total", vocab_size=V)
    assert type(total).__name__ == "Qwen3ForCausalLM" and total.config.intermediate_size == 8 * 64
    assert (
        build_model(
            "qwen3_dense_total", vocab_size=V, num_experts=16, moe_intermediate_size=16
        ).config.intermediate_size
        == 256
    )
    assert counts["qwen3_moe"][0] - counts["qwen3_dense_total"][0] == 2 * 8 * 64  # the routers


# --- soft routing ------------------------------------------------------------------------------------------


def test_soft_routing_weights_are_the_routers_softmax_and_routes_hold_every_expert() -> None:
    model = build_model("qwen3_moe", vocab_size=V, top_k=8)
    layer = find_moe_layers(model)[0]
    assert layer.router.norm_topk_prob and layer.top_k == layer.num_experts == 8
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, weights, indices = layer.router(hidden)
    per_expert = torch.zeros_like(weights).scatter(-1, indices, weights)
    torch.testing.assert_close(per_expert, torch.softmax(logits, dim=-1), rtol=1e-6, atol=1e-7)
    ids = torch.randint(3, V, (4, 6), generator=torch.Generator().manual_seed(1))
    with RouteRecorder(model, margins=True) as recorder:
        model(input_ids=ids)
    routes = recorder.routes
    assert routes.shape == (4, 6, 2, 8) and (routes.indices == torch.arange(8)).all()
    assert compare_routes(routes, routes)["flip_rate"] == 0.0
    with RoutedPass(model, routes) as routed:  # replaying them runs too; nothing can flip
        model(input_ids=ids)
    assert compare_routes(routed.native, routes)["flip_rate"] == 0.0


# --- the loss terms ----------------------------------------------------------------------------------------


def test_router_z_loss_on_planted_logits() -> None:
    ln = math.log
    layer0 = torch.tensor([[0.0, 0.0], [ln(3.0), 0.0], [50.0, 50.0]])  # logsumexp: ln 2, ln 4, (pad)
    layer1 = torch.tensor([[ln(2.0), ln(2.0)], [0.0, ln(7.0)], [-5.0, 3.0]])  # ln 4, ln 8, (pad)
    mask = torch.tensor([[1, 1, 0]])
    expected = (ln(2) ** 2 + ln(4) ** 2 + ln(4) ** 2 + ln(8) ** 2) / 4  # mean over 2 tokens x 2 layers
    assert router_z_loss([layer0, layer1], mask).item() == pytest.approx(expected, rel=1e-6)
    assert router_z_loss([layer0], torch.zeros(1, 3)).item() == 0.0  # no valid token
    with pytest.raises(ValueError, match="3 rows, the mask 2 tokens"):
        router_z_loss([layer0], torch.ones(1, 2))


def test_router_terms_are_added_with_their_coefficients_and_logged_unscaled() -> None:
    metrics = LossMetrics({LOSS_POLICY: 0.5}, {LOSS: 4.0, LOSS_POLICY: 4.0})
    loss = torch.tensor(0.5)
    logits = [torch.tensor([[0.0, 0.0], [ln3 := math.log(3.0), 0.0]])]
    mask = torch.ones(1, 2)
    total, out = add_router_terms(
        loss, metrics, mask=mask, aux_loss=torch.tensor(2.0), router_logits=logits, aux_coef=1e-3, z_coef=1e-2
    )
    z = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    assert total.item() == pytest.approx(0.5 + 1e-3 * 2.0 + 1e-2 * z, rel=1e-6)
    assert out[LOSS_AUX] == 2.0 and out[LOSS_ROUTER_Z] == pytest.approx(z, rel=1e-6) and ln3 > 0
    assert out.weights[LOSS_AUX] == out.weights[LOSS_ROUTER_Z] == 2.0 and out[LOSS_POLICY] == 0.5
    assert defines(LOSS_AUX) and defines(LOSS_ROUTER_Z)
    same, untouched = add_router_terms(
        loss, metrics, mask=mask, aux_loss=None, router_logits=None, aux_coef=0.0, z_coef=0.0
    )
    assert same is loss and dict(untouched) == dict(metrics)
    with pytest.raises(ValueError, match="returned no load-balancing loss"):
        add_router_terms(loss, metrics, mask=mask, aux_loss=None, router_logits=logits, aux_coef=1e-3, z_coef=0.0)


def test_the_aux_loss_is_the_familys_own_over_the_attention_mask() -> None:
    model = build_model("qwen3_moe", vocab_size=V)
    ids = torch.randint(3, V, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :3] = 0  # left pads
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), output_router_logits=True)
        other = ids.clone()
        other[0, :3] = 5  # other tokens under the pads
        padded = model(input_ids=other, attention_mask=mask, position_ids=position_ids(mask), output_router_logits=True)
    assert torch.equal(out.aux_loss, load_balancing_loss_func(out.router_logits, 8, 2, mask))
    assert torch.equal(out.aux_loss, padded.aux_loss)  # pads do not count
    assert router_z_loss(out.router_logits, mask).item() == pytest.approx(
        router_z_loss(padded.router_logits, mask).item()
    )


# --- float64 routers ---------------------------------------------------------------------------------------


def test_a_float64_router_computes_gemm_and_softmax_in_float64_and_still_records_and_replays() -> None:
    model = build_model("qwen3_moe", vocab_size=V)
    ids = torch.randint(3, V, (4, 9), generator=torch.Generator().manual_seed(3))
    set_router_dtype(model, "float32")  # the family's own computation: nothing changes
    assert all(p.dtype == torch.float32 for p in model.parameters())
    set_router_dtype(model, "float64")
    layer = find_moe_layers(model)[0]
    assert layer.weight.dtype == torch.float64
    assert {p.dtype for n, p in model.named_parameters() if ".gate." not in n} == {torch.float32}
    hidden = torch.randn(2048, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, weights, indices = layer.router(hidden)
        exact = hidden.double() @ layer.weight.T  # GEMM in float64
        probs = torch.softmax(exact, dim=-1)  # softmax in float64
        top, top_ids = probs.topk(2, dim=-1)
        float32_softmax = torch.softmax(exact, dim=-1, dtype=torch.float32).topk(2, dim=-1).values
    assert logits.dtype == torch.float64 and weights.dtype == torch.float32  # the experts get float32 weights
    assert torch.equal(logits, exact) and torch.equal(indices, top_ids)
    assert torch.equal(weights, (top / top.sum(-1, keepdim=True)).float())
    assert not torch.equal(weights, (float32_softmax / float32_softmax.sum(-1, keepdim=True)).float())
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with RoutedPass(model, scores=True, margins=True) as recorded:
            model(input_ids=ids)
        with RoutedPass(model, recorded.used) as replayed:  # replaying its own routes: bitwise the same
            again = model(input_ids=ids).logits
    assert recorded.used.shape == (4, 9, 2, 2) and recorded.scores.shape == (4, 9, 2, 8)
    assert torch.equal(plain, again) and compare_routes(replayed.native, recorded.used)["flip_rate"] == 0.0
    for family in ("deepseek_v3",):
        with pytest.raises(ValueError, match="computes its logits in torch.float32 whatever its weights' dtype"):
            set_router_dtype(build_model(family, vocab_size=V), "float64")
    with pytest.raises(ValueError, match="model.router_dtype=float64 acts on MoE layers"):
        set_router_dtype(build_model("qwen3_dense", vocab_size=V), "float64")


def test_float64_routers_are_refused_under_fsdp_and_allowed_otherwise() -> None:
    model = build_model("qwen3_moe", vocab_size=V)
    with pytest.raises(ValueError, match="model.router_dtype=float64 under dist.strategy=fsdp"):
        set_router_knobs(model, ModelConfig(router_dtype="float64"), fsdp=True)
    set_router_knobs(model, ModelConfig(router_dtype="float64", router_frozen=True))  # one process, or DDP
    assert [(p.dtype, p.requires_grad) for p in router_parameters(model)] == [(torch.float64, False)] * 2


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"])
def test_the_family_lists_of_the_knobs_are_what_transformers_does(family: str) -> None:
    model = build_model(family, vocab_size=V)
    ids = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    assert (out.get("aux_loss") is not None) == (family in AUX_LOSS_FAMILIES)
    softmax = type(find_moe_layers(model)[0].router).__name__ != "DeepseekV3TopkRouter"
    assert softmax == (family in Z_LOSS_FAMILIES) and out.get("router_logits") is not None
    if family in FLOAT64_ROUTER_FAMILIES:
        set_router_dtype(model, "float64")
        with torch.no_grad():
            assert model(input_ids=ids).logits.dtype == torch.float32
    else:
        with pytest.raises(ValueError, match="whatever its weights' dtype"):
            set_router_dtype(model, "float64")


# --- config ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        (["model.family=qwen3_dense", "model.router_frozen=true"], r"^model.router_frozen=True acts on the MoE"),
        (["model.family=qwen3_dense_total", "optim.router_lr_scale=0.1"], r"^optim.router_lr_scale=0.1 acts on"),
        (["model.family=qwen3_dense", "optim.expert_lr_scale=0.5"], r"is dense \(no router, no experts\)"),
        (["model.family=qwen3_dense", "algo.aux_loss_coef=0.001"], r"^algo.aux_loss_coef=0.001 acts on"),
        (["model.family=qwen3_dense", "algo.router_z_loss_coef=0.001"], r"^algo.router_z_loss_coef=0.001 acts on"),
        (["model.family=qwen3_dense", "model.router_dtype=float64"], r"^model.router_dtype='float64' acts on"),
        (["model.family=deepseek_v3", "algo.aux_loss_coef=0.001"], r"returns no load-balancing loss"),
        (["model.family=deepseek_v3", "algo.router_z_loss_coef=0.001"], r"this family's router is not one"),
        (["model.family=deepseek_v3", "model.router_dtype=float64"], r"computes in float32 whatever"),
        (["model.router_dtype=float16"], r"model.router_dtype='float16' is not valid"),
        (["model.router_frozen=true", "optim.router_lr_scale=0.1"], r"model.router_frozen=true gives them none"),
        (["optim.expert_lr_scale=0"], r"optim.expert_lr_scale=0.0 must be > 0"),
        (["algo.aux_loss_coef=-1"], r"algo.aux_loss_coef=-1.0 must be >= 0"),
        (["model.router_dtype=float64", "rollout.engine=vllm", "model.head_dim=32"], r"rollout.engine=hf only"),
        (["model.top_k=9"], r"model.top_k=9 must lie in \[1, model.num_experts=8\]"),
    ],
)
def test_knobs_are_refused_where_the_model_lacks_their_piece(tmp_path, changes: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate(tiny_config(tmp_path, *changes))


def test_every_rung_composes_validates_and_the_moe_rungs_share_one_cold_start() -> None:
    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    configs = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for rung in RUNGS:
            configs[rung] = validate(to_train_config(compose("config", overrides=[f"+rung={rung}"])))
    assert len(RUNGS) == 22

    def knobs(c: TrainConfig) -> dict[str, object]:
        model, optim, algo = (
            ("family", "num_experts", "top_k", "num_layers", "moe_intermediate_size", "router_frozen", "router_dtype"),
            ("router_lr_scale", "expert_lr_scale", "mlp_lr_scale", "expert_step"),
            (
                "aux_loss_coef",
                "router_z_loss_coef",
            ),
        )
        return {
            **{k: getattr(c.model, k) for k in model},
            **{k: getattr(c.optim, k) for k in optim},
            **{k: getattr(c.algo, k) for k in algo},
            "replay": c.replay.mode,
        }

    base = knobs(configs["moe"])
    assert base == knobs(TrainConfig())  # the moe rung is the default model at every default
    set_keys = {rung: {k: v for k, v in knobs(c).items() if v != base[k]} for rung, c in configs.items()}
    assert set_keys == {
        "moe": {},
        "dense": {"family": "qwen3_dense"},
        "dense_total": {"family": "qwen3_dense_total"},
        "soft": {"top_k": 8},
        "router_frozen": {"router_frozen": True},
        "router_fp64": {"router_dtype": "float64"},
        "router_lr_tenth": {"router_lr_scale": 0.1},
        "expert_lr_half": {"expert_lr_scale": 0.5},
        "expert_lr_quarter": {"expert_lr_scale": 0.25},
        "aux1e-3": {"aux_loss_coef": 0.001},
        "zloss1e-3": {"router_z_loss_coef": 0.001},
        "soft_narrow": {"top_k": 8, "moe_intermediate_size": 16},
        "dense_mlp_lr_quarter": {"family": "qwen3_dense", "mlp_lr_scale": 0.25},
        "dense_w256": {"family": "qwen3_dense", "moe_intermediate_size": 128},
        "dense_w256_mup": {"family": "qwen3_dense", "moe_intermediate_size": 128, "mlp_lr_scale": 0.5},
        "dense_total_mup": {"family": "qwen3_dense_total", "mlp_lr_scale": 0.25},
        # the causal study's arms (its launcher sets the lr, x 0.25 for nonexpert_lr_quarter, x 0.85 for lr_matched)
        "anchored": {"replay": "anchored"},
        "load_aware": {"expert_step": "load_aware"},
        "anchored_load_aware": {"replay": "anchored", "expert_step": "load_aware"},
        "r2": {"replay": "r2"},
        "nonexpert_lr_quarter": {"expert_lr_scale": 4.0},
        "lr_matched": {},
    }
    keys = {rung: expected_key(c.model, c.task, c.cold_start) for rung, c in configs.items()}
    # a model of its own has its own cold start; a knob acts after it, so its rung shares its model's
    models = {
        "moe": [
            r for r in RUNGS if r not in set_keys or not {"family", "top_k", "moe_intermediate_size"} & set(set_keys[r])
        ],
        "dense": ["dense", "dense_mlp_lr_quarter"],
        "dense_total": ["dense_total", "dense_total_mup"],
        "dense_w256": ["dense_w256", "dense_w256_mup"],
        "soft": ["soft"],
        "soft_narrow": ["soft_narrow"],
    }
    assert sorted(r for rungs in models.values() for r in rungs) == RUNGS
    assert all(len({keys[r] for r in rungs}) == 1 for rungs in models.values())
    assert len({keys[rungs[0]] for rungs in models.values()}) == len(models)


# --- in the loop -------------------------------------------------------------------------------------------


def _trainer(tmp_path, name: str, *changes: str) -> Trainer:
    cfg = tiny_config(tmp_path / name, "cold_start.mode=none", "optim.lr=1e-3", *changes, cache=tmp_path / "cache")
    return Trainer(cfg)


def _one_update(trainer: Trainer, rows: int = 8) -> dict[str, float]:
    """One update on the first `rows` rows of a step-1 rollout, with planted advantages (a built model scores 0)."""
    rollout, _, _ = trainer.rollout(step=1)
    old = trainer.old_pass(rollout)
    adv = torch.linspace(-1.0, 1.0, len(rollout))
    return trainer.update(Batch(rollout, adv, old, None), torch.arange(rows))


def _snapshot(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def test_frozen_routers_keep_the_cold_starts_values_while_the_experts_move(tmp_path) -> None:
    trainer = _trainer(tmp_path, "frozen", "model.router_frozen=true")
    routers, experts = router_parameters(trainer.policy), expert_parameters(trainer.policy)
    assert routers and not any(p.requires_grad for p in routers)
    assert all(p.requires_grad for p in experts)
    before_r, before_e = _snapshot(routers), _snapshot(experts)
    metrics = _one_update(trainer)
    assert metrics["optim/grad_norm"] > 0
    assert all(torch.equal(a, p) for a, p in zip(before_r, routers))  # bitwise the cold start's
    assert all(not torch.equal(a, p) for a, p in zip(before_e, experts))


def test_lr_scales_set_each_parts_first_adam_step(tmp_path) -> None:
    """Adam's first step moves a parameter by lr * g / (|g| + eps): the largest move of a part is its lr."""
    trainer = _trainer(tmp_path, "scales", "optim.router_lr_scale=0.1", "optim.expert_lr_scale=0.5")
    assert [(g["name"], g["lr"]) for g in trainer.optimizer.param_groups] == [
        ("rest", 1e-3),
        ("routers", pytest.approx(1e-4)),
        ("experts", 5e-4),
    ]
    parts = {
        name: group["params"] for name, group in zip(("rest", "routers", "experts"), trainer.optimizer.param_groups)
    }
    before = {name: _snapshot(ps) for name, ps in parts.items()}
    _one_update(trainer)
    moved = {
        name: max((p.detach() - b).abs().max().item() for p, b in zip(parts[name], before[name])) for name in parts
    }
    assert moved == pytest.approx({"rest": 1e-3, "routers": 1e-4, "experts": 5e-4}, rel=1e-3)


def test_a_step_logs_each_experts_move_against_the_tokens_it_was_routed(tmp_path, monkeypatch) -> None:
    """optim/expert_step over one step equals the move of the expert weights from before to after it, counted
    against the routes the updates followed (the old pass's, no replay here). Planted rewards (every other
    sample of a group scores 1) give a built model a learning signal."""
    from moe_rl.tasks.setup import RLTask, Scores

    monkeypatch.setattr(
        RLTask, "score", lambda self, completions, examples: Scores([float(i % 2) for i in range(len(completions))], 0)
    )
    trainer = _trainer(tmp_path, "steps", "metrics.route_every=2", "optim.updates_per_rollout=2")
    assert "optim/expert_step/rms" not in trainer.step(1)  # not a step of the instruments
    before = expert_weights(trainer.policy)
    metrics = trainer.step(2)
    rms = expert_step_rms(before, expert_weights(trainer.policy))
    assert (rms > 0).all()
    assert metrics["optim/expert_step/rms"] == pytest.approx(float(rms.mean()), rel=1e-12)
    assert math.isfinite(metrics["optim/expert_step/low_over_high"])


def test_a_checkpoint_of_grouped_optimizer_state_resumes(tmp_path) -> None:
    changes = ("optim.router_lr_scale=0.1", "optim.expert_lr_scale=0.25", "optim.warmup_updates=3")
    first = _trainer(tmp_path, "resume", *changes)
    _one_update(first)  # the scheduler steps once: lr x 2/3 of the warm-up
    first.save(1)
    second = _trainer(tmp_path, "resume", *changes)
    assert second.resume() == 1
    a, b = first.optimizer.state_dict(), second.optimizer.state_dict()
    assert [(g["name"], g["lr"], g["params"]) for g in a["param_groups"]] == [
        (g["name"], g["lr"], g["params"]) for g in b["param_groups"]
    ]
    assert [g["lr"] for g in b["param_groups"]] == pytest.approx([1e-3 * 2 / 3, 1e-4 * 2 / 3, 2.5e-4 * 2 / 3])
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in ("exp_avg", "exp_avg_sq"))
    assert second.scheduler.state_dict() == first.scheduler.state_dict()


def test_aux_and_z_losses_join_the_loss_and_are_logged(tmp_path) -> None:
    trainer = _trainer(tmp_path, "terms", "algo.aux_loss_coef=0.001", "algo.router_z_loss_coef=0.01")
    rollout, _, _ = trainer.rollout(step=1)
    old = trainer.old_pass(rollout)
    rows = torch.arange(8)
    with torch.no_grad():
        expected = forward_logp_router(trainer.policy, rollout, rows)
    metrics = trainer.update(Batch(rollout, torch.linspace(-1.0, 1.0, len(rollout)), old, None), rows)
    aux, z = expected.aux_loss.item(), router_z_loss(expected.router_logits, expected.mask).item()
    assert metrics[LOSS_AUX] == pytest.approx(aux, rel=1e-6) and metrics[LOSS_ROUTER_Z] == pytest.approx(z, rel=1e-6)
    assert metrics[LOSS] - metrics[LOSS_POLICY] == pytest.approx(1e-3 * aux + 1e-2 * z, rel=1e-4)
    plain = _one_update(_trainer(tmp_path, "plain"))
    assert LOSS_AUX not in plain and LOSS_ROUTER_Z not in plain
    assert plain[LOSS] == pytest.approx(plain[LOSS_POLICY], abs=1e-9)


def test_a_float64_router_trains_with_recording_and_replay(tmp_path) -> None:
    trainer = _trainer(tmp_path, "fp64", "model.router_dtype=float64", "replay.mode=r2")
    rollout, _, _ = trainer.rollout(step=1)
    assert rollout.routes is not None and rollout.routes.shape[2:] == (2, 2)  # recorded while sampling
    old = trainer.old_pass(rollout)
    assert old.routes is not None and old.scores.dtype == torch.float32
    metrics = trainer.update(Batch(rollout, torch.linspace(-1.0, 1.0, len(rollout)), old, old.routes), torch.arange(8))
    assert metrics["route/native_vs_replayed/flip_rate"] == 0.0  # replaying the old pass's routes at theta_old
    assert metrics["optim/grad_norm"] > 0 and math.isfinite(metrics[LOSS])
    assert {p.dtype for p in router_parameters(trainer.policy)} == {torch.float64}


def test_soft_routing_trains_with_no_route_flips(tmp_path) -> None:
    trainer = _trainer(tmp_path, "soft", "model.top_k=8")
    rollout, _, _ = trainer.rollout(step=1)
    old = trainer.old_pass(rollout)
    assert old.routes is not None and (old.routes.indices == torch.arange(8)).all()
    metrics = trainer.update(Batch(rollout, torch.linspace(-1.0, 1.0, len(rollout)), old, None), torch.arange(8))
    assert metrics["route/old_vs_new/flip_rate"] == 0.0 and metrics["optim/grad_norm"] > 0
    assert math.isnan(metrics["route/old_vs_new/move/rms"])  # no top-k boundary to move
