"""Trust regions beyond the ratio clip, as losses: DPPO's binary TV and binary KL trust regions (arXiv
2602.04879), which bound how far a token's probability moves instead of its ratio, and VESPO (arXiv
2602.10693), a smooth kernel of the whole sequence's importance ratio. Registered in
`moe_rl.algos.losses.LOSSES`; the shared arguments and metrics are those of `moe_rl.algos.losses`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from moe_rl.algos.loss_record import (
    ABOVE_0,
    AT_LEAST_0,
    EPS_RANGES,
    LossMetrics,
    aggregate,
    as_loss,
    finish_token_loss,
    masked_log_ratio,
    scaled_ratio,
    token_adv,
)

DPPO_RANGES = {**EPS_RANGES, "kl_tau": AT_LEAST_0}  # eps_low / eps_high bound a divergence here


def _binary_kl(old_logp: Tensor, logp: Tensor) -> Tensor:
    """KL(Bern(p_old) || Bern(p)) of the sampled token against the rest of the vocabulary:
    p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)), from log-probs (<= 0; xlogy's 0 log 0 = 0,
    so a token at probability 1 on both sides gives 0)."""
    p_old, rest_old, rest = old_logp.exp(), -torch.expm1(old_logp), -torch.expm1(logp)
    return p_old * (old_logp - logp) + torch.xlogy(rest_old, rest_old) - torch.xlogy(rest_old, rest)


def _dppo(
    *,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    kl_tau: float,
    agg: str,
    ref_logp: Tensor | None,
    beta: float,
    weight: Tensor | None,
    ratio_scale: Tensor | None,
    divergence: Literal["tv", "kl"],
) -> tuple[Tensor, LossMetrics]:
    """DPPO's masked surrogate with the binary TV or binary KL trust region (see `dppo_tv_loss`)."""
    adv = token_adv(adv, logp)  # (B, T)
    log_ratio = masked_log_ratio(logp, old_logp, mask)  # log r, 0 at masked positions, with grad
    ratio = scaled_ratio(torch.exp(log_ratio), ratio_scale, mask)
    with torch.no_grad():  # the trust region reads the two policies' probabilities of the sampled token
        new = torch.where(mask, logp.detach(), torch.zeros_like(logp))
        old = torch.where(mask, old_logp.detach().to(logp.dtype), torch.zeros_like(logp))
        if divergence == "tv":
            moved = new.exp() - old.exp()  # pi - pi_old: the binary TV, signed
            up, down = moved > eps_high, moved < -eps_low
        else:
            kl = _binary_kl(old, new)
            up, down = (new > old) & (kl > eps_high), (new < old) & (kl > eps_low)
        high = up & (adv > 0) & mask  # pushed up and already risen past the bound
        low = down & (adv < 0) & mask  # pushed down and already fallen past it
        keep = ~(high | low)
    pg_loss = torch.where(keep, -adv * ratio, torch.zeros_like(ratio))  # -M r A
    # the masked tokens (no policy gradient) are the clipped ones
    loss, metrics = finish_token_loss(
        pg_loss, low=low, high=high, logp=logp, mask=mask, weight=weight, ref_logp=ref_logp, beta=beta, agg=agg
    )
    if kl_tau:  # outside loss/policy
        loss = loss + kl_tau * aggregate(log_ratio.square(), mask, agg)  # every valid token, masked or not
    return loss, metrics


