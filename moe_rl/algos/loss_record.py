"""The `Loss` record and what every policy loss shares: the keyword signature, the input checks (the
hyperparameters' ranges among them), the aggregation, the KL term, the metrics and their denominators, the
ending every token loss shares (`finish_token_loss`), and DeepSeek-V3.2's off-policy sequence mask (arXiv
2512.02556), which the record applies to any loss. The losses themselves, and how to add one:
`moe_rl.algos.losses`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch import Tensor

from moe_rl.metrics.names import (
    KL_REF_K3,
    LOSS,
    LOSS_OFFPOLICY_SEQ_MASKED_FRAC,
    LOSS_POLICY,
    RATIO_CLIPFRAC_HIGH,
    RATIO_CLIPFRAC_LOW,
)

AGG_MODES = ("seq-mean-token-mean", "token-mean")

LossFn = Callable[..., tuple[Tensor, "LossMetrics"]]


class LossMetrics(dict[str, float]):
    """A loss's metrics (floats) with `weights`: the denominator of `loss` and of each metric, and
    `clipped`: the (B, T) bool tokens on the clipped branch (GSPO: every valid token of a clipped sequence)."""

    def __init__(self, values: dict[str, float], weights: dict[str, float], clipped: Tensor | None = None) -> None:
        super().__init__(values)
        self.weights = weights
        self.clipped = clipped


@dataclass(frozen=True)
class Range:
    """The values a loss's own hyperparameter may take: from `low` (itself included when `closed`) to `high`.
    NaN lies in none."""

    low: float
    high: float = math.inf
    closed: bool = True

    def __contains__(self, value: float) -> bool:
        above = value >= self.low if self.closed else value > self.low
        return above and value <= self.high

    def __str__(self) -> str:
        """What a value must do to lie in it, as an error message says it: "be > 0", "lie in [0, 1]"."""
        if self.high == math.inf:
            return f"be {'>=' if self.closed else '>'} {self.low:g}"
        return f"lie in {'[' if self.closed else '('}{self.low:g}, {self.high:g}]"


AT_LEAST_0 = Range(0.0)
ABOVE_0 = Range(0.0, closed=False)
UNIT = Range(0.0, 1.0)
EPS_RANGES = {"eps_low": UNIT, "eps_high": AT_LEAST_0}  # a clip range: eps_low <= 1 keeps 1 - eps_low >= 0


# The arguments every loss takes, in its one keyword signature; its other keyword arguments are its
# own hyperparameters.
SHARED_ARGS = ("logp", "old_logp", "adv", "mask", "ref_logp", "beta", "agg", "weight", "ratio_scale")


def offpolicy_sequence_mask(
    *, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, delta: float
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9): `(keep, dropped)`.

    M_{i,t} = 0 if A_{i,t} < 0 and (1/|y_i|) sum_t log(pi_old(y_{i,t}) / pi_theta(y_{i,t})) > delta, else 1:
    a sequence the policy is pushing down (negative advantage) that the current policy already finds much
    less likely than the sampling policy did (the k1 estimate of KL(pi_old || pi_theta) per token) teaches
    little and destabilises, so its policy term is dropped. pi_theta is the current policy, read without
    gradient (the mask is a constant of each update). pi_old is `old_logp`, the old-policy pass; TRL reads
    the inference engine's log-probs there when it has them, so that the engine gap counts too (here the
    engine gap enters as the loss's `weight`, `rollout.is_correction`).
    keep    (B, T) bool: valid tokens the mask keeps (False at masked positions too)
    dropped (B,) bool: sequences with a dropped token (a per-sequence advantage drops all of them or none)
    The same mask and KL as TRL's `GRPOTrainer.get_off_policy_mask` (`off_policy_mask_threshold`, read to
    confirm: k1 of the detached current log-probs, a mean over the valid tokens, kept when A >= 0). The
    paper gives no delta; TRL suggests 0.5. Masked positions and empty sequences never enter (an empty
    sequence's mean is 0, so it is kept).
    """
    if not delta >= 0:  # also refuses NaN, which would never mask
        raise ValueError(f"offpolicy_mask_delta={delta} must be >= 0 (None turns the mask off)")
    mask = mask.to(torch.bool)
    log_old_over_new = torch.where(mask, old_logp.detach() - logp.detach(), torch.zeros_like(logp))
    mean_kl = log_old_over_new.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # (B,)
    negative = token_adv(adv, logp) < 0  # (B, T)
    drop = (mean_kl > delta)[:, None] & negative & mask
    return mask & ~drop, drop.any(dim=-1)


