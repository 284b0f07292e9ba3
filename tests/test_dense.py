"""The dense control: the default MoE model's attention and active width without routing, trained by the same loop."""

from __future__ import annotations

import pandas as pd
import pytest
from helpers import loop_config

from moe_rl.config import validate
from moe_rl.loop.cold_start import expected_key
from moe_rl.models import build_model, param_counts
from moe_rl.routing import UnsupportedRouterError, find_moe_layers
from moe_rl.tasks import make_tokenizer
from moe_rl.train import Trainer

V = len(make_tokenizer())  # 53 characters
H, L, E, K, WIDTH = 64, 2, 8, 2, 64  # the default qwen3_moe: hidden, layers, experts, top-k, expert width


def test_dense_control_has_the_moe_models_attention_and_its_active_mlp_width() -> None:
    moe, dense = build_model("qwen3_moe", vocab_size=V), build_model("qwen3_dense", vocab_size=V)
    assert type(dense).__name__ == "Qwen3ForCausalLM"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(dense.config, key) == getattr(moe.config, key), key
    assert dense.config.intermediate_size == K * moe.config.moe_intermediate_size == 128
    assert build_model("qwen3_dense", vocab_size=V, top_k=4, moe_intermediate_size=32).config.intermediate_size == 128
    assert len(build_model("qwen3_dense", vocab_size=V, num_layers=4).model.layers) == 4


def test_parameter_counts_follow_the_formula() -> None:
    # per layer: q, k, v, o projections (4 heads x 16, 2 KV heads x 16), q/k norms, two RMS norms
    attention = H * 64 + 2 * H * 32 + 64 * H + 2 * 16 + 2 * H
    mlp = 3 * H * K * WIDTH  # gate, up, down of one expert-sized MLP, times the k experts a token uses
    shared = 2 * V * H + H  # embeddings, untied head, final norm
    moe_total = shared + L * (attention + E * 3 * H * WIDTH + E * H)
    moe_active = shared + L * (attention + mlp + E * H)
    dense = shared + L * (attention + mlp)
    assert param_counts(build_model("qwen3_moe", vocab_size=V)) == (moe_total, moe_active) == (229376, 81920)
    assert param_counts(build_model("qwen3_dense", vocab_size=V)) == (dense, dense) == (80896, 80896)
    assert moe_active - dense == L * E * H  # the routers are all that differs


def test_a_dense_model_has_no_moe_layers_and_replay_is_refused(tmp_path) -> None:
    dense = build_model("qwen3_dense", vocab_size=V)
    assert find_moe_layers(dense, required=False) == []
    with pytest.raises(UnsupportedRouterError, match="has no MoE layer"):
        find_moe_layers(dense)
    cfg = loop_config(tmp_path, tmp_path / "cache", replay="r2")
    cfg.model.family = "qwen3_dense"
    with pytest.raises(ValueError, match=r"^replay.mode='r2' replays expert routes, but model.family='qwen3_dense'"):
        validate(cfg)
    cfg.replay.mode, cfg.algo.router_shift = "none", True
    with pytest.raises(ValueError, match=r"^algo.router_shift rescales ratios by the router's shift"):
        validate(cfg)


def test_the_dense_control_gets_its_own_cold_start(tmp_path) -> None:
    moe = loop_config(tmp_path, tmp_path / "cache")
    dense = loop_config(tmp_path, tmp_path / "cache")
    dense.model.family = "qwen3_dense"
    assert expected_key(dense.model, dense.task, dense.cold_start) != expected_key(moe.model, moe.task, moe.cold_start)


def test_two_dense_steps_log_reward_and_ratio_metrics_and_no_route_metrics(tmp_path) -> None:
    cfg = loop_config(tmp_path, tmp_path / "cache", steps=2, name="dense")
    cfg.model.family = "qwen3_dense"
    result = Trainer(cfg).run()
    assert result["status"] == "completed"
    frame = pd.read_parquet(tmp_path / "dense" / "metrics.parquet")
    keys = set(frame["key"])
    assert {"reward/mean", "ratio/token_var", "ratio/clipfrac_low", "kl/k3", "loss", "task/accuracy"} <= keys
    assert [k for k in keys if k.startswith("route/")] == []
    assert not (tmp_path / "dense" / "routes").exists()
    assert frame[["family", "num_moe_layers", "num_experts", "top_k"]].drop_duplicates().values.tolist() == [
        ["qwen3_dense", 0, 0, 0]
    ]
    assert sorted(frame["step"].unique()) == [0, 1, 2]
