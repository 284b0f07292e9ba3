"""The loop's metric assembly: each update's and each step's metrics as parts/finalize pairs (pure).

`moe_rl.train` computes the tensors (passes, loss, gradient); these functions turn them into the
logged metrics in the two steps of `moe_rl.metrics.partial`: `*_parts` gathers a process's partial
statistics, the loop pools them across processes (`Dist.merge`, the identity in a world of size 1),
and `*_finalize` computes the metrics from the pooled statistics. `aggregate` then makes one step's
metrics out of its N updates' (docs/design.md §1, §3).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

from moe_rl.algos.corrections import EngineWeight
from moe_rl.loop.records import OldPass
from moe_rl.metrics.names import (
    EXPERT_FLIP_FRAC,
    FLIP_RATE,
    FLIP_VS_MARGIN_PREFIX,
    LOSS,
    NATIVE_VS_REPLAYED,
    OFFPOLICY_KEYS,
    OLD_VS_NEW,
    OPTIM_GRAD_NORM,
    POLICY_ENTROPY,
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
    TIME_PREFIX,
    offpolicy_key,
    route_key,
)
from moe_rl.metrics.partial import Partial, mean_finalize, mean_parts
from moe_rl.metrics.stats import (
    margin_finalize,
    margin_parts,
    ratio_finalize,
    ratio_parts,
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


class RouterShift(NamedTuple):
    """RSPO's router-shift factor of an update's tokens (`algo.router_shift`) and the floor it was clamped at."""

    scale: Tensor  # (b, T) max(gamma_t, floor), the factor on each token's ratio
    floor: float  # `algo.router_shift_floor`


class Split(NamedTuple):
    """The ratio split's other pass (`Trainer.other_routing_logp`) on the rows it scored, and the loss's clipping."""

    logp: Tensor  # (s, T) log pi_theta under the routing the update did not use, on the scored rows
    routes: Routes  # the routes that pass used, on the scored rows
    clipped: Tensor  # (b, T) the loss's clipped tokens, on all of the update's rows
    rows: Tensor | None = None  # (s,) positions of the scored rows among the update's b rows; None: all of them


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


def update_parts(
    *,
    loss_metrics: Mapping[str, float],
    loss_weights: Mapping[str, float],
    loss: float,
    entropy: float,
    tokens: float,
    shift: RouterShift | None,
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    routes: UpdateRoutes | None,
    split: Split | None,
    prompt_len: int,
    position_bucket: int,
    max_new_tokens: int,
) -> Partial:
    """One process's partial statistics of an update: the loss's means (`loss_weights`: their denominators; `tokens`
    valid tokens weigh the entropy and RSPO's `shift`), the ratio statistics, and for an
    MoE model the old-vs-new, position, shift, margin-flip and movement comparisons, native vs replayed
    and used vs cached under replay, the threshold's fallback and the ratio split (rho = logp(native) -
    logp(replayed), docs/design.md §3)."""
    means = {**loss_metrics, LOSS: loss, POLICY_ENTROPY: entropy}
    weights = {**loss_weights, POLICY_ENTROPY: tokens}
    if shift is not None:
        valid_scale = shift.scale[mask.bool()].double()
        n = max(valid_scale.numel(), 1)
        floored = (valid_scale <= shift.floor).sum().item() / n
        means.update({RATIO_ROUTER_SHIFT_SCALE: valid_scale.sum().item() / n, RATIO_ROUTER_SHIFT_FLOOR_FRAC: floored})
        weights.update({RATIO_ROUTER_SHIFT_SCALE: tokens, RATIO_ROUTER_SHIFT_FLOOR_FRAC: tokens})
    parts = Partial().add("mean", mean_parts(means, weights))
    parts.add("ratio", ratio_parts(logp=logp, old_logp=old_logp, mask=mask))
    if routes is None:
        return parts
    native, old = routes.native, routes.old
    overlap = route_overlap(native, old)  # (b, T, L), shared by the three old-vs-new metrics
    buckets = -(-max_new_tokens // position_bucket)
    parts.add("old_vs_new", compare_parts(native, old, overlap=overlap))
    parts.add(
        "position", position_parts(native, old, mask, prompt_len - 1, position_bucket, buckets=buckets, overlap=overlap)
    )
    parts.add("shift", Partial(rows={"gaps": router_shift_gaps(routes.old_scores, routes.scores, old, mask)}))
    parts.add("margin_flips", flip_margin_parts(old, native, routes.old_margins, overlap=overlap))
    parts.add("move", movement_parts(routes.old_scores, routes.scores, old, native, overlap=overlap))
    if routes.replay is not None:
        assert routes.used is not None  # recorded by every replayed pass
        parts.add("native_vs_replayed", compare_parts(native, routes.replay))
        parts.add("used_vs_cached", compare_parts(routes.used, routes.replay))
    if routes.fallback is not None:
        refilled, slots = routes.fallback.double()
        parts.add("fallback", Partial(sums={"refilled": refilled, "slots": slots}))
    if split is not None:
        # over the fully native pass and the replayed one (R2: the old routes, R3: the rollout's), on the rows
        # the split scored; a token's route changed where the two passes' routes differ
        pick = split.rows

        def scored(x: _Rows) -> _Rows:
            return x if pick is None else x[pick]

        if routes.replay is None:
            native_logp, replayed_logp, native_routes, replayed = scored(logp), split.logp, scored(native), scored(old)
        else:
            native_logp, replayed_logp = split.logp, scored(logp)
            native_routes, replayed = split.routes, scored(routes.replay)
        parts.add(
            "split",
            ratio_split_parts(
                native_logp=native_logp,
                replayed_logp=replayed_logp,
                old_logp=scored(old_logp),
                mask=scored(mask),
                flipped=route_overlap(native_routes, replayed) < native.top_k,  # (s, T, L): per MoE layer
                clipped=scored(split.clipped),
            ),
        )
    return parts


def update_finalize(
    parts: Partial, loss_keys: list[str], grad_norm: float, *, position_bucket: int
) -> dict[str, float]:
    """An update's metrics from its pooled partial statistics (`update_parts`): the loss's (`loss_keys`),
    the ratio statistics, loss, gradient norm and entropy, and the route/ metrics of an MoE model."""
    pooled = mean_finalize(parts.sub("mean"))
    metrics = {k: pooled[k] for k in loss_keys}
    metrics.update({k: pooled[k] for k in (RATIO_ROUTER_SHIFT_SCALE, RATIO_ROUTER_SHIFT_FLOOR_FRAC) if k in pooled})
    metrics.update(ratio_finalize(parts.sub("ratio")))
    metrics.update({LOSS: pooled[LOSS], OPTIM_GRAD_NORM: grad_norm, POLICY_ENTROPY: pooled[POLICY_ENTROPY]})
    if "shift/gaps" in parts.rows:  # an MoE model
        metrics.update(route_finalize(parts, position_bucket))
    return metrics


def route_finalize(parts: Partial, position_bucket: int) -> dict[str, float]:
    """An update's route/ metrics (and the ratio split) from its pooled partial statistics."""
    metrics = {route_key(OLD_VS_NEW, k): v for k, v in compare_finalize(parts.sub("old_vs_new")).items()}
    metrics.update(
        {route_key(OLD_VS_NEW, k): v for k, v in position_finalize(parts.sub("position"), position_bucket).items()}
    )
    metrics.update({route_key(OLD_VS_NEW, k): v for k, v in shift_summary(parts.rows["shift/gaps"]).items()})
    metrics.update({ROUTE_PREFIX + k: v for k, v in flip_margin_finalize(parts.sub("margin_flips")).items()})
    metrics.update({ROUTE_PREFIX + k: v for k, v in movement_finalize(parts.sub("move")).items()})
    if _has(parts, "native_vs_replayed"):
        metrics.update(
            {route_key(NATIVE_VS_REPLAYED, k): v for k, v in compare_finalize(parts.sub("native_vs_replayed")).items()}
        )
        used_vs_cached = compare_finalize(parts.sub("used_vs_cached"))
        metrics[ROUTE_USED_VS_CACHED_FLIP_RATE] = used_vs_cached[FLIP_RATE]
        metrics[ROUTE_REPLAY_REPLACE_RATE] = used_vs_cached[EXPERT_FLIP_FRAC]
    if _has(parts, "fallback"):
        fallback = parts.sub("fallback").sums
        metrics[ROUTE_REPLAY_FALLBACK_FRAC] = (fallback["refilled"] / fallback["slots"].clamp(min=1)).item()
    if _has(parts, "split"):
        metrics.update(ratio_split_finalize(parts.sub("split")))
        metrics.update({k + WEIGHT_SUFFIX: w for k, w in ratio_split_weights(parts.sub("split")).items()})
    return metrics