@dataclass(frozen=True)
class Loss:
    """One policy loss: its function and every fact about it that the rest of the harness reads.

    fn              the formula: keyword-only, `SHARED_ARGS` plus the loss's own hyperparameters, each
                    with its paper's value as default; called on checked inputs (`mask` as bool)
    ratio_level     "token": a sum of per-token terms, each with its own ratio (VESPO: its sequence's
                    W, a product of them), so `adv` may be (B,) or (B, T), `ratio_scale` rescales each
                    token's ratio (VESPO: its factor in W) and `weight` each token's term;
                    "sequence": one ratio per sequence (GSPO), so `adv` is (B,), `ratio_scale` (a
                    per-token reweighting) is refused and `weight` enters as its mean over each
                    sequence, exact for a sequence-level weight only
    clip            what eps_low / eps_high bound: "ratio": PPO's min(), a ratio outside
                    [1 - eps_low, 1 + eps_high] loses its gradient, and the range may widen upward
                    only (the config refuses eps_high < eps_low); "weight": CISPO's truncated importance
                    weight, every gradient kept, eps_low 1 (no lower bound) its default; None: no clip
                    range (SAPO's gate, VESPO's kernel); "divergence": DPPO's trust region, eps_low /
                    eps_high bound how far a token's probability may move (TV |pi - pi_old|, or the
                    binary KL) in the direction its advantage pushes before the token loses its gradient
    seq_mean_policy the policy term is a mean over sequences whatever `agg`, which then reduces only
                    the KL term (a token-mean KL beside it has another denominator)
    ranges          each of the loss's own hyperparameters and the `Range` it must lie in (every one has
                    one; its paper's value lies in it): the record refuses a value outside it, and so
                    does the config (`algo.<key>`), before any work
    defaults        the loss's own hyperparameters at its paper's values: `fn`'s keyword defaults
                    outside `SHARED_ARGS` (derived, so there is no copy to keep equal)
    """

    fn: LossFn
    ratio_level: Literal["token", "sequence"]
    clip: Literal["ratio", "weight", "divergence"] | None
    seq_mean_policy: bool
    ranges: Mapping[str, Range] = field(default_factory=dict)
    defaults: Mapping[str, float] = field(init=False, compare=False)
    _signature: inspect.Signature = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        name = self.fn.__name__
        signature = inspect.signature(self.fn)
        params = signature.parameters
        if any(p.kind is not inspect.Parameter.KEYWORD_ONLY for p in params.values()):
            raise TypeError(f"{name}: a loss takes keyword-only arguments")
        missing = [a for a in SHARED_ARGS if a not in params]
        if missing:
            raise TypeError(f"{name} lacks the shared arguments {missing}")
        own = {k: p.default for k, p in params.items() if k not in SHARED_ARGS}
        if any(not isinstance(v, float) for v in own.values()):
            raise TypeError(f"{name}: each of its own hyperparameters needs its paper's value as a float default")
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"{name}: ratio_level={self.ratio_level!r} must be 'token' or 'sequence'")
        if (self.clip is not None) != ({"eps_low", "eps_high"} <= own.keys()):
            raise ValueError(f"{name}: clip={self.clip!r} needs eps_low and eps_high exactly when it is not None")
        if set(self.ranges) != set(own):
            raise ValueError(f"{name}: ranges names {sorted(self.ranges)}; its own hyperparameters are {sorted(own)}")
        if outside := self.out_of_range(own):
            raise ValueError(f"{name}: its paper's value {outside}")
        object.__setattr__(self, "ranges", MappingProxyType(dict(self.ranges)))
        object.__setattr__(self, "defaults", MappingProxyType(own))
        object.__setattr__(self, "_signature", signature)

    def out_of_range(self, values: Mapping[str, float]) -> str | None:
        """The first of `values` (own hyperparameters by name) outside its range, as "key=value must be > 0";
        None: all lie in theirs."""
        for key, allowed in self.ranges.items():
            if key in values and values[key] not in allowed:
                return f"{key}={values[key]} must {allowed}"
        return None

    @property
    def takes_ratio_scale(self) -> bool:
        """Whether `ratio_scale` (a per-token factor on the ratio, e.g. RSPO's router shift) applies."""
        return self.ratio_level == "token"

    @property
    def weighs_tokens(self) -> bool:
        """Whether a per-token `weight` weighs each token (a sequence loss averages it per sequence)."""
        return self.ratio_level == "token"

    def __call__(self, *, offpolicy_mask_delta: float | None = None, **kwargs: Any) -> tuple[Tensor, LossMetrics]:
        """`(loss, metrics)` of the shared and own arguments in `kwargs`, after the shared input checks.

        `offpolicy_mask_delta` (None: off) applies DeepSeek-V3.2's off-policy sequence mask to any loss: the
        dropped tokens (`offpolicy_sequence_mask`) get weight 0 on the policy term, through `weight`, so every
        denominator stays the paper's (eq. 9 multiplies the term inside the sums; a GSPO sequence's weight is
        its mean over the sequence, exact for a mask that is constant along it), the KL term is untouched, and
        `metrics` gains `loss/offpolicy_seq_masked_frac` over the non-empty sequences.
        """
        bound = self._signature.bind(**kwargs)
        bound.apply_defaults()
        args = bound.arguments
        args["mask"] = self._check_inputs(**args)
        if offpolicy_mask_delta is None:
            return self.fn(**args)
        keep, dropped = offpolicy_sequence_mask(
            logp=args["logp"], old_logp=args["old_logp"], adv=args["adv"], mask=args["mask"], delta=offpolicy_mask_delta
        )
        weight = args["weight"]
        if weight is None:
            args["weight"] = keep.to(args["logp"].dtype)
        else:  # where, not a product: an inf weight on a dropped token must not become NaN
            args["weight"] = torch.where(keep, weight.detach(), torch.zeros_like(weight))
        loss, metrics = self.fn(**args)
        nonempty = args["mask"].any(dim=-1)
        n_dropped, n_sequences = torch.stack([dropped.sum(), nonempty.sum()]).double().tolist()
        metrics[LOSS_OFFPOLICY_SEQ_MASKED_FRAC] = n_dropped / max(n_sequences, 1.0)
        metrics.weights[LOSS_OFFPOLICY_SEQ_MASKED_FRAC] = n_sequences
        return loss, metrics

    def _check_inputs(
        self,
        *,
        logp: Tensor,
        old_logp: Tensor,
        adv: Tensor,
        mask: Tensor,
        ref_logp: Tensor | None,
        beta: float,
        agg: str,
        weight: Tensor | None,
        ratio_scale: Tensor | None,
        **own: float,
    ) -> Tensor:
        """Validate shapes, options and the own hyperparameters' ranges; return `mask` as bool."""
        if ratio_scale is not None and not self.takes_ratio_scale:
            raise ValueError(
                f"{self.fn.__name__} is a sequence loss; ratio_scale (a per-token reweighting) needs a token loss"
            )
        if logp.dim() != 2:
            raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
        for name, x in (
            ("old_logp", old_logp),
            ("mask", mask),
            ("ref_logp", ref_logp),
            ("weight", weight),
            ("ratio_scale", ratio_scale),
        ):
            if x is not None and x.shape != logp.shape:
                raise ValueError(f"{name} shape {tuple(x.shape)} != logp shape {tuple(logp.shape)}")
        allowed = [logp.shape[:1], logp.shape] if self.ratio_level == "token" else [logp.shape[:1]]
        if adv.shape not in allowed:
            want = " or ".join(str(tuple(s)) for s in allowed)
            raise ValueError(f"adv shape {tuple(adv.shape)} must be {want} for logp shape {tuple(logp.shape)}")
        if agg not in AGG_MODES:
            raise ValueError(f"unknown agg {agg!r}; valid: {', '.join(AGG_MODES)}")
        if beta != 0.0 and ref_logp is None:
            raise ValueError(f"beta={beta} needs ref_logp")
        if outside := self.out_of_range(own):
            raise ValueError(f"{self.fn.__name__}: {outside}")
        return mask.to(torch.bool)


