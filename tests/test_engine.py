"""Rollouts from an in-process vLLM engine (moe_rl.rollout.engine): routes, log-probs, weight sync, R3, resume.

Needs the `vllm` extra (CPU build); skipped without it. One engine per family for the whole module.
"""

from __future__ import annotations

import os

import pandas as pd
import pytest
import torch
from helpers import run_metrics, tiny_config
from omegaconf import OmegaConf

from moe_rl.config import TrainConfig, validate
from moe_rl.routing import RoutedPass, route_overlap

vllm = pytest.importorskip("vllm")
BEFORE_ENGINE = set(os.environ)

from moe_rl.models import build_model  # noqa: E402
from moe_rl.rollout.engine import VllmEngine, check_sync, trainer_logp  # noqa: E402
from moe_rl.rollout.generate import forward_logp  # noqa: E402
from moe_rl.tasks.tokenizer import make_tokenizer  # noqa: E402

PROMPTS = ["ABC=", "HELLO WORLD=", "XY=", "12+34="]
G = 4  # completions per prompt


def keys(step: int = 0) -> list[tuple[int, int, int]]:
    return [(0, step, i) for i in range(len(PROMPTS) * G)]


def make_engine(family: str) -> tuple[VllmEngine, torch.nn.Module, object]:
    tokenizer = make_tokenizer()
    model = build_model(family, head_dim=32, vocab_size=len(tokenizer))
    return VllmEngine(model, dtype="float32", seed=0), model, tokenizer


@pytest.fixture(scope="module")
def qwen():
    engine, model, tokenizer = make_engine("qwen3_moe")
    yield engine, model, tokenizer
    engine.close()


@pytest.fixture(scope="module")
def mixtral():
    engine, model, tokenizer = make_engine("mixtral")
    yield engine, model, tokenizer
    engine.close()


def rollout_of(engine: VllmEngine, tokenizer, step: int = 0, max_new_tokens: int = 8):
    return engine.generate(tokenizer, PROMPTS, row_keys=keys(step), group_size=G, max_new_tokens=max_new_tokens)


def check_routes_and_logp(engine, model, tokenizer) -> None:
    rollout = rollout_of(engine, tokenizer)
    with torch.no_grad(), RoutedPass(model) as routed:
        logp, _ = forward_logp(model, rollout)
    trainer = routed.native.with_mask(rollout.token_mask)
    both = rollout.routes.mask & trainer.mask
    # the engine routes every real input token except each row's last one (never fed back)
    assert both.sum().item() == (rollout.attention_mask.sum(-1) - 1).sum().item() > 0
    overlap = route_overlap(rollout.routes, trainer)  # (B, T, L)
    assert (overlap[both] == trainer.top_k).all()  # the same top-k set at every (token, layer)
    mask = rollout.response_mask
    assert (rollout.rollout_logp - logp).abs()[mask].max().item() < 1e-5
    assert (rollout.rollout_logp[~mask] == 0).all()


def test_engine_leaves_no_launcher_variables_behind(qwen) -> None:
    """vLLM exports LOCAL_WORLD_SIZE, LD_PRELOAD, ... for its workers; later torchrun/submitit launches from
    this process would inherit them (submitit then refuses: "LOCAL_WORLD_SIZE is already set")."""
    from moe_rl.rollout.engine import LAUNCH_ENV

    assert not {key for key in LAUNCH_ENV if key in os.environ} - BEFORE_ENGINE


def test_engine_routes_equal_trainer_routes_qwen3_moe(qwen) -> None:
    check_routes_and_logp(*qwen)


def test_engine_routes_equal_trainer_routes_mixtral(mixtral) -> None:
    check_routes_and_logp(*mixtral)


