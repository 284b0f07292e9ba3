"""The trained policy leaves a run as a `save_pretrained` folder that reloads to the same logits."""

from __future__ import annotations

import pandas as pd
import torch
from helpers import tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from moe_rl.export import main
from moe_rl.routing import load_snapshot
from moe_rl.run.folder import load_checkpoint
from moe_rl.train import Trainer


def test_export_reloads_with_the_same_logits_and_snapshots_carry_tokens(tmp_path) -> None:
    cfg = tiny_config(
        tmp_path / "run",
        "steps=2",
        "eval_every=2",
        "eval_size=4",
        "snapshot_every=2",
        "checkpoint_every=0",
        "keep_checkpoint=true",
        "threads=1",
        "task.n_train=64",
        "task.n_eval=8",
        "rollout.prompts_per_step=2",
        "optim.lr=1e-2",
        "cold_start.mode=none",
        "cold_start.band=[0.2,0.6]",  # the defaults: no cold start to train
        "cold_start.max_steps=3000",
        "pass_at_k.k=[1,2]",
        "pass_at_k.n=4",
        cache=tmp_path / "cache",
    )
    trainer = Trainer(cfg)
    start = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    with torch.no_grad():  # weights the cold start does not have: the export must take the run's own
        trainer.policy.lm_head.weight.add_(0.01)
    result = trainer.run()
    assert result["status"] == "no_signal"  # an untrained policy never earns a reward: said, not hidden
    metrics = pd.read_parquet(tmp_path / "run" / "metrics.parquet").pivot_table(
        index="step", columns="key", values="value"
    )
    assert metrics.loc[[0, 2], "eval/pass@1"].between(0, 1).all()
    assert (metrics.loc[[0, 2], "eval/pass@2"] >= metrics.loc[[0, 2], "eval/pass@1"]).all()
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["step"] == 2  # the final weights were kept
    assert main([str(tmp_path / "run"), str(tmp_path / "policy")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "policy")
    ids = tokenizer(["R3071=", "R12="], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        want = trainer.policy(**ids).logits
        got = model(**ids).logits
    assert torch.equal(got, want)
    assert not torch.equal(model.lm_head.weight, start["lm_head.weight"])  # the run's weights, not the start's
    # the step-2 snapshot names the token at every routed position
    routes, token_ids = load_snapshot(tmp_path / "run" / "routes" / "step_00002_old.safetensors")
    assert token_ids.shape == routes.mask.shape == (8, routes.indices.shape[1])
    prompt = tokenizer.decode(token_ids[0][routes.mask[0]][:6])
    assert prompt.startswith("R") and prompt.rstrip("0123456789=")[:1] == "R"
    assert main([str(tmp_path / "nothing"), str(tmp_path / "out")]) == 1