# --- one step ---------------------------------------------------------------------------------


def step_parts(
    *,
    rewards: Tensor,
    errors: float,
    rollout: Rollout,
    old: OldPass,
    seconds: dict[str, float],
    replays_rollout: bool,
    correction: EngineWeight | None,
    instruments: bool = True,
) -> Partial:
    """One process's partial statistics of a step: response lengths, rewards and reward errors, the
    phases' seconds (maxima), the rollout policy's gap to the trainer (`rollout` vs the `old` pass), and
    for an MoE model on a step that runs the route instruments (`instruments`, `metrics.route_every`) the
    old pass's margins and confidence, the share of tokens the rollout's routes leave to the live router
    (where the updates replay them: `replays_rollout`) and rollout vs old routes; the engine-gap
    `correction`'s weight and its truncated and masked tokens."""
    mask, old_routes = rollout.response_mask, old.routes
    parts = Partial(
        sums={
            "length": mask.sum(-1).float().sum(),
            "rows": torch.tensor(len(mask)),
            "errors": torch.tensor(errors, dtype=torch.float64),
        },
        maxima={k: torch.tensor(v, dtype=torch.float64) for k, v in seconds.items()},
        rows={"rewards": rewards},
    )
    # the rollout policy's (engine's) gap to the trainer, per completion token (moe_rl.metrics.stats.rollout_gap_stats)
    parts.add("gap", rollout_gap_parts(rollout_logp=rollout.rollout_logp, train_logp=old.logp, mask=mask))
    if old_routes is not None and instruments:
        parts.add("margins", margin_parts(old.margins, old_routes.mask))
        parts.add("confidence", confidence_parts(old.scores, old_routes))
        if replays_rollout:
            assert rollout.routes is not None  # a mode that replays the rollout's routes records them
            parts.add("fallback", fallback_parts(rollout.routes, rollout.token_mask))
    if correction is not None:
        sums = {
            "weight": (correction.weight.double() * mask).sum(),
            "truncated": correction.truncated.sum(),
            "masked": correction.masked.sum(),
            "tokens": mask.sum().double(),
        }
        parts.add("is", Partial(sums=sums))
    if rollout.routes is not None and old_routes is not None and instruments:
        parts.add("rollout_vs_old", compare_parts(rollout.routes, old_routes))
    return parts