def as_loss(
    *,
    ratio_level: Literal["token", "sequence"],
    clip: Literal["ratio", "weight", "divergence"] | None,
    seq_mean_policy: bool,
    ranges: Mapping[str, Range],
) -> Callable[[LossFn], Loss]:
    """Decorator: the loss function below becomes its `Loss` record with these facts."""

    def record(fn: LossFn) -> Loss:
        return Loss(fn, ratio_level=ratio_level, clip=clip, seq_mean_policy=seq_mean_policy, ranges=ranges)

    return record


def token_weight(weight: Tensor | None, mask: Tensor, like: Tensor) -> Tensor | None:
    """The constant per-token weight, 0 at masked positions (None: no weight)."""
    if weight is None:
        return None
    weight = weight.detach().to(like.dtype)
    return torch.where(mask, weight, torch.zeros_like(weight))


def scaled_ratio(ratio: Tensor, ratio_scale: Tensor | None, mask: Tensor) -> Tensor:
    """`ratio` times the constant `ratio_scale` (1 at masked positions), or `ratio` itself."""
    if ratio_scale is None:
        return ratio
    scale = ratio_scale.detach().to(ratio.dtype)
    return ratio * torch.where(mask, scale, torch.ones_like(scale))


def aggregate(x: Tensor, mask: Tensor, agg: str) -> Tensor:
    """Reduce per-token values (B, T) to a scalar over valid tokens."""
    x = torch.where(mask, x, torch.zeros_like(x))
    if agg == "token-mean":
        # sum_{i,t} x / sum_i |y_i|
        return x.sum() / mask.sum().clamp(min=1)
    # mean_{i: |y_i|>0} (1/|y_i|) sum_t x
    seq_len = mask.sum(dim=-1)  # (B,)
    seq_mean = x.sum(dim=-1) / seq_len.clamp(min=1)
    return seq_mean.sum() / (seq_len > 0).sum().clamp(min=1)