def test_rollout_logp_is_at_the_sampling_temperature(qwen) -> None:
    engine, model, tokenizer = qwen
    rollout = engine.generate(tokenizer, PROMPTS, row_keys=keys(), group_size=G, max_new_tokens=8, temperature=0.7)
    logp, _ = forward_logp(model, rollout, temperature=0.7)
    mask = rollout.response_mask
    assert (rollout.rollout_logp - logp).abs()[mask].max().item() < 1e-5
    plain, _ = forward_logp(model, rollout)
    assert (rollout.rollout_logp - plain).abs()[mask].max().item() > 1e-2  # temperature 1 would not match


def test_rollout_layout_matches_generate(qwen) -> None:
    engine, _, tokenizer = qwen
    rollout = rollout_of(engine, tokenizer)
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    P = enc["input_ids"].shape[1]
    assert rollout.prompt_len == P
    assert torch.equal(rollout.sequences[:, :P], enc["input_ids"].repeat_interleave(G, 0))
    assert torch.equal(rollout.attention_mask[:, :P], enc["attention_mask"].repeat_interleave(G, 0))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for row, mask, response in zip(rollout.sequences, rollout.attention_mask, rollout.response_mask):
        completion = row[P:]
        n = int(mask[P:].sum())
        assert mask[P:].tolist() == [1] * n + [0] * (completion.numel() - n)  # real tokens, then pads
        assert (completion[n:] == pad).all()
        assert (completion[: n - 1] != eos).all()  # EOS, if any, ends the completion
        assert response[P - 1 :].tolist() == mask[P:].bool().tolist()
    # the same row keys give the same completions, whatever else is in the batch
    again = engine.generate(tokenizer, PROMPTS[:1], row_keys=keys()[:G], group_size=G, max_new_tokens=8)
    n = again.sequences.shape[1] - again.prompt_len  # its own prompt is not padded
    assert torch.equal(again.sequences[:, again.prompt_len :], rollout.sequences[:G, P : P + n])
    assert (rollout.sequences[:G, P + n :] == pad).all()


def test_prefix_cache_hits_give_the_same_routes(qwen) -> None:
    """Prompts longer than one KV block (32 tokens): the second call reads the first block from the
    prefix cache, and its routes (kept per cached token) equal those the first call computed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine, _, tokenizer = qwen
    prompts = ["0123456789" * 4 + "=", "ABCDEFGHIJ" * 4 + "="]
    row_keys = [(0, 5, i) for i in range(2 * G)]
    engine.llm.reset_prefix_cache()
    cold = engine.generate(tokenizer, prompts, row_keys=row_keys, group_size=G)
    warm = engine.generate(tokenizer, prompts, row_keys=row_keys, group_size=G)
    ids = tokenizer(prompts[0], add_special_tokens=False)["input_ids"]
    probe = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1), use_tqdm=False)
    assert probe[0].num_cached_tokens >= 32  # the cache is really hit
    assert torch.equal(cold.sequences, warm.sequences)
    assert torch.equal(cold.routes.mask, warm.routes.mask) and cold.routes.mask.sum() > 2 * G * 32
    assert torch.equal(cold.routes.indices[cold.routes.mask], warm.routes.indices[warm.routes.mask])
    assert torch.equal(cold.rollout_logp, warm.rollout_logp)


def test_r3_replays_the_engine_routes_exactly(qwen) -> None:
    engine, model, tokenizer = qwen
    rollout = rollout_of(engine, tokenizer)
    other = build_model("qwen3_moe", head_dim=32, vocab_size=len(tokenizer), seed=1)  # routes differently
    with torch.no_grad(), RoutedPass(other, rollout.routes) as routed:
        forward_logp(other, rollout)
    used, native = routed.used.with_mask(rollout.routes.mask), routed.native.with_mask(rollout.routes.mask)
    assert torch.equal(used.indices.sort(-1).values[used.mask], rollout.routes.indices.sort(-1).values[used.mask])
    assert (route_overlap(native, rollout.routes)[used.mask] < native.top_k).any()  # replay changed something


def test_sync_after_an_update_is_exact_and_checked(qwen) -> None:
    engine, model, tokenizer = qwen
    before = rollout_of(engine, tokenizer)
    updated = build_model("qwen3_moe", head_dim=32, vocab_size=len(tokenizer))
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # every weight moves, routers included
    with pytest.raises(RuntimeError, match=r"engine weight sync is inexact: .* differ by"):
        check_sync(engine, updated, before)
    engine.sync(updated)
    try:
        assert check_sync(engine, updated, before)["rollout/engine_sync_max_diff"] < 1e-5
        # on a rollout the synced engine produced (as the loop checks), engine and trainer route alike
        seen = check_sync(engine, updated, rollout_of(engine, tokenizer, step=1))
        assert seen["rollout/engine_sync_off_tokens"] == 0 and seen["rollout/engine_sync_route_diffs"] == 0
        check_routes_and_logp(engine, updated, tokenizer)
        stale_gap = (trainer_logp(model, before) - engine.logp(before)).abs()[before.response_mask].max().item()
        assert stale_gap > 1e-2  # the engine no longer computes the old weights
    finally:
        engine.sync(model)  # later tests in this module use the built weights
    assert torch.equal(rollout_of(engine, tokenizer).sequences, before.sequences)


class Shifted:
    """An engine whose log-probs are the trainer's plus `delta`."""

    def __init__(self, exact: torch.Tensor, delta: torch.Tensor, dtype: str) -> None:
        self.exact, self.delta, self.dtype = exact, delta, dtype

    def logp(self, rollout) -> torch.Tensor:
        return self.exact + self.delta


