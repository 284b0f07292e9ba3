"""Routing Replay inside TRL's GRPOTrainer: a tiny MoE model trained a few steps per replay mode, on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import CheckpointError

pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from moe_rl.integrations.trl import (  # noqa: E402
    OLD_ROUTES,
    OLD_ROUTES_MASK,
    ROLLOUT_ROUTES,
    ROLLOUT_ROUTES_MASK,
    MoeGRPOTrainer,
    algo_args,
    check_trl_version,
    clip_fractions,
    generation_routes_to_forward,
    task_reward,
)
from moe_rl.models import build_model  # noqa: E402
from moe_rl.routing import RouteRecorder, Routes, compare_routes, find_moe_layers  # noqa: E402
from moe_rl.tasks import load_task, make_tokenizer  # noqa: E402


def digit_fraction(completions: list[str], **_) -> list[float]:
    """Shaping reward so that an untrained model sees non-zero advantages."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def make_trainer(
    tmp_path, replay: str, *, cls=MoeGRPOTrainer, algo: str = "grpo", steps: int = 3, **overrides
) -> MoeGRPOTrainer:
    tokenizer = make_tokenizer()
    model = build_model("qwen3_moe", vocab_size=len(tokenizer))
    data = load_task("reversal", n_train=8, n_eval=0, seed=0)["train"]
    args = dict(
        output_dir=str(tmp_path / replay),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=6,
        max_steps=steps,
        num_iterations=2,
        learning_rate=3e-2,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    args.update(algo_args(algo))
    args.update(overrides)
    return cls(
        model=model,
        args=GRPOConfig(**args),
        processing_class=tokenizer,
        train_dataset=data,
        reward_funcs=[task_reward("reversal", partial_credit=0.5), digit_fraction],
        routing_replay=replay,
    )


def routes_of(trainer: MoeGRPOTrainer, inputs: dict, key: str, mask_key: str) -> Routes:
    layers = find_moe_layers(trainer.accelerator.unwrap_model(trainer.model))
    return Routes(inputs[key], inputs[mask_key], tuple(layer.decoder_layer for layer in layers), layers[0].num_experts)


class RecordingTrainer(MoeGRPOTrainer):
    """Records, outside the trainer's own hooks, the routes each update forward actually used."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        with RouteRecorder(self.accelerator.unwrap_model(self.model)) as recorder:  # replay hooks run first
            loss = super().compute_loss(model, inputs, *args, **kwargs)
        cached = self.replay_mode.pick(old=(OLD_ROUTES, OLD_ROUTES_MASK), rollout=(ROLLOUT_ROUTES, ROLLOUT_ROUTES_MASK))
        self.seen.append((recorder.records[0], routes_of(self, inputs, *cached) if cached else None, inputs))
        return loss


ROUTE_KEYS = (
    "route/old_vs_new/flip_rate",
    "route/old_vs_new/expert_flip_frac",
    "route/old_vs_new/token_flip_rate",
    "route/old_vs_new/flip_rate/layer_1",
    "route/rollout_vs_old/flip_rate",
    "route/margin_mean",
)
RATIO_KEYS = (
    "ratio/token_var",
    "ratio/token_max",
    "ratio/seq_var",
    "ratio/ess",
    "ratio/extreme_frac",
    "kl/k3",
    "ratio/clipfrac_low",
    "ratio/clipfrac_high",
)
REPLAY_KEYS = ("route/native_vs_replayed/flip_rate", "route/used_vs_cached/flip_rate")


@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_replay_modes_train_and_log(tmp_path, replay: str) -> None:
    # num_iterations=2: TRL computes old log-probs and every second update reuses a batch off-policy.
    # TRL's default gradient checkpointing stays on: recomputation in backward must replay too.
    trainer = make_trainer(tmp_path, replay, cls=RecordingTrainer)
    trainer.seen = []
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert len(trainer.seen) == 3
    for used, cached, inputs in trainer.seen:
        B, T = inputs["prompt_ids"].shape[0], inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
        assert used.shape[:2] == (B, T)  # routes of exactly the forward's input_ids
        if cached is not None:
            assert cached.shape == used.shape and cached.mask.sum() > 0
            assert compare_routes(used, cached)["flip_rate"] == 0.0  # replay applied at every valid position
            # Only the last column lacks a route: it predicts nothing.
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1).bool()
            expected = attention.clone()
            expected[:, -1] = False
            assert torch.equal(cached.mask, expected)

    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 3
    for key in ROUTE_KEYS + RATIO_KEYS:
        assert any(key in row for row in logs), key
        assert all(math.isfinite(row[key]) for row in logs if key in row), key
    for key in REPLAY_KEYS:
        assert all(key in row for row in logs) == (replay != "none"), key
    if replay != "none":
        assert all(row["route/used_vs_cached/flip_rate"] == 0.0 for row in logs)
    # Same weights and fp32 for generation and the old pass: identical routes (checks the R3 column map).
    assert all(row["route/rollout_vs_old/flip_rate"] == 0.0 for row in logs if "route/rollout_vs_old/flip_rate" in row)
    # The second update reuses the batch after an optimizer step: off-policy ratios.
    assert logs[0]["ratio/token_var"] < 1e-10 and logs[1]["ratio/token_var"] > 0
    changed = sum(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert changed > 0


class ForeignRoutesTrainer(MoeGRPOTrainer):
    """Replaces the cached R2 routes by routes the router never picks: expert e -> (e + 1) mod E."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        routes = routes_of(self, output, OLD_ROUTES, OLD_ROUTES_MASK)
        shifted = Routes.from_topk(
            (routes.indices.long() + 1) % routes.num_experts, routes.mask, routes.layer_map, routes.num_experts
        )
        output[OLD_ROUTES] = shifted.indices
        return output


def test_replay_forces_routes_the_router_would_not_choose(tmp_path) -> None:
    # With top-2 of 8 experts, {a+1, b+1} never equals {a, b}. In the first update theta == theta_old,
    # so layer 0 (whose input replay cannot change) natively picks the old routes: every valid position
    # is forced off them. The experts must still receive exactly the cached routes.
    trainer = make_trainer(tmp_path, "r2", cls=ForeignRoutesTrainer, steps=2, gradient_checkpointing=False)
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert logs[0]["route/native_vs_replayed/flip_rate/layer_0"] == 1.0
    # Later layers see hidden states of the forced experts, and the update pulls the router towards
    # the forced experts (their gate weights get the gradient), so some native choices now agree.
    assert all(row["route/native_vs_replayed/flip_rate"] > 0.5 for row in logs)
    assert [row["route/used_vs_cached/flip_rate"] for row in logs] == [0.0, 0.0]


class ReplayOnlyInForward(ForeignRoutesTrainer):
    """Negative control: replay hooks removed right after the forward, before backward."""

    training_step = GRPOTrainer.training_step


def one_update(tmp_path, cls, name: str, checkpointing: bool) -> dict[str, torch.Tensor]:
    trainer = make_trainer(tmp_path / name, "r2", cls=cls, steps=1, gradient_checkpointing=checkpointing)
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_gradient_checkpointing_recomputes_with_the_replayed_routes(tmp_path) -> None:
    # Foreign routes make forced and native routes differ everywhere, so a backward whose recomputation
    # routed natively would give other gradients (or fail torch's recomputation check).
    plain = one_update(tmp_path, ForeignRoutesTrainer, "plain", checkpointing=False)
    checkpointed = one_update(tmp_path, ForeignRoutesTrainer, "checkpointed", checkpointing=True)
    assert all(torch.allclose(plain[n], checkpointed[n], rtol=0, atol=1e-6) for n in plain)
    try:
        broken = one_update(tmp_path, ReplayOnlyInForward, "broken", checkpointing=True)
    except CheckpointError:  # what torch says when recomputation saves other tensors than the forward did
        return
    assert not all(torch.allclose(plain[n], broken[n], rtol=0, atol=1e-6) for n in plain)


def test_gspo_r3_minibatches_keep_routes_on_their_rows(tmp_path) -> None:
    # steps_per_generation=2: TRL shuffles the generation batch and splits it into two updates. In the
    # first update theta == theta_old, so the router's own routes equal the cached ones row by row only
    # if the routes travelled with their rows.
    trainer = make_trainer(
        tmp_path,
        "r3",
        algo="gspo",
        steps=2,
        num_iterations=1,
        steps_per_generation=2,
        per_device_train_batch_size=8,
        gradient_checkpointing=False,
    )
    trainer.train()
    first, second = [row for row in trainer.state.log_history if "loss" in row]
    assert first["route/native_vs_replayed/flip_rate"] == 0.0 and first["route/old_vs_new/flip_rate"] == 0.0
    assert first["route/rollout_vs_old/flip_rate"] == 0.0
    assert abs(first["ratio/token_max"] - 1.0) < 1e-5 and second["ratio/seq_var"] > 0
    for key in RATIO_KEYS + REPLAY_KEYS:
        assert key in second, key


# --- pure helpers ----------------------------------------------------------------------------------------


def test_generation_routes_map_to_the_forward_layout() -> None:
    # 2 rows, prompt P = 3 (row 1 left-padded by one), n = 3 generated tokens -> generation routes cover
    # P + n - 1 = 5 columns; the forward covers P + C = 6 (C = 3), row 0's completion is 2 tokens long.
    L, k, E = 2, 2, 8
    indices = torch.arange(2 * 5 * L * k).view(2, 5, L, k) % E
    indices = indices.sort(-1).values
    gen_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    routes = Routes.from_topk(indices, gen_mask, (0, 1), E)
    attention = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    out = generation_routes_to_forward(routes, attention, prompt_len=3, generation_prompt_len=3)
    assert out.shape == (2, 6, L, k)
    assert torch.equal(out.indices[:, :5], routes.indices)
    assert out.mask.tolist() == [[True, True, True, True, True, False], [False, True, True, True, True, False]]
    with pytest.raises(ValueError, match="padded to 4"):
        generation_routes_to_forward(routes, attention, prompt_len=3, generation_prompt_len=4)
    with pytest.raises(ValueError, match="prompt padding"):
        generation_routes_to_forward(routes, attention.flip(0), prompt_len=3, generation_prompt_len=3)


def test_clip_fractions_by_hand() -> None:
    logp = torch.log(torch.tensor([[0.5, 1.5, 1.0], [2.0, 1.0, 1.0]]))
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([-1.0, 1.0])
    token = clip_fractions(logp=logp, old_logp=old, adv=adv, mask=mask, eps_low=0.2, eps_high=0.2, level="token")
    assert token == {"ratio/clipfrac_low": 0.25, "ratio/clipfrac_high": 0.25}  # 0.5 with A<0; 2.0 with A>0
    seq = clip_fractions(logp=logp, old_logp=old, adv=adv, mask=mask, eps_low=0.2, eps_high=0.2, level="sequence")
    # s_0 = (0.5 * 1.5 * 1)^(1/3) = 0.909 (inside), s_1 = 2.0 with A > 0 (clipped high)
    assert seq == {"ratio/clipfrac_low": 0.0, "ratio/clipfrac_high": 0.5}


def test_task_reward_reads_the_dataset_columns() -> None:
    reward = task_reward("reversal", partial_credit=0.5)
    out = reward(
        completions=["1703", "1704", "17x"],
        prompts=["R3071="] * 3,
        answer=["1703"] * 3,
        digits=["3071"] * 3,
        trainer_state=object(),
        log_metric=print,
    )
    assert out == [1.0, 0.5, 0.0] and reward.__name__ == "reversal_reward"


def test_version_gate_and_argument_errors(tmp_path) -> None:
    check_trl_version("1.16.0")
    check_trl_version("1.16.3.dev0")
    for bad in ("1.15.2", "1.17.0", "1.17.0.dev0", "2.0.0"):
        with pytest.raises(ImportError, match=r"trl>=1.16,<1.17"):
            check_trl_version(bad)
    with pytest.raises(ValueError, match="valid"):
        algo_args("ppo")
    with pytest.raises(ValueError, match="valid"):
        make_trainer(tmp_path, "r4")
    # the thresholded modes, Total Router Recall and anchored routing run in the harness's own loop only
    for mode in ("r2_threshold", "r3_threshold", "trr", "anchored"):
        with pytest.raises(ValueError, match=rf"routing_replay='{mode}' is not valid; valid: \['none', 'r2', 'r3'\]"):
            make_trainer(tmp_path, mode)
