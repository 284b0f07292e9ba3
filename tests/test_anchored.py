"""Anchored routing (`replay.mode=anchored`): every pass takes the frozen reference's routes, so route drift
from the start is zero by construction, and anchoring to the old policy is R2 bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import loop_config

from moe_rl.config import validate
from moe_rl.loop.passes import anchor_routes
from moe_rl.metrics.names import KL_UPDATE_K3_ACTING
from moe_rl.models import build_model
from moe_rl.rollout.generate import generate
from moe_rl.rollout.sampler import position_ids
from moe_rl.routing import RouteRecorder, compare_routes, find_moe_layers
from moe_rl.routing.anchored import AnchoredRouting
from moe_rl.tasks import make_tokenizer
from moe_rl.train import Trainer

TOKENIZER = make_tokenizer()
PROMPTS = ["1234", "98", "5071", "3"]


def teacher_forced_routes(model, rollout):
    """`model`'s own routes on the rollout's inputs, one teacher-forced pass."""
    mask = rollout.attention_mask[:, :-1]
    with torch.no_grad(), RouteRecorder(model) as recorder:
        model(input_ids=rollout.inputs, attention_mask=mask, position_ids=position_ids(mask))
    return recorder.routes.with_mask(rollout.token_mask)


def moved(model):
    """A copy of `model` whose routers are perturbed, so that it routes other experts."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for layer in find_moe_layers(other):
            layer.weight.add_(torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(1)))
    return other


def test_every_decoded_token_takes_the_anchors_routes() -> None:
    model = build_model("qwen3_moe", vocab_size=len(TOKENIZER))
    anchor = moved(model)
    with AnchoredRouting(model, anchor):
        rollout = generate(model, TOKENIZER, PROMPTS, group_size=2, max_new_tokens=6, seed=0)
    assert rollout.routes is not None
    # the prefill's and every decode step's routes are the anchor's own on the same tokens: 0 flips
    assert compare_routes(rollout.routes, teacher_forced_routes(anchor, rollout))["flip_rate"] == 0.0
    assert compare_routes(rollout.routes, teacher_forced_routes(model, rollout))["flip_rate"] > 0.2  # not its own


def test_an_anchor_with_the_models_weights_changes_no_bit() -> None:
    model = build_model("qwen3_moe", vocab_size=len(TOKENIZER))
    plain = generate(model, TOKENIZER, PROMPTS, group_size=2, max_new_tokens=6, seed=0)
    with AnchoredRouting(model, copy.deepcopy(model)):
        anchored = generate(model, TOKENIZER, PROMPTS, group_size=2, max_new_tokens=6, seed=0)
    assert torch.equal(anchored.sequences, plain.sequences)
    assert torch.equal(anchored.rollout_logp, plain.rollout_logp)
    assert plain.routes is not None and anchored.routes is not None
    assert torch.equal(anchored.routes.indices, plain.routes.indices)


def test_anchored_routing_refuses_itself_as_anchor_and_another_layout() -> None:
    model = build_model("qwen3_moe", vocab_size=len(TOKENIZER))
    with pytest.raises(ValueError, match="distinct"):
        AnchoredRouting(model, model)
    with pytest.raises(ValueError, match=r"anchor's MoE layers \(experts, k\)"):
        AnchoredRouting(model, build_model("qwen3_moe", vocab_size=len(TOKENIZER), num_experts=4))


def test_anchored_run_keeps_the_cold_starts_routes_as_the_policy_moves(tmp_path, cache) -> None:
    trainer = Trainer(loop_config(tmp_path, cache, replay="anchored", lr=3e-3))
    assert trainer.anchor is not None
    for step in (1, 2):
        metrics = trainer.step(step)
    assert metrics["route/native_vs_replayed/flip_rate"] > 0  # the live router has drifted from the start
    rollout = trainer.rollout(3).rollout
    assert rollout.routes is not None
    reference = anchor_routes(trainer.anchor, rollout, temperature=1.0)
    assert compare_routes(rollout.routes, reference)["flip_rate"] == 0.0  # rollout vs reference: no flip
    assert compare_routes(teacher_forced_routes(trainer.policy, rollout), reference)["flip_rate"] > 0
    old = trainer.old_pass(rollout, anchor=reference)
    assert old.routes is not None and compare_routes(old.routes, reference)["flip_rate"] > 0  # the native ones


class OldAnchored(Trainer):
    """Anchored to the old policy: the anchor takes the policy's weights at the start of every step."""

    def step(self, step: int) -> dict[str, float]:
        assert self.anchor is not None
        self.anchor.load_state_dict(self.policy.state_dict())
        return super().step(step)


def test_anchored_to_the_old_policy_is_r2_bitwise(tmp_path, cache) -> None:
    anchored = OldAnchored(loop_config(tmp_path, cache, replay="anchored", name="anchored"))
    r2 = Trainer(loop_config(tmp_path, cache, replay="r2", name="r2"))
    for step in (1, 2, 3):
        a, b = anchored.step(step), r2.step(step)
        a, b = ({k: v for k, v in m.items() if not k.startswith("time/")} for m in (a, b))
        assert a.pop(KL_UPDATE_K3_ACTING) > 0  # anchored alone acts with routes not its router's
        assert a.keys() == b.keys()
        assert [k for k in a if not (a[k] == b[k] or a[k] != a[k] and b[k] != b[k])] == []  # NaN == NaN
    r2_weights = dict(r2.policy.named_parameters())
    assert all(torch.equal(p, r2_weights[n]) for n, p in anchored.policy.named_parameters())


def test_anchored_needs_the_trainers_own_sampler(tmp_path, cache) -> None:
    cfg = loop_config(tmp_path, cache, replay="anchored")
    cfg.rollout.engine = "vllm"
    with pytest.raises(
        ValueError, match="replay.mode='anchored' forces the reference's routes while sampling: use rollout.engine=hf"
    ):
        validate(cfg)