def agg_count(mask: Tensor, agg: str) -> Tensor:
    """The denominator of `aggregate`: valid tokens (token-mean) or non-empty sequences."""
    return mask.sum() if agg == "token-mean" else (mask.sum(dim=-1) > 0).sum()


def seq_mean(x: Tensor, valid: Tensor) -> Tensor:
    """Mean of per-sequence values (B,) over the non-empty sequences."""
    return torch.where(valid, x, torch.zeros_like(x)).sum() / valid.sum().clamp(min=1)


def ratio_clipped(ratio: Tensor, adv: Tensor, valid: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """`(low, high)`: the valid entries where PPO's min() picks the clipped (zero-gradient) branch, below
    (ratio < 1 - eps_low, adv < 0) and above (ratio > 1 + eps_high, adv > 0)."""
    low = (ratio < 1.0 - eps_low) & (adv < 0) & valid
    high = (ratio > 1.0 + eps_high) & (adv > 0) & valid
    return low, high


def clip_fractions(low: Tensor, high: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """`ratio/clipfrac_low` and `_high`: the fractions of the valid entries in `low` and in `high`."""
    n = valid.sum().clamp(min=1)
    return {RATIO_CLIPFRAC_LOW: low.sum().double() / n, RATIO_CLIPFRAC_HIGH: high.sum().double() / n}


def add_kl(
    policy_loss: Tensor, *, logp: Tensor, ref_logp: Tensor | None, mask: Tensor, beta: float, agg: str
) -> tuple[Tensor, dict[str, Tensor]]:
    """Add beta * k3 KL(pi_theta || pi_ref), aggregated by `agg`; return the total and its metrics."""
    metrics = {LOSS_POLICY: policy_loss.detach()}
    if ref_logp is None:
        return policy_loss, metrics
    log_ref_ratio = torch.where(mask, ref_logp.detach() - logp, torch.zeros_like(logp))
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0  # k3 = exp(ref - logp) - (ref - logp) - 1
    kl = aggregate(kl, mask, agg)
    metrics[KL_REF_K3] = kl.detach()
    return policy_loss + beta * kl, metrics


def as_floats(
    metrics: dict[str, Tensor], *, policy: Tensor, clip: Tensor, mask: Tensor, agg: str, clipped: Tensor
) -> LossMetrics:
    """The metrics as floats (one transfer) with their denominators: `policy` for the loss, `clip` for the
    clip fractions, the KL term's by `agg`."""
    counts = {LOSS: policy, LOSS_POLICY: policy, RATIO_CLIPFRAC_LOW: clip, RATIO_CLIPFRAC_HIGH: clip}
    if KL_REF_K3 in metrics:
        counts[KL_REF_K3] = agg_count(mask, agg)
    values = torch.stack([v.detach().to(torch.float64) for v in [*metrics.values(), *counts.values()]]).tolist()
    return LossMetrics(dict(zip(metrics, values)), dict(zip(counts, values[len(metrics) :])), clipped)


def finish_token_loss(
    pg_loss: Tensor,
    *,
    low: Tensor,
    high: Tensor,
    logp: Tensor,
    mask: Tensor,
    weight: Tensor | None,
    ref_logp: Tensor | None,
    beta: float,
    agg: str,
    policy_agg: str | None = None,
) -> tuple[Tensor, LossMetrics]:
    """The ending every token loss shares: its per-token policy term `pg_loss` (B, T) times the constant
    `weight`, reduced by `policy_agg` (None: `agg`), plus beta * k3 KL reduced by `agg`; the clip fractions
    of the tokens in `low` and `high` (B, T) bool (no clipped branch: all False), which are also the
    `clipped` tokens; the metrics as floats with their denominators."""
    w = token_weight(weight, mask, pg_loss)
    pg_loss = pg_loss if w is None else pg_loss * w
    policy_agg = agg if policy_agg is None else policy_agg
    loss, metrics = add_kl(
        aggregate(pg_loss, mask, policy_agg), logp=logp, ref_logp=ref_logp, mask=mask, beta=beta, agg=agg
    )
    metrics.update(clip_fractions(low, high, mask))
    policy = agg_count(mask, policy_agg)
    return loss, as_floats(metrics, policy=policy, clip=mask.sum(), mask=mask, agg=agg, clipped=low | high)


def token_adv(adv: Tensor, logp: Tensor) -> Tensor:
    """Advantage per token (B, T), broadcasting a per-sequence (B,) advantage; constant."""
    adv = adv.detach().to(logp.dtype)
    return adv[:, None].expand_as(logp) if adv.dim() == 1 else adv


def masked_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log(pi_theta / pi_old) per token, 0 at masked positions so that exp() stays finite."""
    return torch.where(mask, logp - old_logp.detach(), torch.zeros_like(logp))
