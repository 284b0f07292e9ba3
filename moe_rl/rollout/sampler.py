"""A lean KV-cache sampling loop: `model.generate`'s sampling, without its per-token machinery.

For a tiny model, `generate` spends a large share of each decode step outside the forward:
`prepare_inputs_for_generation`, `_update_model_kwargs_for_generation`, logits processors and
stopping criteria, a GenerationConfig per call. This loop does only the work that decides the
tokens, in the same order and with the same calls, so that for the same RNG state it draws
bitwise the same tokens from bitwise the same logits (tests/test_sampler.py holds it to that on
several families, seeds, temperatures and dtypes):

- prefill with a `DynamicCache(config=...)`, positions that skip left pads, `logits_to_keep=1`;
- per step: float32 copy of the last logits, `/ temperature` when it is not 1 (TemperatureLogitsWarper),
  `softmax` + `multinomial(probs, 1)` (or `argmax` when greedy), finished rows forced to pad;
- stop once every row emitted EOS or `max_new_tokens` were sampled; the decode calls extend the
  attention mask with ones and the positions by one, as `generate` does.

The loop runs in inference mode (no autograd state per op: the same kernels and numbers as under no_grad, in
about 0.93x the time at the default model; no_grad for FSDP2's sharded parameters) and returns copies made outside
it, so a loss may save them for backward.

Forward hooks (RouteRecorder) see the same calls as under `generate`: one prefill pass, then one
KV-cache continuation per new token but the last.

A batch split across processes (`GlobalRows`) samples as the whole batch would in one process: each
process draws the multinomial of the whole batch's shape from the same seeded stream and keeps its
own rows (the draw of a row depends on its own probabilities and its place in the batch only), and
every process decodes until every row of every process has ended. So a run draws the same tokens on
any number of processes, and in a world of size 1 this is exactly the one-process loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel


@dataclass
class Sampled:
    sequences: Tensor  # (B, S) prompt + sampled tokens
    logits: tuple[Tensor, ...]  # per new token: (B, V) float32 logits that sampled it, as generate's output_logits


@dataclass(frozen=True)
class GlobalRows:
    """This process's rows [first, first + B) of a batch of `total` rows sampled by several processes;
    `any_running(flag)` is True when `flag` is True on some process (a collective in a process group)."""

    first: int
    total: int
    any_running: Callable[[bool], bool]


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left pads, as `generate` assigns them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def draw(probs: Tensor, rows: GlobalRows | None = None) -> Tensor:
    """One token per row of (B, V) `probs` by `torch.multinomial`; with `rows`, the tokens these rows get
    in the multinomial of the whole (total, V) batch, whatever the other rows hold."""
    if rows is None or rows.total == probs.shape[0]:
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    full = probs.new_ones(rows.total, probs.shape[1])  # other processes' rows: only their draws matter here
    full[rows.first : rows.first + probs.shape[0]] = probs
    return torch.multinomial(full, num_samples=1).squeeze(1)[rows.first : rows.first + probs.shape[0]]


def _cache_kwarg(model: PreTrainedModel) -> str:
    """The forward's name for the KV cache (`cache` in later v5 releases, `past_key_values` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _without_autograd(model: PreTrainedModel) -> AbstractContextManager:
    """Inference mode, or no_grad where FSDP2 shards the parameters (DTensors): it unshards them into buffers it
    updates in place outside the pass, which inference mode refuses."""
    sharded = any(hasattr(p, "full_tensor") for p in model.parameters())
    return torch.no_grad() if sharded else torch.inference_mode()


def sample_loop(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
    rows: GlobalRows | None = None,
) -> Sampled:
    """Sample up to `max_new_tokens` per row of left-padded `input_ids`, as `model.generate(do_sample=
    not greedy, temperature, top_k=0, top_p=1.0)` would for the same RNG state; with `rows`, as the
    whole batch of which these are the rows would be sampled in one process."""
    B = input_ids.shape[0]
    with _without_autograd(model):  # its tensors never leave it: the results are copied out below
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        key = _cache_kwarg(model)
        positions = position_ids(attention_mask)  # (B, P): skips left pads
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            return_dict=True,
            **{key: cache},
        )
        next_position = positions[:, -1:] + 1  # (B, 1)
        unfinished = torch.ones(B, dtype=torch.long, device=input_ids.device)
        pad = torch.tensor(pad_token_id, device=input_ids.device)
        tokens = [input_ids]
        logits: list[Tensor] = []
        logits_dtype = torch.float64 if out.logits.dtype == torch.float64 else torch.float32  # float32 but for float64
        # On accelerators `generate` decodes with `batched_mm` experts; keep its choice for equal outputs.
        decode_context = getattr(model, "_optimize_model_for_decode", None)
        with decode_context() if decode_context is not None else nullcontext():
            for i in range(max_new_tokens):
                step_logits = out.logits[:, -1].to(copy=True, dtype=logits_dtype)  # (B, V)
                logits.append(step_logits)
                if greedy:
                    token = torch.argmax(step_logits, dim=-1)
                else:
                    scores = step_logits / temperature if temperature != 1.0 else step_logits
                    token = draw(torch.softmax(scores, dim=-1), rows)
                token = token * unfinished + pad * (1 - unfinished)
                tokens.append(token[:, None])
                unfinished = unfinished & (token != eos_token_id).long()
                running = bool(unfinished.any())
                if i + 1 == max_new_tokens or not (running if rows is None else rows.any_running(running)):
                    break
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((B, 1))], dim=-1)
                out = model(
                    input_ids=token[:, None],
                    attention_mask=attention_mask,
                    position_ids=next_position,
                    use_cache=True,
                    logits_to_keep=1,
                    return_dict=True,
                    **{key: cache},
                )
                next_position = next_position + 1
    # normal tensors outside inference mode (a loss may save them for backward)
    return Sampled(torch.cat(tokens, dim=1), tuple(x.clone() for x in logits))
