"""Policy-gradient losses: GRPO (arXiv 2402.03300), GSPO and GSPO-token (arXiv 2507.18071), SAPO
(arXiv 2511.20347), CISPO (arXiv 2506.13585), DPPO's binary TV and KL trust regions (arXiv 2602.04879)
and VESPO (arXiv 2602.10693); and DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556), an
option of every loss.

Every loss is a pure function of tensors with one keyword signature and returns
`(loss, metrics)`: `loss` is a scalar Tensor to call `.backward()` on, `metrics` a dict of floats.

Shared arguments (B sequences, T response positions):
    logp      (B, T)  log pi_theta of the sampled response tokens, with grad
    old_logp  (B, T)  log pi_old of the same tokens (constant)
    adv       (B,)    advantage per sequence (GRPO and GSPO-token also take a (B, T) advantage)
    mask      (B, T)  bool, valid response tokens (ragged lengths)
    ref_logp  (B, T)  optional log pi_ref, for `beta * KL(pi_theta || pi_ref)` with the k3 estimator
    weight    (B, T)  optional constant per-token weight on the policy term (engine-gap corrections:
                      truncated or masked importance weights, `moe_rl.algos.corrections.engine_weight`)
    ratio_scale (B, T) optional constant factor on the token ratio before it is clipped or gated
                      (RSPO's floored router-shift ratio, `moe_rl.routing.compare.router_shift_ratio`);
                      token losses only
Each loss's own hyperparameters (eps_low/eps_high, SAPO's tau_pos/tau_neg, DPPO's kl_tau, VESPO's
k_pos/lambda_pos/k_neg/lambda_neg) follow; their keyword defaults are the paper's values, and the only
copy of them (`Loss.defaults` reads them).
The off-policy sequence mask is not a loss's own argument: calling a `Loss` record with
`offpolicy_mask_delta=delta` (None: off) zeroes the policy term of every sequence with a negative
advantage whose mean log(pi_old / pi_theta) over its valid tokens exceeds delta
(`offpolicy_sequence_mask`), in one place for every loss.
Masked positions never enter a value or a gradient, whatever `logp`, `weight` or `ratio_scale`
hold there (even inf/NaN).
A sequence with no valid token contributes nothing: sequence means run over the non-empty
sequences only, so padding rows do not dilute the loss; an all-empty batch gives loss 0.

Metrics:
    loss/policy          the clipped policy term alone (without the KL term)
    ratio/clipfrac_low   fraction of valid tokens (GSPO: sequences) where the clipped branch is
                         active on the low side: ratio < 1 - eps_low and adv < 0
    ratio/clipfrac_high  same on the high side: ratio > 1 + eps_high and adv > 0
                         (CISPO: tokens whose weight is truncated, whatever the advantage's sign;
                         DPPO: tokens masked because their probability fell (adv < 0) or rose
                         (adv > 0) past the divergence bound; SAPO and VESPO have no clipped branch,
                         so both are 0)
    kl/ref_k3            k3 KL to the reference policy, aggregated like the loss (only with ref_logp)
    loss/offpolicy_seq_masked_frac  fraction of the non-empty sequences the off-policy sequence mask
                         drops (only with offpolicy_mask_delta)
Each metric (and `loss`) is a mean; `metrics.weights` holds its denominator on these rows (valid
tokens or non-empty sequences), so that means over several batches of rows pool exactly.

Registry: `@as_loss(...)` (`moe_rl.algos.loss_record`, with the record and the pieces every loss
shares) turns each loss function into its `Loss` record, which holds everything the harness knows
about the loss (the level of its ratio, what its clip range bounds, whether its policy term is a mean
over sequences, its paper defaults and the range each of its own hyperparameters must lie in); calling
the record runs the shared input checks (and the off-policy sequence mask), then the formula. A token
loss computes its per-token policy term and which tokens took a clipped branch, and ends with
`finish_token_loss` (weight, aggregation, KL term, metrics). `LOSSES` maps each `algo.name` to its record,
and the config checks and the training loop read the record's facts instead of comparing loss names.
Adding a loss is therefore:
    1. its function here or in a module beside it (DPPO and VESPO: `moe_rl.algos.trust_regions`),
       under `@as_loss(...)` with its facts (its own hyperparameters, with the paper's values as
       keyword defaults, follow the shared arguments; `ranges` gives each its `Range`);
    2. its entry in `LOSSES`;
    3. its config group file `experiments/conf/algo/<name>.yaml` (`name: <name>`, plus any setting the
       paper fixes, e.g. CISPO's `agg: token-mean`).
A hyperparameter no loss had before also needs its `AlgoConfig` field (None: the paper default) and, so
that the shipped runs keep their identity, its None in `moe_rl.run.identity.ADDED_DEFAULTS` (a test checks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_rl.algos.loss_record import (
    ABOVE_0,
    AGG_MODES,
    EPS_RANGES,
    SHARED_ARGS,
    Loss,
    LossFn,
    LossMetrics,
    Range,
    add_kl,
    as_floats,
    as_loss,
    clip_fractions,
    finish_token_loss,
    masked_log_ratio,
    offpolicy_sequence_mask,
    ratio_clipped,
    scaled_ratio,
    seq_mean,
    token_adv,
    token_weight,
)
from moe_rl.algos.trust_regions import dppo_kl_loss, dppo_tv_loss, vespo_loss

__all__ = [
    "AGG_MODES",
    "LOSSES",
    "SHARED_ARGS",
    "Loss",
    "LossFn",
    "LossMetrics",
    "Range",
    "cispo_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "get_loss",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "offpolicy_sequence_mask",
    "sapo_loss",
    "vespo_loss",
]


@as_loss(ratio_level="token", clip="ratio", seq_mean_policy=False, ranges=EPS_RANGES)
def grpo_loss(
    *,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
    agg: str = "seq-mean-token-mean",
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    weight: Tensor | None = None,
    ratio_scale: Tensor | None = None,
) -> tuple[Tensor, LossMetrics]:
    """GRPO (arXiv 2402.03300) with the token ratio clipped asymmetrically (GSPO paper's eps 0.2/0.27).

    loss = agg_{i,t} -min(r_{i,t} A_i, clip(r_{i,t}, 1-eps_low, 1+eps_high) A_i) + beta * agg k3,
    r_{i,t} = pi_theta(y_{i,t}) / pi_old(y_{i,t}) (times `ratio_scale`), each term times `weight`.
    agg "seq-mean-token-mean" is the paper's mean_i (1/|y_i|) sum_t; "token-mean" is
    sum_{i,t} / sum_i |y_i| (DAPO-style).
    """
    adv = token_adv(adv, logp)  # (B, T)
    ratio = torch.exp(masked_log_ratio(logp, old_logp, mask))  # r = exp(logp - old_logp), (B, T)
    ratio = scaled_ratio(ratio, ratio_scale, mask)
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # -min(r A, clip(r) A)
    low, high = ratio_clipped(ratio, adv, mask, eps_low, eps_high)
    return finish_token_loss(
        pg_loss, low=low, high=high, logp=logp, mask=mask, weight=weight, ref_logp=ref_logp, beta=beta, agg=agg
    )


def _seq_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Length-normalised sequence log-ratio (1/|y_i|) sum_t log(pi_theta/pi_old), and |y_i| > 0."""
    seq_len = mask.sum(dim=-1)  # (B,)
    return masked_log_ratio(logp, old_logp, mask).sum(dim=-1) / seq_len.clamp(min=1), seq_len > 0


@as_loss(ratio_level="sequence", clip="ratio", seq_mean_policy=True, ranges=EPS_RANGES)
def gspo_loss(
    *,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    agg: str = "seq-mean-token-mean",
    weight: Tensor | None = None,
    ratio_scale: Tensor | None = None,
) -> tuple[Tensor, LossMetrics]:
    """GSPO (arXiv 2507.18071): one length-normalised ratio per sequence, clipped as a whole.

    s_i  = exp((1/|y_i|) sum_t log(pi_theta(y_{i,t}) / pi_old(y_{i,t})))
    loss = mean_i -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i) + beta * agg k3.
    The policy term is always a mean over sequences; `agg` only reduces the per-token KL term.
    Clip fractions count sequences. `adv` must be (B,). A `weight` multiplies each sequence's term
    by its mean over the sequence's valid tokens (exact for a sequence-level weight, which is constant
    along the sequence); `ratio_scale` is refused: the router-shift reweighting is per token.
    """
    adv = adv.detach().to(logp.dtype)
    seq_log_ratio, valid = _seq_log_ratio(logp, old_logp, mask)
    seq_ratio = torch.exp(seq_log_ratio)  # s_i, (B,)
    pg_loss1 = -adv * seq_ratio
    pg_loss2 = -adv * torch.clamp(seq_ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # -min(s A, clip(s) A), (B,)
    w = token_weight(weight, mask, pg_loss)
    if w is not None:
        pg_loss = pg_loss * (w.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1))  # mean weight of each sequence
    loss, metrics = add_kl(seq_mean(pg_loss, valid), logp=logp, ref_logp=ref_logp, mask=mask, beta=beta, agg=agg)
    low, high = ratio_clipped(seq_ratio, adv, valid, eps_low, eps_high)  # (B,)
    metrics.update(clip_fractions(low, high, valid))
    clipped = (low | high)[:, None] & mask  # (B, T): the tokens of the clipped sequences
    return loss, as_floats(metrics, policy=valid.sum(), clip=valid.sum(), mask=mask, agg=agg, clipped=clipped)


@as_loss(ratio_level="token", clip="ratio", seq_mean_policy=True, ranges=EPS_RANGES)
def gspo_token_loss(
    *,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    agg: str = "seq-mean-token-mean",
    weight: Tensor | None = None,
    ratio_scale: Tensor | None = None,
) -> tuple[Tensor, LossMetrics]:
    """GSPO-token (arXiv 2507.18071): GSPO with a per-token advantage A_{i,t}.

    s_{i,t} = sg[s_i] * pi_theta(y_{i,t}) / sg[pi_theta(y_{i,t})]   (value s_i, gradient of token t)
    loss    = mean_i (1/|y_i|) sum_t -min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1-eps_low, 1+eps_high) A_{i,t})
              + beta * agg k3.
    Equal to `gspo_loss` in value and gradient when A_{i,t} = A_i. The policy term is always
    seq-mean-token-mean; `agg` only reduces the KL term. Clip fractions count tokens.
    `adv` may be (B,) or (B, T). `ratio_scale` multiplies s_{i,t}, `weight` each token's term.
    """
    adv = token_adv(adv, logp)  # (B, T)
    seq_log_ratio, _ = _seq_log_ratio(logp, old_logp, mask)
    seq_ratio = torch.exp(seq_log_ratio).detach()  # sg[s_i], (B,)
    live_logp = torch.where(mask, logp, torch.zeros_like(logp))
    ratio = seq_ratio[:, None] * torch.exp(live_logp - live_logp.detach())  # s_{i,t}, (B, T)
    ratio = scaled_ratio(ratio, ratio_scale, mask)
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # -min(s_t A_t, clip(s_t) A_t)
    low, high = ratio_clipped(ratio, adv, mask, eps_low, eps_high)
    return finish_token_loss(
        pg_loss,
        low=low,
        high=high,
        policy_agg="seq-mean-token-mean",
        logp=logp,
        mask=mask,
        weight=weight,
        ref_logp=ref_logp,
        beta=beta,
        agg=agg,
    )


@as_loss(ratio_level="token", clip=None, seq_mean_policy=False, ranges={"tau_pos": ABOVE_0, "tau_neg": ABOVE_0})
def sapo_loss(
    *,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    agg: str = "seq-mean-token-mean",
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    weight: Tensor | None = None,
    ratio_scale: Tensor | None = None,
) -> tuple[Tensor, LossMetrics]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): a sigmoid gate on the token ratio
    instead of a hard clip, with a temperature per advantage sign.

    f_{i,t}(r) = sigma(tau_{i,t} (r - 1)) * 4 / tau_{i,t},  tau_{i,t} = tau_pos if A_{i,t} > 0 else tau_neg
    loss       = agg_{i,t} -f_{i,t}(r_{i,t}) A_{i,t} + beta * agg k3,
    so d loss / d logp = -A * 4 sigma (1 - sigma) * r: the 4/tau normalisation makes the gradient at
    r = 1 the plain policy gradient (weight 1), and it decays smoothly as r leaves 1, faster for the
    larger tau_neg. Paper defaults tau_pos 1.0, tau_neg 1.05 (the same in Trinity-RFT's SAPO, read to
    confirm the gate and defaults; it back-propagates through sg[f] * logp instead, which has another
    gradient, so this follows the paper's objective). Both clip fractions are 0: there is no clipped
    branch.
    """
    adv = token_adv(adv, logp)  # (B, T)
    ratio = scaled_ratio(torch.exp(masked_log_ratio(logp, old_logp, mask)), ratio_scale, mask)  # (B, T)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # f(r)
    never = torch.zeros_like(mask, dtype=torch.bool)  # the gate never clips
    return finish_token_loss(
        -gate * adv, low=never, high=never, logp=logp, mask=mask, weight=weight, ref_logp=ref_logp, beta=beta, agg=agg
    )


@as_loss(ratio_level="token", clip="weight", seq_mean_policy=False, ranges=EPS_RANGES)
def cispo_loss(
    *,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    agg: str = "seq-mean-token-mean",
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    weight: Tensor | None = None,
    ratio_scale: Tensor | None = None,
) -> tuple[Tensor, LossMetrics]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, never a token's gradient.

    J = agg_{i,t} sg[clip(r_{i,t}, 1-eps_low, 1+eps_high)] A_{i,t} log pi_theta(y_{i,t})
    Every valid token keeps its gradient -sg[w] A d logp, also where r is outside the range (GRPO's
    min() zeroes it there). The loss is computed as -sg[w] A pi_theta / sg[pi_theta]: the paper's
    gradient, with the value -w A (the truncated-IS surrogate) instead of one that depends on logp.
    The paper sets no lower bound (eps_low large: here 1.0, a bound at 0) and tunes eps_high; 0.28 is
    Trinity-RFT's default (read to confirm the formula). The paper aggregates by token-mean (the
    config group sets it). Clip fractions count tokens whose weight is truncated below / above.
    """
    adv = token_adv(adv, logp)  # (B, T)
    ratio = scaled_ratio(torch.exp(masked_log_ratio(logp, old_logp, mask)), ratio_scale, mask).detach()  # (B, T)
    is_weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # sg[clip(r)]
    live_logp = torch.where(mask, logp, torch.zeros_like(logp))
    pg_loss = -adv * is_weight * torch.exp(live_logp - live_logp.detach())  # value -w A, grad -w A d logp
    # the tokens whose weight is truncated (their gradient is kept, scaled)
    low, high = (ratio < 1.0 - eps_low) & mask, (ratio > 1.0 + eps_high) & mask
    return finish_token_loss(
        pg_loss, low=low, high=high, logp=logp, mask=mask, weight=weight, ref_logp=ref_logp, beta=beta, agg=agg
    )


# Each `algo.name` and its loss (the order `docs/config.md` lists them in).
LOSSES: dict[str, Loss] = {
    "grpo": grpo_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "sapo": sapo_loss,
    "cispo": cispo_loss,
    "dppo_tv": dppo_tv_loss,
    "dppo_kl": dppo_kl_loss,
    "vespo": vespo_loss,
}


def get_loss(name: str) -> Loss:
    """The loss registered under `name`; a ValueError lists the valid names."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid: {', '.join(sorted(LOSSES))}")
    return LOSSES[name]
