"""Batched sampling with KV cache, recording rollout log-probs and rollout routes (for R3).

Layout shared with the training passes: a teacher-forced pass runs over `inputs = sequences[:, :-1]`
and predicts `targets = sequences[:, 1:]`; every per-token tensor below is (B, S-1) in that frame,
and `routes` are the routes of `inputs` (docs/design.md §2). Prompts are left-padded, so all completions
start at the same column `prompt_len`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from moe_rl.rollout.sampler import GlobalRows, Sampled, position_ids, sample_loop
from moe_rl.routing import RouteRecorder, Routes


@dataclass
class Rollout:
    sequences: Tensor  # (B, S) prompt + completion token ids, pads after EOS
    attention_mask: Tensor  # (B, S) 0 on left pads and after EOS
    response_mask: Tensor  # (B, S-1) bool: target is a completion token (up to and including EOS)
    rollout_logp: Tensor  # (B, S-1) log-prob of each target under the sampling policy (0 off-response)
    routes: Routes | None  # routes of inputs during generation, masked to real tokens
    completions: list[str]
    prompt_len: int

    @property
    def inputs(self) -> Tensor:
        return self.sequences[:, :-1]

    @property
    def token_mask(self) -> Tensor:
        """(B, S-1) bool: inputs that are real tokens (not left pads, not after EOS)."""
        return self.attention_mask[:, :-1].bool()

    @property
    def targets(self) -> Tensor:
        return self.sequences[:, 1:]

    def __len__(self) -> int:
        return self.sequences.shape[0]


def upcast(logits: Tensor) -> Tensor:
    """Logits in the precision log-probs are computed in: float32, or float64 for a float64 model."""
    return logits if logits.dtype == torch.float64 else logits.float()


def token_logp(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log pi(target) per position from (B, T, V) logits of the policy at `temperature`."""
    return torch.log_softmax(upcast(logits) / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the policy's next-token distribution per position (B, T)."""
    logp = torch.log_softmax(upcast(logits) / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    *,
    group_size: int = 1,
    max_new_tokens: int = 8,
    temperature: float = 1.0,
    greedy: bool = False,
    record_routes: bool = True,
    seed: int | None = None,
    rows: GlobalRows | None = None,
    sampler: str = "loop",
) -> Rollout:
    """Sample `group_size` completions per prompt (rows p*G..p*G+G-1 share prompt p).

    One seeded stream (`seed`) serves the whole batch, drawn by `sampler`, one of SAMPLERS: `loop`
    (moe_rl.rollout.sampler.sample_loop, the default) and `generate` (transformers' `model.generate`) draw
    bitwise the same tokens and logits for the same seed. With `rows` (`loop` only) these rows are
    part of a batch split across processes and get the tokens the whole batch would give them, so a
    run draws the same rollouts on any number of processes.
    """
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    device = next(model.parameters()).device
    input_ids = enc["input_ids"].repeat_interleave(group_size, 0).to(device)
    attention_mask = enc["attention_mask"].repeat_interleave(group_size, 0).to(device)
    prompt_len = input_ids.shape[1]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    recorder = RouteRecorder(model) if record_routes else None
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None):  # callers' RNG untouched
        if seed is not None:
            torch.manual_seed(seed)
        with recorder if recorder is not None else nullcontext():
            out = sample(
                model,
                input_ids,
                attention_mask,
                sampler=sampler,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                greedy=greedy,
                eos_token_id=eos,
                pad_token_id=pad,
                rows=rows,
            )
    sequences = out.sequences  # (B, S)
    new_tokens = sequences[:, prompt_len:]  # (B, n)
    # Completion tokens: up to and including the first EOS.
    is_eos = new_tokens == eos
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    completion_mask = ~after_eos  # (B, n)
    full_mask = torch.cat([attention_mask, completion_mask.long()], dim=1)  # (B, S)
    response_mask = torch.zeros_like(sequences[:, 1:], dtype=torch.bool)
    response_mask[:, prompt_len - 1 :] = completion_mask

    logp_dtype = upcast(out.logits[0]).dtype if out.logits else torch.float32
    rollout_logp = torch.zeros(response_mask.shape, dtype=logp_dtype, device=device)
    if out.logits:
        step_logits = torch.stack(out.logits, dim=1)  # (B, n, V): logits that sampled each new token
        rollout_logp[:, prompt_len - 1 :] = token_logp(step_logits, new_tokens, 1.0 if greedy else temperature)
        rollout_logp = rollout_logp * response_mask

    routes = None
    if recorder is not None:
        routes = recorder.routes.with_mask(full_mask[:, :-1].bool())
    texts = tokenizer.batch_decode(torch.where(completion_mask & ~is_eos, new_tokens, pad), skip_special_tokens=True)
    return Rollout(sequences, full_mask, response_mask, rollout_logp, routes, texts, prompt_len)


SAMPLERS = ("loop", "generate")


def sample(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    sampler: str,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    eos_token_id: int,
    pad_token_id: int,
    rows: GlobalRows | None = None,
) -> Sampled:
    """`sequences` and per-step float32 `logits` of `sampler` (one of SAMPLERS) on left-padded prompts."""
    if sampler == "loop":
        return sample_loop(
            model,
            input_ids,
            attention_mask,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            greedy=greedy,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            rows=rows,
        )
    if sampler != "generate":
        raise ValueError(f"unknown sampler {sampler!r}; valid: {list(SAMPLERS)}")
    if rows is not None:
        raise ValueError("a batch split across processes samples with sampler='loop'")
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=temperature if not greedy else None,
        top_k=0 if not greedy else None,
        top_p=1.0 if not greedy else None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return Sampled(out.sequences, tuple(out.logits))


def forward_logp(
    model: PreTrainedModel, rollout: Rollout, rows: slice | Tensor | None = None, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Teacher-forced (logp, logits) of rollout `rows` under `model`; logp is (b, S-1)."""
    rows = slice(None) if rows is None else rows
    inputs = rollout.inputs[rows]
    mask = rollout.attention_mask[rows, :-1]
    logits = model(input_ids=inputs, attention_mask=mask, position_ids=position_ids(mask)).logits
    return token_logp(logits, rollout.targets[rows], temperature), logits


class RouterForward(NamedTuple):
    """A teacher-forced pass with what the router loss terms read (`moe_rl.algos.router_losses`)."""

    logp: Tensor  # (b, S-1)
    logits: Tensor  # (b, S-1, V)
    router_logits: tuple[Tensor, ...] | None  # per MoE layer (b * (S-1), E), batch-major rows
    aux_loss: Tensor | None  # the family's load-balancing loss over the attention mask's tokens (None: it has none)
    mask: Tensor  # (b, S-1) the attention mask of the pass


def forward_logp_router(
    model: PreTrainedModel, rollout: Rollout, rows: slice | Tensor | None = None, *, temperature: float = 1.0
) -> RouterForward:
    """`forward_logp` called with `output_router_logits=True`: also the MoE layers' router logits and the
    load-balancing loss the family's ForCausalLM computes from them, over the tokens of the attention mask."""
    rows = slice(None) if rows is None else rows
    inputs = rollout.inputs[rows]
    mask = rollout.attention_mask[rows, :-1]
    out = model(input_ids=inputs, attention_mask=mask, position_ids=position_ids(mask), output_router_logits=True)
    logp = token_logp(out.logits, rollout.targets[rows], temperature)
    router_logits = out.get("router_logits")
    return RouterForward(logp, out.logits, tuple(router_logits) if router_logits else None, out.get("aux_loss"), mask)
