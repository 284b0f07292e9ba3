"""`grouped_mm_cpu` (moe_rl.models.cpu_experts) against transformers' `grouped_mm`: the same bits, forward and
backward, on one thread (the runs' setting; at two threads `grouped_mm` differs from itself run to run)."""

from __future__ import annotations

import pytest
import torch

from moe_rl.models import build_model, default_experts_implementation
from moe_rl.models.cpu_experts import NAME, _covered

FINE = {"num_experts": 64, "top_k": 8, "num_layers": 4, "moe_intermediate_size": 16}
CASES = [("qwen3_moe", {}), ("qwen3_moe", FINE), ("mixtral", {}), ("olmoe", {}), ("qwen2_moe", {}), ("gpt_oss", {})]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pass(family: str, overrides: dict, impl: str, tokens: torch.Tensor):
    model = build_model(family, experts_implementation=impl, **overrides)
    logits = model(tokens).logits
    logits.pow(2).mean().backward()
    return model, logits, [p.grad for p in model.parameters()]


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=[f"{f}{'-fine' if o else ''}" for f, o in CASES])
def test_the_same_bits_as_grouped_mm_forward_and_backward(family: str, overrides: dict, one_thread) -> None:
    tokens = torch.randint(3, 40, (8, 12), generator=torch.Generator().manual_seed(0))
    model, logits, grads = _pass(family, overrides, NAME, tokens)
    _, ref_logits, ref_grads = _pass(family, overrides, "grouped_mm", tokens)
    assert torch.equal(logits, ref_logits)
    assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    covered = [_covered(m) for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert covered and all(covered) == (family != "gpt_oss")  # gpt_oss gates on its own: transformers' path


def test_the_same_bits_in_bfloat16(one_thread) -> None:
    """bfloat16 rollouts (`rollout.dtype=bfloat16`) on the fine model: the same bits as `grouped_mm` too."""
    tokens = torch.randint(3, 40, (8, 12), generator=torch.Generator().manual_seed(0))
    runs = []
    for impl in (NAME, "grouped_mm"):
        model = build_model("qwen3_moe", experts_implementation=impl, dtype=torch.bfloat16, **FINE)
        logits = model(tokens).logits
        logits.float().pow(2).mean().backward()
        runs.append((logits, [p.grad for p in model.parameters() if p.grad is not None]))
    (logits, grads), (ref_logits, ref_grads) = runs
    assert torch.equal(logits, ref_logits) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_it_is_the_default_but_for_float64() -> None:
    assert default_experts_implementation(torch.float32) == NAME
    assert default_experts_implementation(torch.float64) == "eager"


def test_a_token_routed_to_one_expert_gets_that_expert_alone(one_thread) -> None:
    """Hand-checkable: every token routed to expert 3 alone with weight 1 gives expert 3's SwiGLU of it."""
    model = build_model("qwen3_moe", experts_implementation=NAME)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    x = torch.randn(5, experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(1))
    index = torch.full((5, 2), 3)
    weights = torch.tensor([[1.0, 0.0]] * 5)
    gate, up = (x @ experts.gate_up_proj[3].T).chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up) @ experts.down_proj[3].T
    # two float32 sums of 64 and 64 products in another order: relative error under 2 x 64 x 2^-24 ~ 8e-6
    torch.testing.assert_close(experts(x, index, weights), expected, rtol=1e-5, atol=1e-7)
