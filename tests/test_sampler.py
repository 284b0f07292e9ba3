"""The lean sampling loop draws bitwise what `model.generate` draws: tokens, logits, routes."""

from __future__ import annotations

import pytest
import torch

from moe_rl.models import build_model
from moe_rl.rollout.generate import generate
from moe_rl.tasks import make_tokenizer

PROMPTS = ["12345", "907", "4821", "56", "3"]
FINE = {"num_experts": 64, "top_k": 8, "num_hidden_layers": 4, "moe_intermediate_size": 16}


def _pair(model, tokenizer, **kwargs):
    loop = generate(model, tokenizer, PROMPTS, sampler="loop", **kwargs)
    ref = generate(model, tokenizer, PROMPTS, sampler="generate", **kwargs)
    return loop, ref


def _assert_same(loop, ref) -> None:
    assert torch.equal(loop.sequences, ref.sequences)
    assert torch.equal(loop.attention_mask, ref.attention_mask)
    assert torch.equal(loop.response_mask, ref.response_mask)
    assert torch.equal(loop.rollout_logp, ref.rollout_logp)  # bitwise, not close
    assert loop.completions == ref.completions
    if ref.routes is not None:
        assert torch.equal(loop.routes.indices, ref.routes.indices)
        assert torch.equal(loop.routes.mask, ref.routes.mask)
        assert loop.routes.layer_map == ref.routes.layer_map


@pytest.mark.parametrize(
    ("family", "overrides", "dtype"),
    [
        ("qwen3_moe", {}, torch.float32),
        ("qwen3_moe", FINE, torch.float32),
        ("qwen3_moe", FINE, torch.bfloat16),
        ("mixtral", {}, torch.float32),
        ("gpt_oss", {}, torch.float32),
        ("deepseek_v3", {}, torch.float32),
    ],
)
def test_loop_matches_generate_bitwise(family: str, overrides: dict, dtype: torch.dtype) -> None:
    model = build_model(family, **overrides).to(dtype)
    tokenizer = make_tokenizer()
    for seed, temperature in [(0, 1.0), (1, 1.0), (7, 0.7), (123, 1.3)]:
        loop, ref = _pair(model, tokenizer, group_size=3, max_new_tokens=6, temperature=temperature, seed=seed)
        _assert_same(loop, ref)
        assert loop.sequences.shape[1] == loop.prompt_len + 6
    loop, ref = _pair(model, tokenizer, group_size=2, max_new_tokens=5, greedy=True)
    _assert_same(loop, ref)


def test_loop_matches_generate_when_rows_stop_early() -> None:
    """With EOS likely, rows finish at different steps (then emit pads) and all finish before the
    limit: the loop must stop at the same step and pad the same rows."""
    model = build_model("qwen3_moe")
    tokenizer = make_tokenizer()
    eos = tokenizer.eos_token_id

    def favour_eos(module, args, logits):  # EOS about as likely as all other tokens together
        logits[..., eos] += 4.0
        return logits

    handle = model.lm_head.register_forward_hook(favour_eos)
    try:
        lengths = set()
        for seed in range(4):
            loop, ref = _pair(model, tokenizer, group_size=4, max_new_tokens=12, seed=seed)
            _assert_same(loop, ref)
            lengths.add(loop.sequences.shape[1] - loop.prompt_len)
            assert (loop.sequences[:, loop.prompt_len :] == tokenizer.pad_token_id).any()  # finished rows padded
    finally:
        handle.remove()
    assert min(lengths) < 12  # some batch finished before max_new_tokens


def test_loop_without_route_recording_and_unknown_sampler() -> None:
    model = build_model("qwen3_moe")
    tokenizer = make_tokenizer()
    loop, ref = _pair(model, tokenizer, group_size=2, max_new_tokens=4, seed=3, record_routes=False)
    assert loop.routes is None and ref.routes is None
    _assert_same(loop, ref)
    with pytest.raises(ValueError, match="unknown sampler 'vllm'; valid"):
        generate(model, tokenizer, PROMPTS, sampler="vllm")


def test_loop_samples_in_inference_mode_and_returns_tensors_autograd_can_save() -> None:
    """The loop decodes in inference mode (bitwise `generate`'s tokens, above) but hands back ordinary tensors:
    a teacher-forced pass with gradients on its rollout, replaying its routes, saves them and backpropagates."""
    from moe_rl.rollout.generate import forward_logp
    from moe_rl.rollout.sampler import sample_loop
    from moe_rl.routing import RouteReplay

    model = build_model("qwen3_moe")
    tokenizer = make_tokenizer()
    rollout = generate(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=4, seed=5)
    routes = rollout.routes
    assert routes is not None
    held = [rollout.sequences, rollout.attention_mask, rollout.response_mask, rollout.rollout_logp]
    assert not any(t.is_inference() for t in [*held, routes.indices, routes.mask])
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    sampled = sample_loop(
        model, enc["input_ids"], enc["attention_mask"], max_new_tokens=3, eos_token_id=2, pad_token_id=0
    )
    assert not sampled.sequences.is_inference() and not any(x.is_inference() for x in sampled.logits)
    with RouteReplay(model, routes):
        logp, _ = forward_logp(model, rollout)
    (logp * rollout.response_mask).sum().backward()
    assert all(p.grad is not None for p in model.lm_head.parameters())