def step_finalize(
    parts: Partial, updates: list[dict[str, float]], *, group_size: int, engine_part: bool
) -> dict[str, float]:
    """A step's metrics: its updates' (`aggregate`) and those of its pooled partial statistics (`step_parts`);
    `engine_part`: the rollout policy is not the trained one, so the ratio split has an engine part."""
    metrics = aggregate(updates)
    sums, all_rewards = parts.sums, parts.rows["rewards"]
    if _has(parts, "rollout_vs_old"):
        metrics.update(
            {route_key(ROLLOUT_VS_OLD, k): v for k, v in compare_finalize(parts.sub("rollout_vs_old")).items()}
        )
    metrics.update(
        {
            REWARD_ZERO_VAR_GROUP_FRAC: zero_variance_frac(all_rewards, group_size),
            REWARD_ERRORS: sums["errors"].item(),
            REWARD_MEAN: all_rewards.mean().item(),
            REWARD_STD: all_rewards.std(unbiased=False).item(),
            **rollout_gap_finalize(parts.sub("gap")),
            ROLLOUT_RESPONSE_LEN: (sums["length"] / sums["rows"]).item(),
            **{k: v.item() for k, v in parts.maxima.items() if k.startswith(TIME_PREFIX)},
        }
    )
    if _has(parts, "margins"):
        metrics.update(
            {**margin_finalize(parts.sub("margins")), ROUTE_CONFIDENCE: confidence_finalize(parts.sub("confidence"))}
        )
        if _has(parts, "fallback"):
            metrics[ROUTE_R3_FALLBACK_FRAC] = fallback_finalize(parts.sub("fallback"))
    if "is/tokens" in sums:
        tokens = sums["is/tokens"].clamp(min=1).item()
        metrics[ROLLOUT_IS_WEIGHT_MEAN] = sums["is/weight"].item() / tokens
        metrics[ROLLOUT_IS_TRUNCATED_FRAC] = sums["is/truncated"].item() / tokens
        metrics[ROLLOUT_IS_MASKED_FRAC] = sums["is/masked"].item() / tokens
    if not engine_part:  # the trainer sampled
        del metrics[RATIO_SPLIT_ENGINE_VAR]
    return metrics


def _has(parts: Partial, prefix: str) -> bool:
    """Whether `parts` holds a family under `prefix/` (the parts functions add only what applies)."""
    start = f"{prefix}/"
    return any(k.startswith(start) for d in (parts.sums, parts.maxima, parts.rows) for k in d)


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
