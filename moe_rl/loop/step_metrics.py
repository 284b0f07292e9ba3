"""The loop's metrics, emitted where they are computed (pure functions of the tensors `moe_rl.train` computes).

Each function here emits one or a few metric families into the update's or the step's accumulator
(`moe_rl.metrics.accumulator.Metrics`): a family's partial statistics (`moe_rl.metrics.partial`) and the
function that finalizes them once the loop has pooled them across processes (`Dist.merge`, the identity in
a world of size 1). `aggregate` then makes one step's metrics out of its N updates' (docs/design.md §1, §3).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Mapping
from functools import partial
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

from moe_rl.algos.corrections import EngineWeight
from moe_rl.loop.records import OldPass
from moe_rl.loop.split import SplitPass
from moe_rl.metrics.accumulator import Finalize, Metrics
from moe_rl.metrics.names import (
    EXPERT_FLIP_FRAC,
    FLIP_RATE,
    FLIP_VS_MARGIN_PREFIX,
    KL_UPDATE_K3,
    NATIVE_VS_REPLAYED,
    OFFPOLICY_KEYS,
    OLD_VS_NEW,
    RATIO_ROUTER_SHIFT_FLOOR_FRAC,
    RATIO_ROUTER_SHIFT_SCALE,
    RATIO_SPLIT_ENGINE_VAR,
    REWARD_ERRORS,
    REWARD_MEAN,
    REWARD_STD,
    REWARD_ZERO_VAR_GROUP_FRAC,
    ROLLOUT_IS_MASKED_FRAC,
    ROLLOUT_IS_TRUNCATED_FRAC,
    ROLLOUT_IS_WEIGHT_MEAN,
    ROLLOUT_RESPONSE_LEN,
    ROLLOUT_VS_OLD,
    ROUTE_CONFIDENCE,
    ROUTE_PREFIX,
    ROUTE_R3_FALLBACK_FRAC,
    ROUTE_REPLAY_FALLBACK_FRAC,
    ROUTE_REPLAY_REPLACE_RATE,
    ROUTE_USED_VS_CACHED_FLIP_RATE,
    offpolicy_key,
    route_key,
)
from moe_rl.metrics.partial import Partial, mean_finalize, mean_parts
from moe_rl.metrics.ratio_stats import (
    margin_finalize,
    margin_parts,
    ratio_split_finalize,
    ratio_split_parts,
    ratio_split_weights,
    rollout_gap_finalize,
    rollout_gap_parts,
)
from moe_rl.rollout.generate import Rollout
from moe_rl.routing.compare import (
    compare_finalize,
    compare_parts,
    confidence_finalize,
    confidence_parts,
    fallback_finalize,
    fallback_parts,
    flip_margin_finalize,
    flip_margin_parts,
    movement_finalize,
    movement_parts,
    position_finalize,
    position_parts,
    route_overlap,
    router_shift_gaps,
    shift_summary,
)
from moe_rl.routing.expert_load import INSTRUMENTS, instrument_finalize
from moe_rl.routing.hooks import RoutedPass
from moe_rl.routing.routes import Routes
from moe_rl.tasks.rewards import zero_variance_frac

# OFFPOLICY_KEYS are also averaged over the off-policy updates 2..N only, as `<key>/offpolicy`: update 1 runs on the
# old policy's weights, so its flips and ratio spread are zero and dilute the step mean by (N-1)/N.
# Counts (per margin bin: (t, l) seen and flipped) summed over the off-policy updates 2..N.
COUNT_PREFIX = FLIP_VS_MARGIN_PREFIX
# An update's `<key>@weight` makes `<key>` a weighted mean over the updates (a share by its denominator).
WEIGHT_SUFFIX = "@weight"


_Rows = TypeVar("_Rows", Tensor, Routes)  # what a row selection applies to

# --- one update -------------------------------------------------------------------------------


class UpdateRoutes(NamedTuple):
    """An update's routes on its mini-batch rows, as its route/ metrics compare them (MoE models only)."""

    native: Routes  # the router's own choice in the update's pass
    old: Routes  # the old pass's native routes
    scores: Tensor  # (b, T, L, E) the update pass's router selection probabilities
    old_scores: Tensor  # (b, T, L, E) the old pass's
    old_margins: Tensor  # (b, T, L) the old pass's k-th vs (k+1)-th probability gaps
    replay: Routes | None  # the routes the update forced (None: none)
    used: Routes | None  # what the experts received (with replay)
    fallback: Tensor | None  # (refilled, slots) of a thresholded replay, else None


