"""Evaluation on the held-out split: greedy accuracy, and pass@k with the unbiased estimator.

Both score batches of completions with one loop (`scored_batches`). Greedy accuracy
(`task/accuracy`) says what the policy's most likely answer is worth; pass@k says
how often at least one of k samples is right, the quantity RL with verifiable rewards is said to
sharpen or narrow. From n >= k samples per prompt with c correct, the unbiased estimator is
`1 - C(n-c, k) / C(n, k)` (Chen et al. 2021, arXiv 2107.03374), averaged over prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from moe_rl.metrics.names import TASK_ACCURACY, pass_at_key
from moe_rl.rollout.generate import Rollout, forward_logp, generate, token_entropy
from moe_rl.tasks.setup import RLTask


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from `n` samples of which `c` are correct.

    `1 - C(n-c, k) / C(n, k)` computed as `1 - prod_{i=n-c+1}^{n} (1 - k/i)`, which stays exact
    in floating point where the binomials overflow.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def sampled_batches(
    model: Any,
    tokenizer: Any,
    examples: list[dict[str, Any]],
    *,
    batch_size: int,
    n: int = 1,
    seed: int | None = None,
    **sampling: Any,
) -> Iterator[tuple[list[dict[str, Any]], Rollout]]:
    """(examples, rollout) per batch of `batch_size` examples, `n` completions per example (rows of one
    example adjacent). `sampling`: `generate`'s `greedy` or `temperature`, and `max_new_tokens`; with `seed`,
    batch i of a seeded stream draws with `seed * 1_000_003 + i`."""
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        out = generate(
            model,
            tokenizer,
            [e["prompt"] for e in chunk],
            group_size=n,
            record_routes=False,
            seed=None if seed is None else seed * 1_000_003 + i,
            **sampling,
        )
        yield chunk, out


def scored_batches(
    model: Any,
    tokenizer: Any,
    examples: list[dict[str, Any]],
    task: RLTask,
    *,
    batch_size: int,
    n: int = 1,
    seed: int | None = None,
    **sampling: Any,
) -> Iterator[list[float]]:
    """The task's rewards of `n` completions per example (`sampled_batches`), one list per batch."""
    for chunk, out in sampled_batches(model, tokenizer, examples, batch_size=batch_size, n=n, seed=seed, **sampling):
        yield task.score(out.completions, [e for e in chunk for _ in range(n)]).rewards


def greedy_accuracy(
    model: Any,
    tokenizer: Any,
    examples: list[dict[str, Any]],
    task: RLTask,
    *,
    max_new_tokens: int,
    batch_size: int = 256,
) -> float:
    """Greedy accuracy (fraction of completions with reward 1.0) on `examples`."""
    rewards = [
        r
        for batch in scored_batches(
            model, tokenizer, examples, task, batch_size=batch_size, greedy=True, max_new_tokens=max_new_tokens
        )
        for r in batch
    ]
    return sum(r == 1.0 for r in rewards) / max(len(rewards), 1)


def sampled_reward_entropy(
    model: Any,
    tokenizer: Any,
    examples: list[dict[str, Any]],
    task: RLTask,
    *,
    n: int,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 64,
) -> tuple[float, float]:
    """What GRPO's first rollouts would see: the mean reward of `n` temperature-1 samples per example and
    the mean entropy (nats) of the policy at the sampled response tokens, from a seeded stream of their own."""
    rewards, entropy = _sampled_rewards_entropy(
        model, tokenizer, examples, task, n=n, max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size
    )
    return float(np.mean(rewards)), entropy


def _sampled_rewards_entropy(
    model: Any,
    tokenizer: Any,
    examples: list[dict[str, Any]],
    task: RLTask,
    *,
    n: int,
    max_new_tokens: int,
    seed: int,
    batch_size: int,
) -> tuple[list[float], float]:
    """The rewards of `n` temperature-1 samples per example (those of one example adjacent) and the mean
    entropy (nats) at the sampled response tokens."""
    rewards: list[float] = []
    entropy, tokens = 0.0, 0
    batches = sampled_batches(
        model,
        tokenizer,
        examples,
        batch_size=batch_size,
        n=n,
        seed=seed,
        temperature=1.0,
        max_new_tokens=max_new_tokens,
    )
    for chunk, out in batches:
        rewards += task.score(out.completions, [e for e in chunk for _ in range(n)]).rewards
        with torch.no_grad():
            _, logits = forward_logp(model, out)
        mask = out.response_mask
        entropy += float((token_entropy(logits) * mask).sum())
        tokens += int(mask.sum())
    return rewards, entropy / max(tokens, 1)


def start_covariates(
    model: Any,
    tokenizer: Any,
    examples: list[dict[str, Any]],
    task: RLTask,
    *,
    n: int,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 64,
) -> dict[str, Any]:
    """What a policy starts RL from, on the held-out `examples`: greedy accuracy, the mean reward and entropy
    (nats) of `n` temperature-1 samples per example (`sampled_reward_entropy`'s stream), and the pass-rate
    histogram: `pass_counts[c]` examples with c of their n samples correct (c = 0 and c = n: no GRPO signal)."""
    accuracy = greedy_accuracy(model, tokenizer, examples, task, max_new_tokens=max_new_tokens)
    rewards, entropy = _sampled_rewards_entropy(
        model, tokenizer, examples, task, n=n, max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size
    )
    counts = [0] * (n + 1)
    for j in range(0, len(rewards), n):
        counts[sum(r == 1.0 for r in rewards[j : j + n])] += 1
    return {
        "greedy_accuracy": accuracy,
        "sampled_reward": float(np.mean(rewards)),
        "sampled_entropy": entropy,
        "pass_counts": counts,
        "samples": n,
    }


def pass_at_k_eval(
    model: Any,
    tokenizer: Any,
    examples: list[dict[str, Any]],
    task: RLTask,
    *,
    ks: list[int],
    n: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    batch_rows: int = 512,
) -> dict[str, float]:
    """`eval/pass@{k}` for each k in `ks`: `n` samples per example at `temperature`, scored by the task.

    Samples come from their own seeded stream (`seed`), so the training RNG is untouched and every
    evaluation of a run draws with the same random numbers (differences between evaluations come
    from the policy, not from the draw).
    """
    correct: list[int] = []
    batches = scored_batches(
        model,
        tokenizer,
        examples,
        task,
        batch_size=max(1, batch_rows // n),
        n=n,
        seed=seed,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
    )
    for rewards in batches:
        correct += [sum(r == 1.0 for r in rewards[j : j + n]) for j in range(0, len(rewards), n)]
    return {pass_at_key(k): float(np.mean([pass_at_k(n, c, k) for c in correct])) for k in ks}


def held_out_metrics(
    model: Any,
    tokenizer: Any,
    examples: list[dict[str, Any]],
    task: RLTask,
    *,
    max_new_tokens: int,
    ks: list[int],
    n: int,
    temperature: float,
    seed: int,
) -> dict[str, float]:
    """`task/accuracy` (greedy), and `eval/pass@{k}` for each k in `ks` (none: no sampled evaluation)."""
    accuracy = greedy_accuracy(model, tokenizer, examples, task, max_new_tokens=max_new_tokens)
    sampled = (
        pass_at_k_eval(
            model,
            tokenizer,
            examples,
            task,
            ks=ks,
            n=n,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=seed,
        )
        if ks
        else {}
    )
    return {TASK_ACCURACY: accuracy, **sampled}