@as_loss(ratio_level="token", clip="divergence", seq_mean_policy=False, ranges=DPPO_RANGES)
def dppo_tv_loss(
    *,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float = 0.15,
    eps_high: float = 0.15,
    kl_tau: float = 0.0,
    agg: str = "seq-mean-token-mean",
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    weight: Tensor | None = None,
    ratio_scale: Tensor | None = None,
) -> tuple[Tensor, LossMetrics]:
    """DPPO-Binary-TV (Divergence PPO, arXiv 2602.04879): a trust region on how far the sampled token's
    probability moved, instead of on its ratio.

    M_{i,t} = 0 if A_{i,t} > 0 and pi_theta(y_{i,t}) - pi_old(y_{i,t}) > eps_high,
              or A_{i,t} < 0 and pi_theta(y_{i,t}) - pi_old(y_{i,t}) < -eps_low;  1 otherwise
    loss    = agg_{i,t} -M_{i,t} r_{i,t} A_{i,t} + kl_tau * agg_{i,t} (log r_{i,t})^2 + beta * agg k3,
    so d loss / d logp = -M r A (+ 2 kl_tau log r): a token keeps its full importance-weighted gradient until
    |pi - pi_old|, the total variation of the binary (sampled token vs the rest) distributions, leaves the
    trust region in the direction its advantage pushes; a rare token whose ratio is large but whose
    probability barely moved keeps it (PPO's ratio clip over-penalises it), a likely token whose probability
    fell a lot loses it (PPO's under-penalises it). Paper and authors' settings: eps_low = eps_high = 0.15
    (verl's `examples/dppo_trainer` script, from the authors); prime-rl's default loss uses 0.2 / 0.2.
    `kl_tau` adds the (log r)^2 term of prime-rl's default loss (tau 1e-3 there, from Kimi K2.5, arXiv
    2602.02276; prime-rl writes it without a 1/2, twice the k2 estimator); 0, the DPPO paper's, leaves it
    out. `ratio_scale` multiplies r in the surrogate; the trust region reads the unscaled probabilities
    (a divergence between the two policies, which a reweighting does not move). `weight` multiplies the
    policy term only. `loss/policy` excludes the kl_tau term. Clip fractions count the masked tokens:
    low (A < 0), high (A > 0).
    Read to confirm: verl `compute_policy_loss_dppo_tv` and the authors' `_compute_token_mask_for_policy_loss`
    (sail-sg/Stable-RL): the same mask; they back-propagate through -A sg[min(r, c)] M log pi, whose
    gradient is this one's up to their truncation of r at c = `clip_ratio_c`. verl's 20 is only the fallback
    for a config without the key: its stock actor config (verl 0.9.1) sets `clip_ratio_c: 3.0`, the dual-clip
    constant, so a stock verl DPPO run caps r at 3; the authors' run script sets 1e4, and the paper (Sec.
    5.4) warns the truncation biases. This harness, like the paper, caps nothing; the value -M r A is the
    surrogate's. prime-rl's `default_loss_fn` (same mask, gradient A r, (log r)^2 term)
    agrees, with the mask's boundary at A = 0 on the low side (that token's term is 0 anyway).
    """
    return _dppo(
        logp=logp,
        old_logp=old_logp,
        adv=adv,
        mask=mask,
        eps_low=eps_low,
        eps_high=eps_high,
        kl_tau=kl_tau,
        agg=agg,
        ref_logp=ref_logp,
        beta=beta,
        weight=weight,
        ratio_scale=ratio_scale,
        divergence="tv",
    )


@as_loss(ratio_level="token", clip="divergence", seq_mean_policy=False, ranges=DPPO_RANGES)
def dppo_kl_loss(
    *,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float = 0.05,
    eps_high: float = 0.05,
    kl_tau: float = 0.0,
    agg: str = "seq-mean-token-mean",
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    weight: Tensor | None = None,
    ratio_scale: Tensor | None = None,
) -> tuple[Tensor, LossMetrics]:
    """DPPO-Binary-KL (arXiv 2602.04879): `dppo_tv_loss` with the binary KL as the divergence.

    D_{i,t} = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)),  p = pi_theta(y_{i,t}),
              p_old = pi_old(y_{i,t}): KL(pi_old || pi_theta) of the sampled token vs the rest
    M_{i,t} = 0 if A_{i,t} > 0, p > p_old and D_{i,t} > eps_high, or A_{i,t} < 0, p < p_old and
              D_{i,t} > eps_low;  1 otherwise
    loss    = agg_{i,t} -M_{i,t} r_{i,t} A_{i,t} + kl_tau * agg_{i,t} (log r_{i,t})^2 + beta * agg k3.
    eps_low = eps_high = 0.05 (verl's `examples/dppo_trainer` script, the authors' setting). By Pinsker
    D >= 2 |p - p_old|^2, so a token past the TV bound 0.15 is past this one too; the KL bound also masks
    rare tokens that moved by a large factor (0.01 -> 0.1: D = 0.071). Everything else as `dppo_tv_loss`.
    Read to confirm: verl `compute_policy_loss_dppo_kl` and the authors' `dppo_binary_kl` mask (the same
    divergence, direction conditions and thresholds; they add 1e-8 inside the second log, here the exact
    form through xlogy).
    """
    return _dppo(
        logp=logp,
        old_logp=old_logp,
        adv=adv,
        mask=mask,
        eps_low=eps_low,
        eps_high=eps_high,
        kl_tau=kl_tau,
        agg=agg,
        ref_logp=ref_logp,
        beta=beta,
        weight=weight,
        ratio_scale=ratio_scale,
        divergence="kl",
    )


