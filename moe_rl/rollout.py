"""Batched sampling with KV cache, recording rollout log-probs and rollout routes (for R3).

Layout shared with the training passes: a teacher-forced pass runs over `inputs = sequences[:, :-1]`
and predicts `targets = sequences[:, 1:]`; every per-token tensor below is (B, S-1) in that frame,
and `routes` are the routes of `inputs` (docs/design.md §2). Prompts are left-padded, so all completions
start at the same column `prompt_len`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    StoppingCriteria,
    StoppingCriteriaList,
)

from moe_rl.routing import RouteRecorder, Routes
from moe_rl.sampler import Sampled, sample_loop


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


def token_logp(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log pi(target) per position from (B, T, V) logits of the policy at `temperature`."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the policy's next-token distribution per position (B, T)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left pads, as `generate` assigns them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class RowSampler(LogitsProcessor):
    """Sample every row from its own stream of uniforms by inverting the CDF of softmax(logits / T).

    Row i's token at decode step t is the first token whose cumulative probability exceeds u[i, t], so
    a row's completion depends on its own logits and uniforms only, not on which rows share the batch
    (`torch.multinomial` over the batch draws one stream for all rows). Returns scores that are 0 at
    the sampled token and -inf elsewhere, for `generate`'s greedy step to pick.
    A row that has produced `eos` gets `pad` from then on (what `generate` does with its own EOS handling,
    which `RowEos` replaces).
    """

    def __init__(self, uniforms: Tensor, temperature: float, prompt_len: int, eos: int, pad: int) -> None:
        self.uniforms, self.temperature, self.prompt_len = uniforms, temperature, prompt_len  # (B, n) float64
        self.eos, self.pad = eos, pad

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        t = input_ids.shape[1] - self.prompt_len
        cdf = torch.softmax(scores.double() / self.temperature, dim=-1).cumsum(-1)  # (B, V)
        u = self.uniforms[:, t : t + 1].to(cdf.device) * cdf[:, -1:]
        token = torch.searchsorted(cdf, u, right=True).clamp(max=scores.shape[-1] - 1)  # (B, 1)
        finished = (input_ids[:, self.prompt_len :] == self.eos).any(-1, keepdim=True)
        token = torch.where(finished, self.pad, token)
        return torch.full_like(scores, -torch.inf).scatter_(1, token, 0.0)


class RowEos(StoppingCriteria):
    """Stop once every row has produced EOS, on every rank of a process group when one is running.

    Ranks then run the same number of decode passes (the collectives of a sharded model stay paired) and
    the batch has the width one process would give the global batch: a row's EOS is fed back to the
    model, and gets a route, exactly when some row of the global batch is still running.
    """

    def __init__(self, eos: int, prompt_len: int) -> None:
        self.eos, self.prompt_len = eos, prompt_len

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: object) -> Tensor:
        done = (input_ids[:, self.prompt_len :] == self.eos).any(-1).all().reshape(1).long()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN)
        return done.bool().expand(input_ids.shape[0]).clone()


def row_uniforms(row_keys: Sequence[Sequence[int]], n: int) -> Tensor:
    """(B, n) float64 uniforms, row i from numpy's PCG64 seeded with `row_keys[i]` (e.g. (seed, step, row))."""
    return torch.from_numpy(np.stack([np.random.default_rng(list(key)).random(n) for key in row_keys]))


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
    row_keys: Sequence[Sequence[int]] | None = None,
    sampler: str = "loop",
) -> Rollout:
    """Sample `group_size` completions per prompt (rows p*G..p*G+G-1 share prompt p).

    With `row_keys` (one key per row, e.g. (seed, step, global row)) every row samples from its own
    stream (`RowSampler`, through `model.generate`), so a row's completion does not depend on the
    other rows in the batch; this is how a run split across ranks draws the same rollouts on any
    number of ranks. Without it one seeded stream serves the whole batch (`seed`), drawn by
    `sampler`, one of SAMPLERS: `loop` (moe_rl.sampler.sample_loop, the default) and `generate`
    (transformers' `model.generate`) draw bitwise the same tokens and logits for the same seed.
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
        do_sample = not greedy and row_keys is None
        processors = stopping = None
        gen_eos = eos
        if row_keys is not None and not greedy:  # per-row streams; EOS handled by RowSampler and RowEos
            if len(row_keys) != input_ids.shape[0]:
                raise ValueError(f"{len(row_keys)} row_keys for {input_ids.shape[0]} rows")
            uniforms = row_uniforms(row_keys, max_new_tokens)
            processors = LogitsProcessorList([RowSampler(uniforms, temperature, prompt_len, eos, pad)])
            stopping, gen_eos = StoppingCriteriaList([RowEos(eos, prompt_len)]), None
        with recorder if recorder is not None else nullcontext():
            if row_keys is None:
                out = sample(model, input_ids, attention_mask, sampler=sampler, max_new_tokens=max_new_tokens,
                             temperature=temperature, greedy=greedy, eos_token_id=eos, pad_token_id=pad)
            else:
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    max_new_tokens=max_new_tokens,
                    do_sample=do_sample,
                    temperature=temperature if do_sample else None,
                    top_k=0 if do_sample else None,
                    top_p=1.0 if do_sample else None,
                    logits_processor=processors,
                    stopping_criteria=stopping,
                    eos_token_id=gen_eos,
                    pad_token_id=pad,
                    return_dict_in_generate=True,
                    output_logits=True,
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

    rollout_logp = torch.zeros(response_mask.shape, dtype=torch.float32, device=device)
    if out.logits:
        step_logits = torch.stack(out.logits, dim=1)  # (B, n, V): logits that sampled each new token
        rollout_logp[:, prompt_len - 1 :] = token_logp(step_logits, new_tokens, 1.0 if greedy else temperature)
        rollout_logp = rollout_logp * response_mask

    routes = None
    if recorder is not None:
        routes = recorder.routes
        if routes.shape[1] > sequences.shape[1] - 1:  # decode passes run after this rank finished (FSDP's
            # synced generation keeps every rank calling the model until all are done): not part of the rollout
            width = sequences.shape[1] - 1
            routes = Routes(routes.indices[:, :width], routes.mask[:, :width], routes.layer_map, routes.num_experts)
        routes = routes.with_mask(full_mask[:, :-1].bool())
    texts = tokenizer.batch_decode(torch.where(completion_mask & ~is_eos, new_tokens, pad), skip_special_tokens=True)
    return Rollout(sequences, full_mask, response_mask, rollout_logp, routes, texts, prompt_len)


SAMPLERS = ("loop", "generate")


def sample(
    model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, *, sampler: str, max_new_tokens: int,
    temperature: float, greedy: bool, eos_token_id: int, pad_token_id: int,
) -> Sampled:
    """`sequences` and per-step float32 `logits` of `sampler` (one of SAMPLERS) on left-padded prompts."""
    if sampler == "loop":
        return sample_loop(model, input_ids, attention_mask, max_new_tokens=max_new_tokens, temperature=temperature,
                           greedy=greedy, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if sampler != "generate":
        raise ValueError(f"unknown sampler {sampler!r}; valid: {list(SAMPLERS)}")
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
