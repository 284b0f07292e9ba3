"""Matched starts: the cold start stops at a target on what RL sees, and ladder runs carry their rung."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.config import ColdStartConfig, ModelConfig, TaskConfig, TrainConfig, validate
from moe_rl.loop.cold_start import cold_start_key, train_cold_start
from moe_rl.loop.keys import run_keys
from moe_rl.models import build_model
from moe_rl.rollout.evaluation import sampled_reward_entropy
from moe_rl.run.identity import identity_hash
from moe_rl.tasks import make_tokenizer
from moe_rl.tasks.setup import setup_task

TASK = TaskConfig(n_train=64, n_eval=8)


def test_the_default_cold_start_keeps_its_key() -> None:
    """The new target keys at their defaults leave every cached cold start (and run identity) where it was."""
    plain = cold_start_key(ModelConfig(), TASK, ColdStartConfig())
    assert cold_start_key(ModelConfig(), TASK, ColdStartConfig(target=None, target_metric="greedy")) == plain
    assert cold_start_key(ModelConfig(), TASK, ColdStartConfig(target=0.15, target_metric="sampled")) != plain
    assert identity_hash(TrainConfig(rung="moe").to_dict()) == identity_hash(TrainConfig().to_dict())


def test_a_sampled_target_stops_at_the_first_evaluation_that_reaches_it() -> None:
    """Target 0.001: the first evaluation whose sampled reward is above 0 stops the warm-up, and the history
    records greedy accuracy, sampled reward and entropy at every evaluation."""
    cold = ColdStartConfig(eval_every=10, max_steps=200, target=0.001, target_metric="sampled")
    _, _, info = train_cold_start(ModelConfig(), TASK, cold)
    rewards = [h["sampled_reward"] for h in info["history"]]
    assert info["stopped"] == "target" and rewards[-1] >= 0.001 and all(r < 0.001 for r in rewards[:-1])
    assert info["steps"] == 10 * len(rewards) and info["sampled_reward"] == rewards[-1]
    assert all(0 < h["sampled_entropy"] < torch.log(torch.tensor(200.0)) for h in info["history"])


def test_sampled_reward_and_entropy_of_a_built_model() -> None:
    """An untrained model: reward 0 on reversal, and the entropy of its near-uniform next-token distribution
    within 0.1 nats of log(vocabulary) (the logits of a freshly initialised model are small)."""
    tokenizer = make_tokenizer()
    model = build_model("qwen3_moe", vocab_size=len(tokenizer)).eval()
    task = setup_task(TASK, 0).render(tokenizer)
    reward, entropy = sampled_reward_entropy(model, tokenizer, task.eval, task, n=2, max_new_tokens=4, seed=0)
    assert reward == 0.0
    assert entropy == pytest.approx(float(torch.log(torch.tensor(float(len(tokenizer))))), abs=0.1)
    again = sampled_reward_entropy(model, tokenizer, task.eval, task, n=2, max_new_tokens=4, seed=0)
    assert again == (reward, entropy)  # a seeded stream of its own


def test_a_bad_target_is_refused() -> None:
    for cold, match in (
        (ColdStartConfig(target_metric="pass"), "cold_start.target_metric"),
        (ColdStartConfig(target=1.5), r"cold_start.target=1.5 must lie in \(0, 1\]"),
    ):
        with pytest.raises(ValueError, match=match):
            validate(dataclasses.replace(TrainConfig(), cold_start=cold))


def test_a_ladder_run_is_keyed_by_its_rung_and_cold_seed() -> None:
    model = build_model("qwen3_moe", vocab_size=len(make_tokenizer()))
    cfg = TrainConfig(out_dir="/tmp/x", rung="moe")
    cfg.cold_start.seed = 1
    keys = run_keys(cfg, model)
    assert keys["rung"] == "moe" and keys["cold_seed"] == 1
    assert "rung" not in run_keys(TrainConfig(out_dir="/tmp/x"), model)  # other runs keep their columns