@as_loss(
    ratio_level="token",
    clip=None,
    seq_mean_policy=False,
    ranges={"k_pos": AT_LEAST_0, "lambda_pos": ABOVE_0, "k_neg": AT_LEAST_0, "lambda_neg": ABOVE_0},
)
def vespo_loss(
    *,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    agg: str = "seq-mean-token-mean",
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    weight: Tensor | None = None,
    ratio_scale: Tensor | None = None,
) -> tuple[Tensor, LossMetrics]:
    """VESPO (Variational sEquence-level Soft Policy Optimization, arXiv 2602.10693): each sequence's policy
    gradient weighted by a smooth kernel of its whole (not length-normalised) importance ratio.

    W_i        = prod_t pi_theta(y_{i,t}) / pi_old(y_{i,t})   (times `ratio_scale`'s factors)
    phi(W)     = W^k exp(lambda (1 - W)),  (k, lambda) = (k_pos, lambda_pos) if A >= 0 else (k_neg, lambda_neg)
    loss       = agg_{i,t} -sg[phi(W_i)] A_{i,t} pi_theta(y_{i,t}) / sg[pi_theta(y_{i,t})] + beta * agg k3,
    so d loss / d logp_{i,t} = -phi(W_i) A_{i,t} (REINFORCE with a detached sequence weight) and the value is
    -phi A. phi(1) = 1 (on-policy it is the plain policy gradient); it vanishes as W -> 0 (power k) and as
    W -> inf (decay lambda), a soft trust region on the sequence without GSPO's length normalisation.
    Paper defaults k 2 / lambda 3 for A >= 0 and k 3 / lambda 2 for A < 0, aggregated by token-mean (the
    config group sets it). log W is clamped to [-20, 20] before phi (phi there is below 1e-16, so only NaN
    is avoided); no token's log-ratio is clamped. `weight` multiplies each token's term (an engine correction there, not inside W), `adv`
    may be per token (the sign then picks k, lambda per token). Both clip fractions are 0.
    Read to confirm: TRL `GRPOTrainer.get_gamma_weights` (`loss_type="vespo"`) and the authors'
    `compute_policy_loss_vespo` (FloyedShen/VESPO): the same phi, detached, times -A log pi, the sign test
    A >= 0, token-mean, defaults 2/3/3/2 (the authors' docstring lists 1.5/4/2.5, their code and run
    scripts 2/3/3/2). They also clamp each token's log-ratio to [-20, 20] before the sum (TRL then log W
    to [log 1e-8, 20]), which this harness does not: a token with |log r| > 20 moves W here and not there;
    and they fold an engine (TIS) correction into W, where this harness's `weight` multiplies the term.
    """
    adv = token_adv(adv, logp)  # (B, T)
    with torch.no_grad():
        log_ratio = masked_log_ratio(logp, old_logp, mask)
        if ratio_scale is not None:
            scale = ratio_scale.detach().to(logp.dtype)
            log_ratio = log_ratio + torch.where(mask, scale.log(), torch.zeros_like(scale))
        log_w = log_ratio.sum(dim=-1, keepdim=True).clamp(-20.0, 20.0)  # log W_i, (B, 1)
        positive = adv >= 0
        k = torch.where(positive, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
        lam = torch.where(positive, torch.full_like(adv, lambda_pos), torch.full_like(adv, lambda_neg))
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())  # W^k exp(lambda (1 - W)), (B, T)
    live_logp = torch.where(mask, logp, torch.zeros_like(logp))
    pg_loss = -adv * phi * torch.exp(live_logp - live_logp.detach())  # value -phi A, grad -phi A d logp
    never = torch.zeros_like(mask, dtype=torch.bool)  # a kernel, no clip
    return finish_token_loss(
        pg_loss, low=never, high=never, logp=logp, mask=mask, weight=weight, ref_logp=ref_logp, beta=beta, agg=agg
    )