def update_routes(
    routed: RoutedPass,
    old: OldPass,
    rows: Tensor,
    replay: Routes | None,
    valid: Tensor,
    *,
    instruments: bool,
    thresholded: bool,
) -> UpdateRoutes:
    """What an update's recorded pass `routed` on the old pass's `rows` gives its route metrics (`valid`: the
    rows' real tokens), beside the old pass's routes, scores and margins on the same rows (the margins are
    recorded on the instruments' steps only: RSPO alone records none)."""
    assert old.routes is not None  # an MoE model
    return UpdateRoutes(
        native=routed.native.with_mask(valid),
        old=old.routes[rows],
        scores=routed.scores,
        old_scores=old.scores[rows],
        old_margins=old.margins[rows] if instruments else old.margins,
        replay=replay,
        used=routed.used.with_mask(valid) if replay is not None else None,
        fallback=routed.fallback if thresholded else None,
    )


def instruments_due(step: int, route_every: int) -> bool:
    """Whether `step` runs the route instruments and the ratio split (`metrics.route_every`): the steps that
    are multiples of `route_every`, as `snapshot_every` counts them (1: every step; step 0 is the evaluation)."""
    return step % route_every == 0


def split_seed(seed: int, step: int) -> int:
    """Seed of `step`'s ratio-split subsample: a stream of its own, so that drawing it moves none of the
    training's (prompt order, sampling, mini-batch shuffles) and every other logged number stays the same."""
    return seed * 1_000_117 + step + 104_729


def split_subsample(count: int, keep: int | None, generator: torch.Generator) -> Tensor | None:
    """Ascending positions of the `keep` of a mini-batch's `count` rows that the ratio split scores, drawn
    without replacement from `generator`; None (all rows, nothing drawn) when `keep` is None or >= `count`.
    The split is a population statistic of the update's tokens, so a random subset of rows estimates it."""
    if keep is None or keep >= count:
        return None
    return torch.randperm(count, generator=generator)[:keep].sort().values


def local_positions(minibatch: Tensor, picked: Tensor, first: int, count: int) -> Tensor:
    """Positions, among this process's rows of `minibatch` (global row ids; it holds rows [first, first +
    count), in `minibatch`'s order, as `moe_rl.loop.distributed.local_rows` gives them), of the rows at
    positions `picked` of `minibatch`: one subsample of the global mini-batch, whatever the world size."""
    chosen = torch.zeros(len(minibatch), dtype=torch.bool)
    chosen[picked] = True
    mine = (minibatch >= first) & (minibatch < first + count)
    return chosen[mine].nonzero().squeeze(1)


def _named(name: Callable[[str], str], finalize: Callable[[Partial], Mapping[str, float]]) -> Finalize:
    """`finalize` with each of its keys renamed by `name` (a family's metrics under a route/ prefix)."""
    return lambda parts: {name(k): v for k, v in finalize(parts).items()}


def router_shift_metrics(acc: Metrics, scale: Tensor, mask: Tensor, floor: float) -> None:
    """RSPO's router-shift factor `scale` (b, T) = max(gamma_t, `floor`) on the update's valid tokens: its mean and
    the share clamped at the floor (`algo.router_shift`), each weighed by the valid tokens."""
    valid = scale[mask.bool()].double()
    n, tokens = max(valid.numel(), 1), mask.sum().double().item()
    means = {
        RATIO_ROUTER_SHIFT_SCALE: valid.sum().item() / n,
        RATIO_ROUTER_SHIFT_FLOOR_FRAC: (valid <= floor).sum().item() / n,
    }
    acc.add("router_shift", mean_parts(means, dict.fromkeys(means, tokens)), mean_finalize)


