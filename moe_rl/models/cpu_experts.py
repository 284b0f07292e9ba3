"""`grouped_mm_cpu`: transformers' `grouped_mm` experts forward with its row gathers made cheap on CPU, bit for bit
the same arithmetic.

transformers' `grouped_mm` sorts the (token, slot) pairs by expert, gathers their hidden states, runs one grouped
GEMM up and one down, weights each row by its gate and scatters the rows back. On CPU its row gathers, advanced
indexing (`x[perm]`, `aten::index`), cost more than its GEMMs on a model of many small experts (64 of width 16 at
top-8: 8192 rows a pass of 1024 tokens): `index_select` gathers the same rows about 8x faster. This forward does the
same operations in the same order with `index_select` (and the gradient of the gather that repeats each token k
times accumulated as autograd accumulates advanced indexing's); every value it computes, forward and backward, equals
`grouped_mm`'s bit for bit (tests/test_cpu_experts.py), so runs keep their numerics domain. (The gate's activation
on its strided half of the up projection is about 4x slower than on a contiguous copy too, but for experts narrower
than the vector width the two differ in the last bit: left as it is.)
It covers the experts transformers builds for the families here with a gate and no bias, transposition, expert
parallelism, post-expert norm or gating of its own, on CPU; any other experts module takes transformers' own
`grouped_mm`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    _default_apply_gate,
    _grouped_linear,
    grouped_mm_experts_forward,
)

NAME = "grouped_mm_cpu"


def _covered(experts: torch.nn.Module) -> bool:
    return (
        getattr(experts, "has_gate", False)
        and not getattr(experts, "has_bias", True)
        and not getattr(experts, "is_transposed", True)
        and not getattr(experts, "_is_expert_parallel", True)
        and not getattr(experts, "has_post_expert_norm", True)
        and getattr(experts, "is_concatenated", False)
        and getattr(type(experts), "_apply_gate", None) is _default_apply_gate
        and experts.gate_up_proj.device.type == "cpu"
    )


class _Rows(torch.autograd.Function):
    """`x[index]` for a 1-d `index` of rows: gathered by `index_select`, its gradient accumulated as autograd
    accumulates advanced indexing's (`index_put_` with `accumulate=True`), so repeated rows sum in the same order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.shape = x.shape
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).index_put_((index,), grad, accumulate=True), None


def grouped_mm_cpu_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output for `hidden_states` (tokens, hidden) routed to `top_k_index` with `top_k_weights`."""
    if not _covered(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    experts: Any = self  # transformers' experts module: its weights, activation and expert count
    k = top_k_index.size(-1)
    tokens, hidden = hidden_states.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))  # the (token, slot) pairs grouped by expert
    rows = _Rows.apply(hidden_states, perm // k)  # each token k times: its gradient sums them
    weights = top_k_weights.reshape(-1).index_select(0, perm)
    counts = torch.histc(expert_ids.float(), bins=experts.num_experts, min=0, max=experts.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate, up = _grouped_linear(rows, experts.gate_up_proj, offsets).chunk(2, dim=-1)
    out = _grouped_linear(experts.act_fn(gate) * up, experts.down_proj, offsets) * weights.unsqueeze(-1)
    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.size(0), device=perm.device)
    return out.index_select(0, back).view(tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(NAME, grouped_mm_cpu_experts_forward)