def test_reduced_precision_check_bounds_the_mean_gap_not_its_tail(qwen) -> None:
    """bfloat16 vs float32: one token 1.07 nats off is the real gap's tail (seen in engine_mismatch), not a
    failed sync; 0.2 nats on every token is one. The check returns the max either way."""
    engine, model, tokenizer = qwen
    rollout = rollout_of(engine, tokenizer)
    exact = trainer_logp(model, rollout)
    tail = torch.zeros_like(exact)
    row, col = rollout.response_mask.nonzero()[0].tolist()
    tail[row, col] = 1.07
    seen = check_sync(Shifted(exact, tail, "bfloat16"), model, rollout)
    assert seen["rollout/engine_sync_max_diff"] == pytest.approx(1.07)
    with pytest.raises(RuntimeError, match=r"engine weight sync failed: .* 0.2 nats per token on average"):
        check_sync(Shifted(exact, torch.full_like(exact, 0.2), "bfloat16"), model, rollout)


def test_float32_check_logs_a_near_tie_and_stops_a_bad_sync(qwen) -> None:
    """float32: one token 0.00297 nats off (a near-tie routed differently by engine and trainer, as once
    seen in a grpo_mis engine run) is logged, not fatal; a bad sync is fatal whether it moves every token
    by 0.2 nats or many tokens by just over the per-token tolerance."""
    engine, model, tokenizer = qwen
    rollout = rollout_of(engine, tokenizer)
    exact = trainer_logp(model, rollout)
    mask = rollout.response_mask
    cells = mask.nonzero()
    near_tie = torch.zeros_like(exact)
    near_tie[tuple(cells[0].tolist())] = 0.00297
    seen = check_sync(Shifted(exact, near_tie, "float32"), model, rollout)
    assert seen["rollout/engine_sync_max_diff"] == pytest.approx(0.00297, abs=2**-20)  # one float32 ulp at |logp| < 16
    assert seen["rollout/engine_sync_off_tokens"] == 1
    assert seen["rollout/engine_sync_route_diffs"] == 0  # the planted gap, not a routing difference
    with pytest.raises(RuntimeError, match=r"engine weight sync is inexact: .* by 0.2 nats per token on average"):
        check_sync(Shifted(exact, torch.full_like(exact, 0.2), "float32"), model, rollout)
    many = torch.zeros_like(exact)
    chosen = cells[: int(0.1 * len(cells)) + 1]  # 10% of the tokens, each 2e-4 off: mean under 1e-4
    many[chosen[:, 0], chosen[:, 1]] = 2e-4
    assert float((many * mask).sum() / mask.sum()) < 1e-4
    with pytest.raises(RuntimeError, match=r"tokens beyond 0.0001 in float32"):
        check_sync(Shifted(exact, many, "float32"), model, rollout)