def update_kl_metrics(acc: Metrics, before: Tensor, after: Tensor, mask: Tensor, key: str = KL_UPDATE_K3) -> None:
    """The update's own step as a divergence (`key`, `kl/update_k3` or its acting-route twin): k3 of
    KL(pi_before || pi_after) on its tokens, `exp(d) - 1 - d` with `d = after - before` (b, T) the log-probs after
    and before the optimizer step, averaged over the valid tokens `mask` (b, T), pooled over processes as a sum and
    a count."""
    d = torch.where(mask.bool(), after.double() - before.double(), 0.0)  # pads never reach a sum (0 * inf is nan)
    sums = {"k3": (torch.expm1(d) - d).sum(), "tokens": mask.double().sum()}
    family = "update_kl" if key == KL_UPDATE_K3 else "update_kl_acting"
    acc.add(family, Partial(sums=sums), functools.partial(_update_kl_finalize, key=key))


def _update_kl_finalize(parts: Partial, key: str) -> dict[str, float]:
    return {key: (parts.sums["k3"] / parts.sums["tokens"].clamp(min=1)).item()}


def route_metrics(
    acc: Metrics, routes: UpdateRoutes, mask: Tensor, *, prompt_len: int, position_bucket: int, max_new_tokens: int
) -> None:
    """An MoE update's route/ metrics: the old-vs-new, position, shift, margin-flip and movement comparisons, native
    vs replayed and used vs cached under replay, and the threshold's fallback."""
    native, old = routes.native, routes.old
    overlap = route_overlap(native, old)  # (b, T, L), shared by the three old-vs-new metrics
    old_vs_new = partial(route_key, OLD_VS_NEW)
    acc.add("old_vs_new", compare_parts(native, old, overlap=overlap), _named(old_vs_new, compare_finalize))
    buckets = -(-max_new_tokens // position_bucket)
    position = position_parts(native, old, mask, prompt_len - 1, position_bucket, buckets=buckets, overlap=overlap)
    acc.add("position", position, _named(old_vs_new, partial(position_finalize, bucket=position_bucket)))
    gaps = router_shift_gaps(routes.old_scores, routes.scores, old, mask)
    acc.add("shift", Partial(rows={"gaps": gaps}), _named(old_vs_new, lambda p: shift_summary(p.rows["gaps"])))
    margin_flips = flip_margin_parts(old, native, routes.old_margins, overlap=overlap)
    acc.add("margin_flips", margin_flips, _named(ROUTE_PREFIX.__add__, flip_margin_finalize))
    move = movement_parts(routes.old_scores, routes.scores, old, native, overlap=overlap)
    acc.add("move", move, _named(ROUTE_PREFIX.__add__, movement_finalize))
    if routes.replay is not None:
        assert routes.used is not None  # recorded by every replayed pass
        replayed = _named(partial(route_key, NATIVE_VS_REPLAYED), compare_finalize)
        acc.add("native_vs_replayed", compare_parts(native, routes.replay), replayed)
        acc.add("used_vs_cached", compare_parts(routes.used, routes.replay), _used_vs_cached)
    if routes.fallback is not None:
        refilled, slots = routes.fallback.double()
        acc.add("fallback", Partial(sums={"refilled": refilled, "slots": slots}), _replay_fallback)


def _used_vs_cached(parts: Partial) -> dict[str, float]:
    pooled = compare_finalize(parts)
    return {ROUTE_USED_VS_CACHED_FLIP_RATE: pooled[FLIP_RATE], ROUTE_REPLAY_REPLACE_RATE: pooled[EXPERT_FLIP_FRAC]}


def _replay_fallback(parts: Partial) -> dict[str, float]:
    return {ROUTE_REPLAY_FALLBACK_FRAC: (parts.sums["refilled"] / parts.sums["slots"].clamp(min=1)).item()}


def split_metrics(
    acc: Metrics, routes: UpdateRoutes, other: SplitPass, clipped: Tensor, logp: Tensor, old_logp: Tensor, mask: Tensor
) -> None:
    """The ratio split (rho = logp(native) - logp(replayed), docs/design.md §3) over the fully native pass and the
    replayed one (R2: the old routes, R3: the rollout's), on the rows the split's pass `other` scored; a token's
    route changed where the two passes' routes differ. `clipped`: the loss's clipped tokens on all the rows."""
    pick = other.rows

    def scored(x: _Rows) -> _Rows:
        return x if pick is None else x[pick]

    if routes.replay is None:
        native_logp, replayed_logp, native, replayed = (
            scored(logp),
            other.logp,
            scored(routes.native),
            scored(routes.old),
        )
    else:
        native_logp, replayed_logp, native, replayed = other.logp, scored(logp), other.routes, scored(routes.replay)
    parts = ratio_split_parts(
        native_logp=native_logp,
        replayed_logp=replayed_logp,
        old_logp=scored(old_logp),
        mask=scored(mask),
        flipped=route_overlap(native, replayed) < routes.native.top_k,  # (s, T, L): per MoE layer
        clipped=scored(clipped),
    )
    acc.add("split", parts, _split_finalize)


def _split_finalize(parts: Partial) -> dict[str, float]:
    weights = {k + WEIGHT_SUFFIX: w for k, w in ratio_split_weights(parts).items()}
    return {**ratio_split_finalize(parts), **weights}


# --- one step ---------------------------------------------------------------------------------


def rollout_metrics(
    acc: Metrics, rewards: Tensor, errors: float, rollout: Rollout, old: OldPass, *, group_size: int, engine_part: bool
) -> None:
    """A step's response lengths, rewards and reward errors, and the rollout policy's (engine's) gap to the trainer
    per completion token (`rollout` vs the `old` pass; moe_rl.metrics.ratio_stats.rollout_gap_stats). `engine_part`: the
    rollout policy is not the trained one, so the gap has an engine part (`ratio/split/engine_var`)."""
    mask = rollout.response_mask
    sums = {
        "length": mask.sum(-1).float().sum(),
        "rows": torch.tensor(len(mask)),
        "errors": torch.tensor(errors, dtype=torch.float64),
    }
    acc.add("rollout", Partial(sums=sums, rows={"rewards": rewards}), partial(_rollout_finalize, group_size))
    gap = rollout_gap_parts(rollout_logp=rollout.rollout_logp, train_logp=old.logp, mask=mask)
    acc.add("gap", gap, rollout_gap_finalize if engine_part else _trainer_sampled_gap)


def _rollout_finalize(group_size: int, parts: Partial) -> dict[str, float]:
    sums, rewards = parts.sums, parts.rows["rewards"]
    return {
        REWARD_ZERO_VAR_GROUP_FRAC: zero_variance_frac(rewards, group_size),
        REWARD_ERRORS: sums["errors"].item(),
        REWARD_MEAN: rewards.mean().item(),
        REWARD_STD: rewards.std(unbiased=False).item(),
        ROLLOUT_RESPONSE_LEN: (sums["length"] / sums["rows"]).item(),
    }


def _trainer_sampled_gap(parts: Partial) -> dict[str, float]:
    """The gap when the trainer sampled: no engine part to split off."""
    gap = rollout_gap_finalize(parts)
    del gap[RATIO_SPLIT_ENGINE_VAR]
    return gap


def seconds_metrics(acc: Metrics, seconds: Mapping[str, float]) -> None:
    """The phases' wall-clock seconds, the slowest process's."""
    maxima = {k: torch.tensor(v, dtype=torch.float64) for k, v in seconds.items()}
    acc.add("time", Partial(maxima=maxima), lambda parts: {k: v.item() for k, v in parts.maxima.items()})


def old_pass_metrics(acc: Metrics, old: OldPass, rollout: Rollout, *, replays_rollout: bool, instruments: bool) -> None:
    """For an MoE model on a step that runs the route instruments (`instruments`, `metrics.route_every`): the old
    pass's margins, confidence, expert load and router logits, the share of tokens the rollout's routes leave to
    the live router (where the updates replay them: `replays_rollout`) and rollout vs old routes."""
    if old.instruments is not None:  # the old pass's expert load and router logits (route steps)
        acc.add(INSTRUMENTS, old.instruments, instrument_finalize)
    if old.routes is None or not instruments:
        return
    acc.add("margins", margin_parts(old.margins, old.routes.mask), margin_finalize)
    acc.add(
        "confidence", confidence_parts(old.scores, old.routes), lambda p: {ROUTE_CONFIDENCE: confidence_finalize(p)}
    )
    if replays_rollout:
        assert rollout.routes is not None  # a mode that replays the rollout's routes records them
        fallback = fallback_parts(rollout.routes, rollout.token_mask)
        acc.add("fallback", fallback, lambda p: {ROUTE_R3_FALLBACK_FRAC: fallback_finalize(p)})
    if rollout.routes is not None:
        rollout_vs_old = _named(partial(route_key, ROLLOUT_VS_OLD), compare_finalize)
        acc.add("rollout_vs_old", compare_parts(rollout.routes, old.routes), rollout_vs_old)


def correction_metrics(acc: Metrics, correction: EngineWeight, mask: Tensor) -> None:
    """The engine-gap correction's mean weight and its truncated and masked tokens' shares."""
    sums = {
        "weight": (correction.weight.double() * mask).sum(),
        "truncated": correction.truncated.sum(),
        "masked": correction.masked.sum(),
        "tokens": mask.sum().double(),
    }
    acc.add("is", Partial(sums=sums), _correction_finalize)


def _correction_finalize(parts: Partial) -> dict[str, float]:
    sums = parts.sums
    tokens = sums["tokens"].clamp(min=1).item()
    return {
        ROLLOUT_IS_WEIGHT_MEAN: sums["weight"].item() / tokens,
        ROLLOUT_IS_TRUNCATED_FRAC: sums["truncated"].item() / tokens,
        ROLLOUT_IS_MASKED_FRAC: sums["masked"].item() / tokens,
    }


# --- the step's updates -----------------------------------------------------------------------


def _weighted_means(
    updates: list[dict[str, float]], keys: set[str], name: Callable[[str], str] = str
) -> dict[str, float]:
    """{name(key): sum_u w_u v_u / sum_u w_u} over the updates of positive weight w_u = `key@weight`; a key
    that no update weighs (nothing clipped, no spread) is undefined and left out, like an unlogged metric."""
    out = {}
    for key in keys:
        pairs = [(m[key], m[key + WEIGHT_SUFFIX]) for m in updates if key in m and m[key + WEIGHT_SUFFIX] > 0]
        total = sum(w for _, w in pairs)
        if total > 0:
            out[name(key)] = sum(v * w for v, w in pairs) / total
    return out


def aggregate(updates: list[dict[str, float]]) -> dict[str, float]:
    """Step-level metrics from the step's updates (equal-size mini-batches): the mean of each
    update's value, the max for maxima, the mean weighted by `<key>@weight` where an update gives
    one (the ratio split's shares; left out where no update has weight), the mean over updates 2..N
    for OFFPOLICY_KEYS, and the sum over updates 2..N for the flip-vs-margin counts."""
    weighted = {k.removesuffix(WEIGHT_SUFFIX) for m in updates for k in m if k.endswith(WEIGHT_SUFFIX)}
    values: dict[str, list[float]] = defaultdict(list)
    for metrics in updates:
        for key, value in metrics.items():
            if not key.startswith(COUNT_PREFIX) and not key.endswith(WEIGHT_SUFFIX) and key not in weighted:
                values[key].append(value)
    out = {k: (max(v) if k.endswith("_max") else sum(v) / len(v)) for k, v in values.items()}
    out.update(_weighted_means(updates, weighted))
    if len(updates) > 1:
        for key in updates[1]:
            if key.startswith(COUNT_PREFIX):
                out[key] = sum(m[key] for m in updates[1:])
        out.update(_weighted_means(updates[1:], weighted & set(OFFPOLICY_KEYS), offpolicy_key))
        for key in OFFPOLICY_KEYS:
            late = [m[key] for m in updates[1:] if key in m and key not in weighted]
            if late:
                out[offpolicy_key(key)] = sum(late) / len(late)
    return out
