"""The optimizer arms (moe_rl.algos.optimizers, moe_rl.loop.expert_step): the load-aware expert step on planted
routes against a hand count, sign-SGD by hand, `optim.eps`, the dense MLP's lr scale, and what is refused."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from moe_rl.algos import optimizers
from moe_rl.algos.optimizers import SignSGD, load_aware_scale
from moe_rl.config import validate
from moe_rl.loop.expert_step import ExpertStep
from moe_rl.models import build_model
from moe_rl.models.knobs import expert_rows, expert_weights, param_groups
from moe_rl.routing import Routes, find_moe_layers
from moe_rl.tasks import make_tokenizer
from moe_rl.train import Batch, Trainer

V = len(make_tokenizer())


def test_load_aware_scale_by_hand() -> None:
    counts = torch.tensor([[6.0, 2.0, 0.0, 8.0], [0.0, 0.0, 0.0, 0.0]])  # means 4 and 0
    assert load_aware_scale(counts).tolist() == [[1.0, 0.5, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_sign_sgd_by_hand() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))
    w.grad = torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64)
    SignSGD([w], lr=0.1, weight_decay=0.01).step()  # w - lr wd w - lr sign(g)
    assert w.detach().tolist() == pytest.approx([1 - 0.001 - 0.1, -2 + 0.002 + 0.1, 3 - 0.003], abs=1e-15)


def test_load_aware_step_scales_each_experts_move_packed_or_as_modules() -> None:
    for listed in (False, True):
        model = build_model("qwen3_moe", vocab_size=V)
        E = find_moe_layers(model)[0].num_experts
        if listed:  # one module per expert
            for layer in find_moe_layers(model):
                block = model.get_submodule(layer.name.rsplit(".", 1)[0])
                block.experts = torch.nn.ModuleList(torch.nn.Linear(2, 3) for _ in range(E))
        step = ExpertStep(model, "load_aware")
        before, rows = step.snapshot(), expert_weights(model)
        with torch.no_grad():  # a planted optimizer step: every expert weight + 1
            for layer in step.rows or []:
                for p, _ in layer:
                    p.add_(1.0)
        counts = torch.tensor([[8.0, 4, 2, 0, 2, 0, 0, 0], [2.0] * E])  # mean 2 in both layers
        scale = step.rescale(before, counts)
        assert scale.tolist() == [[1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0], [1.0] * E]
        after = expert_weights(model)
        for l, s in enumerate(scale):  # noqa: E741
            moves = (after[l] - rows[l]).mean(dim=1)
            assert moves.tolist() == pytest.approx(s.tolist(), abs=1e-6)


def _trainer(tmp_path, name: str, *changes: str) -> Trainer:
    cfg = tiny_config(tmp_path / name, "cold_start.mode=none", "optim.lr=1e-3", *changes, cache=tmp_path / "cache")
    return Trainer(cfg)


def _planted(rollout) -> Routes:
    """Every real token to expert 0 and to expert 1 + (b + t) % 7, in every layer: 0 is busy, the rest share."""
    B, T = rollout.token_mask.shape
    b, t = torch.meshgrid(torch.arange(B), torch.arange(T), indexing="ij")
    topk = torch.stack([torch.zeros_like(b), 1 + (b + t) % 7], dim=-1)  # (B, T, 2)
    topk = topk[:, :, None, :].expand(B, T, 2, 2)
    return Routes.from_topk(topk, rollout.token_mask, (0, 1), 8)


def test_load_aware_update_scales_each_experts_adam_step_by_its_planted_tokens(tmp_path) -> None:
    rows = torch.arange(8)
    updated = {}
    for arm in ("plain", "load_aware"):
        trainer = _trainer(tmp_path, arm, "replay.mode=r2", f"optim.expert_step={arm}")
        rollout, _, _ = trainer.rollout(step=1)
        old = trainer.old_pass(rollout)
        replay = _planted(rollout)
        before = expert_weights(trainer.policy)
        trainer.update(Batch(rollout, torch.linspace(-1.0, 1.0, len(rollout)), old, replay), rows)
        updated[arm] = expert_weights(trainer.policy)
    mask = rollout.token_mask[rows]
    n = torch.zeros(8)  # the tokens routed to each expert in this update, counted by hand
    for b in range(len(rows)):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                n[0] += 1
                n[1 + (b + t) % 7] += 1
    s = torch.clamp(n / n.mean(), max=1.0)
    assert s[0] == 1.0 and (s[1:] < 0.7).all() and (s[1:] > 0.4).all()  # near 4/7
    for layer in range(2):
        plain, scaled, start = updated["plain"][layer], updated["load_aware"][layer], before[layer]
        assert torch.equal(scaled[0], plain[0])  # a busy expert: AdamW's step, bit for bit
        moved = (scaled - start).norm(dim=1) / (plain - start).norm(dim=1)
        assert moved.tolist() == pytest.approx(s.tolist(), rel=1e-5)


def test_sign_moves_every_coordinate_by_lr_and_eps_reaches_adamw(tmp_path) -> None:
    trainer = _trainer(tmp_path, "sign", "optim.name=sign")
    assert isinstance(trainer.optimizer, SignSGD)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    rollout, _, _ = trainer.rollout(step=1)
    old = trainer.old_pass(rollout)
    trainer.update(Batch(rollout, torch.linspace(-1.0, 1.0, len(rollout)), old, None), torch.arange(8))
    moves = torch.cat([(p.detach() - b).abs().reshape(-1) for p, b in zip(trainer.policy.parameters(), before)])
    assert moves.max().item() == pytest.approx(1e-3, rel=1e-3)
    assert ((moves == 0) | ((moves - 1e-3).abs() < 1e-6)).float().mean() > 0.999  # 0 (no gradient) or lr
    assert _trainer(tmp_path, "eps", "optim.eps=1e-6").optimizer.param_groups[0]["eps"] == 1e-6
    default = _trainer(tmp_path, "default").optimizer
    assert type(default) is torch.optim.AdamW and default.param_groups[0]["eps"] == 1e-8


def test_mlp_lr_scale_scales_the_dense_models_mlps() -> None:
    model = build_model("qwen3_dense", vocab_size=V)
    groups = param_groups(model, 1e-3, mlp_lr_scale=0.25)
    assert [(g["name"], g["lr"]) for g in groups] == [("rest", 1e-3), ("mlp", 2.5e-4)]
    mlp = {id(p) for n, p in model.named_parameters() if ".mlp." in n}
    assert {id(p) for p in groups[1]["params"]} == mlp and len(mlp) == 3 * 2  # gate, up, down x 2 layers
    with pytest.raises(ValueError, match="routes its MLPs to experts"):
        param_groups(build_model("qwen3_moe", vocab_size=V), 1e-3, mlp_lr_scale=0.25)


def test_experts_that_cannot_be_addressed_are_refused_in_one_line() -> None:
    model = build_model("qwen3_moe", vocab_size=V)
    layer = find_moe_layers(model)[0]
    model.get_submodule(layer.name.rsplit(".", 1)[0]).experts = torch.nn.Sequential(torch.nn.Linear(2, 3))
    with pytest.raises(ValueError, match=r"^optim.expert_step=load_aware cannot address .*experts one by one") as err:
        expert_rows(model, "optim.expert_step=load_aware")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "changes, match",
    [
        (["model.family=qwen3_dense", "optim.expert_step=load_aware"], r"^optim.expert_step='load_aware' acts on"),
        (
            ["optim.mlp_lr_scale=0.25"],
            r"^optim.mlp_lr_scale acts on a dense model.s MLPs; model.family=.qwen3_moe. has",
        ),
        (["model.family=qwen3_dense", "optim.mlp_lr_scale=0"], r"optim.mlp_lr_scale=0.0 must be > 0"),
        (["optim.name=adam"], r"optim.name='adam' is not valid"),
        (["optim.expert_step=scaled"], r"optim.expert_step='scaled' is not valid"),
        (["optim.eps=0"], r"optim.eps=0.0 must be > 0"),
    ],
)
def test_optimizer_keys_are_refused_where_they_cannot_act(tmp_path, changes: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate(tiny_config(tmp_path, *changes))


def test_an_instrumented_update_observes_each_experts_activity_and_move(tmp_path) -> None:
    """Every token planted on experts 0 and 1: they are active, 2..7 are not; an active expert's move_active is the
    RMS of its own move in the update (its row of the expert weights, before and after), with weight 1, an idle
    one's weight is 0. A step keeps the mean of move_active over the updates in which an expert was active."""
    from moe_rl.loop.step_metrics import aggregate

    trainer = _trainer(tmp_path, "observe", "replay.mode=r2")
    rollout, _, _ = trainer.rollout(step=1)
    old = trainer.old_pass(rollout)
    B, T = rollout.token_mask.shape
    topk = torch.tensor([0, 1]).expand(B, T, 2, 2)
    replay = Routes.from_topk(topk, rollout.token_mask, (0, 1), 8)
    before = expert_weights(trainer.policy)
    batch = Batch(rollout, torch.linspace(-1.0, 1.0, len(rollout)), old, replay)
    metrics = trainer.update(batch, torch.arange(8), instruments=True)
    after = expert_weights(trainer.policy)
    for layer in range(2):
        rms = (after[layer].double() - before[layer].double()).pow(2).mean(1).sqrt()
        for e in range(8):
            key = f"/layer_{layer}/expert_{e}"
            assert metrics["optim/expert_step/active" + key] == float(e < 2)
            assert metrics["optim/expert_step/move_active" + key + "@weight"] == float(e < 2)
            assert metrics["optim/expert_step/move_active" + key] == pytest.approx(float(rms[e]), rel=1e-12)
    quiet = trainer.update(batch, torch.arange(8, 16), instruments=False)
    assert not any(k.startswith("optim/expert_step/active") for k in quiet)
    idle = {k: (0.0 if k.endswith("@weight") or "/active/" in k else 9.0) for k in metrics if "expert_step" in k}
    step = aggregate([metrics, idle])
    moved = "optim/expert_step/move_active/layer_0/expert_0"
    assert step["optim/expert_step/active/layer_0/expert_0"] == 0.5 and step[moved] == metrics[moved]
    assert "optim/expert_step/move_active/layer_0/expert_5" not in step  # active in no update: absent


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_multi_tensor_adamw_is_the_per_tensor_loop_bit_for_bit(weight_decay: float, dtype: torch.dtype) -> None:
    """`optimizers.adamw` runs torch's foreach implementation in float32 and float64; on CPU torch's default is the
    per-tensor loop. Over two parameter groups at two lrs (as the load-aware expert step builds them) and 12 steps of
    random gradients the weights agree exactly, so the switch changes no run's numbers, only its time. In bfloat16,
    where the two round differently, torch's default stays."""
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    start = [torch.randn(s, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, dtype=dtype) for s in shapes] for _ in range(12)]
    assert optimizers.exact_foreach([torch.nn.Parameter(t) for t in start]) is True
    assert optimizers.exact_foreach([{"params": [torch.nn.Parameter(start[0].bfloat16())]}]) is None

    def run(make) -> list[torch.Tensor]:  # noqa: ANN001
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = make([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}])
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params]

    ours = run(lambda groups: optimizers.adamw(groups, lr=1e-3, weight_decay=weight_decay, eps=1e-8))
    loop = run(
        lambda groups: torch.optim.AdamW(
            groups, lr=1e-3, weight_decay=weight_decay, betas=optimizers.BETAS, eps=1e-8, foreach=False
        )
    )
    assert all(torch.equal(a, b) for a, b in zip(ours, loop, strict=True))