def test_engine_run_refuses_head_dim_16() -> None:
    cfg = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.from_dotlist(["rollout.engine=vllm"]))
    )
    with pytest.raises(ValueError, match=r"head_dim >= 32, this model has head_dim 16; set model.head_dim=32"):
        validate(cfg)
    cfg.model.head_dim = 32
    validate(cfg)


# --- a whole run with the engine ---------------------------------------------------------------------

# An R3 engine run on an untrained policy: what it changes from the tests' tiny run (helpers.TINY).
ENGINE = (
    "steps=4",
    "eval_every=2",
    "eval_size=8",
    "checkpoint_every=2",
    "task.n_train=64",
    "task.n_eval=8",
    "task.partial_credit=0.5",
    "optim.lr=3e-3",
    "cold_start.mode=none",
    "cold_start.band=[0.2,0.6]",  # the defaults: no cold start to train
    "cold_start.max_steps=3000",
    "model.head_dim=32",
    "rollout.engine=vllm",
    "replay.mode=r3",
)


@pytest.mark.slow
def test_engine_run_resumes_mid_run_to_identical_metrics(tmp_path, monkeypatch) -> None:
    from moe_rl.train import Trainer, train

    # An untrained policy (cold_start.mode=none) rarely earns a reward: `no_signal` is the honest label.
    # Resume is still tested in full: the engine's rollouts must come back the same after a restart.
    finished = ("completed", "no_signal")
    assert train(tiny_config(tmp_path / "reference", *ENGINE))["status"] in finished
    reference = run_metrics(tmp_path / "reference")
    gap = reference[reference["key"] == "rollout/engine_sync_max_diff"]["value"]
    assert len(gap) == 2 and gap.max() < 1e-4  # checked after the first two syncs
    flips = reference[reference["key"] == "route/rollout_vs_old/flip_rate"]["value"]
    assert len(flips) == 4 and (flips == 0).all()  # float32: the trainer routes as the engine did
    assert (reference[reference["key"] == "rollout/token_mult_prob_error"]["value"] < 1 + 1e-5).all()
    # the mismatch metrics peers log, on every step of an engine run (the rollout policy is the engine's)
    wide = reference[reference["step"] >= 1].pivot_table(index="step", columns="key", values="value")
    for key in ("rollout/k3_kl", "rollout/logp_sq_diff", "rollout/logp_gap_over_ln5", "ratio/split/engine_var"):
        assert len(wide[key]) == 4 and ((wide[key] >= 0) & (wide[key] < 1e-6)).all(), key  # float32 engine
    assert (wide["rollout/logp_abs_diff"] == wide["rollout/logp_gap"]).all()
    assert ((wide["route/r3_fallback_frac"] >= 0) & (wide["route/r3_fallback_frac"] <= 1)).all()
    assert (wide["route/replay_replace_rate"] == 0).all()

    step = Trainer.step

    def interrupted(self, n):
        if n == 3:
            raise KeyboardInterrupt
        return step(self, n)

    monkeypatch.setattr(Trainer, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Trainer(tiny_config(tmp_path / "resumed", *ENGINE)).run()
    monkeypatch.setattr(Trainer, "step", step)
    assert train(tiny_config(tmp_path / "resumed", *ENGINE))["status"] in finished
    resumed = run_metrics(tmp_path / "resumed")
    probes = resumed[resumed["key"] == "rollout/engine_sync_max_diff"]
    assert probes["step"].tolist() == [1, 2, 3, 4] and probes["value"].max() < 1e-4  # the resumed process checks too
    checks = ["rollout/engine_sync_max_diff", "rollout/engine_sync_off_tokens", "rollout/engine_sync_route_diffs"]
    same = [
        frame[~frame["key"].isin(checks)].reset_index(drop=True).drop(columns="run") for frame in (resumed, reference)
    ]
    pd.testing.assert_frame_equal(*same)
