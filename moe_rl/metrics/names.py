"""Every metric the harness logs, named and defined once.

The loop, the analysis and the report take metric keys from the constants here, and `METRICS`
defines each one. The metric table is rendered from `METRICS` into one page, docs/metrics.md, between
two marker lines (`PAGE`; other pages link to it); a test fails when it differs. After changing a
definition, rewrite it with

    python -m moe_rl.metrics.table --write

A key may be a pattern: `{pair}` is one of `PAIRS`, `{i}` a MoE layer (0-based, model order), `{p}` a
completion position bucket and `{b}` a margin bin of `moe_rl.metrics.bins.MARGIN_EDGES`. `defines(key)`
says whether a logged key has a definition here. Torch-free, so that the analysis can import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# --- route comparison pairs: `route/{pair}/...` ---------------------------------------------------
ROLLOUT_VS_OLD = "rollout_vs_old"
OLD_VS_NEW = "old_vs_new"
NATIVE_VS_REPLAYED = "native_vs_replayed"
USED_VS_CACHED = "used_vs_cached"

PAIRS = {
    ROLLOUT_VS_OLD: "routes of the rollout (generation) vs the old-policy pass over the same tokens: the "
    "inference/training gap",
    OLD_VS_NEW: "the current policy's own routes vs the old-policy pass, after each update (also under replay, "
    "where the router's choice is read before it is overridden): staleness",
    NATIVE_VS_REPLAYED: "inside a replayed pass: what the router would have chosen vs what was forced",
    USED_VS_CACHED: "the routes the experts actually received vs the cached ones (flip rate only)",
}

# names of the route comparison statistics (keys of `moe_rl.routing.compare_routes`)
FLIP_RATE = "flip_rate"
EXPERT_FLIP_FRAC = "expert_flip_frac"
TOKEN_FLIP_RATE = "token_flip_rate"


ROUTE_PREFIX = "route/"


def route_key(pair: str, name: str) -> str:
    """`route/{pair}/{name}`, e.g. `route_key(OLD_VS_NEW, FLIP_RATE)`."""
    return f"{ROUTE_PREFIX}{pair}/{name}"


def layer_key(key: str, i: int | str) -> str:
    """The per-layer value of `key` at MoE layer `i`."""
    return f"{key}/layer_{i}"


OFFPOLICY_SUFFIX = "/offpolicy"


def offpolicy_key(key: str) -> str:
    """`key` averaged over the off-policy updates 2..N only."""
    return key + OFFPOLICY_SUFFIX


# --- routes ----------------------------------------------------------------------------------------
ROUTE_FLIP_RATE = route_key(OLD_VS_NEW, FLIP_RATE)
ROUTE_EXPERT_FLIP_FRAC = route_key(OLD_VS_NEW, EXPERT_FLIP_FRAC)
ROUTE_TOKEN_FLIP_RATE = route_key(OLD_VS_NEW, TOKEN_FLIP_RATE)
ROUTE_USED_VS_CACHED_FLIP_RATE = route_key(USED_VS_CACHED, FLIP_RATE)
# expert load and router statistics (moe_rl.routing.expert_load)
ROUTE_LOAD_ENTROPY = "route/load/entropy"
ROUTE_LOAD_MAX_SHARE = "route/load/max_share"
ROUTE_LOAD_DEAD_FRAC = "route/load/dead_frac"
ROUTE_LOAD_SHIFT = "route/load/shift"
ROUTE_ROUTER_LOGIT_RMS = "route/router/logit_rms"
ROUTE_ROUTER_Z = "route/router/z"
OPTIM_ROUTER_DRIFT = "optim/router_drift"
OPTIM_EXPERT_STEP_RMS = "optim/expert_step/rms"
OPTIM_EXPERT_STEP_LOW_OVER_HIGH = "optim/expert_step/low_over_high"
# per update, `{prefix}layer_{i}/expert_{e}`: 1 if the expert was routed any token (p_e over updates); its move if so
OPTIM_EXPERT_ACTIVE = "optim/expert_step/active/"
OPTIM_EXPERT_MOVE_ACTIVE = "optim/expert_step/move_active/"
ROUTE_REPLAY_REPLACE_RATE = "route/replay_replace_rate"
ROUTE_R3_FALLBACK_FRAC = "route/r3_fallback_frac"
ROUTE_CONFIDENCE = "route/confidence"
ROUTE_MARGIN_MEAN = "route/margin_mean"
ROUTE_MARGIN_P10 = "route/margin_p10"
ROUTE_SHIFT_MEAN = route_key(OLD_VS_NEW, "shift/mean")
ROUTE_SHIFT_P10 = route_key(OLD_VS_NEW, "shift/p10")
FLIP_VS_MARGIN_PREFIX = "route/flip_vs_margin/"
FLIP_VS_MOVE_PREFIX = FLIP_VS_MARGIN_PREFIX + "move/"


def position_key(p: int | str) -> str:
    """Old-vs-new flip rate of the inputs that predict completion tokens p.. (one position bucket)."""
    return f"{ROUTE_FLIP_RATE}/pos_{p}"


def margin_bin_key(count: str, b: int | str) -> str:
    """`route/flip_vs_margin/{count}/bin_{b}`, `count` one of "n" (pairs seen) and "flips"."""
    return f"{FLIP_VS_MARGIN_PREFIX}{count}/bin_{b}"


def move_bin_key(count: str, b: int | str) -> str:
    """`route/flip_vs_margin/move/{count}/bin_{b}`, `count` one of "n" (pairs seen) and "flips"."""
    return f"{FLIP_VS_MOVE_PREFIX}{count}/bin_{b}"


# --- importance ratios and KL ----------------------------------------------------------------------
RATIO_TOKEN_VAR = "ratio/token_var"
RATIO_TOKEN_MAX = "ratio/token_max"
RATIO_SEQ_VAR = "ratio/seq_var"
RATIO_ESS = "ratio/ess"
RATIO_EXTREME_FRAC = "ratio/extreme_frac"
RATIO_CLIPFRAC_LOW = "ratio/clipfrac_low"
RATIO_CLIPFRAC_HIGH = "ratio/clipfrac_high"
KL_K3 = "kl/k3"
KL_REF_K3 = "kl/ref_k3"
KL_UPDATE_K3 = (
    "kl/update_k3"  # the realised per-update divergence: the calibration's axis (experiments/calibrate_kl.py)
)
KL_UPDATE_K3_ACTING = "kl/update_k3/acting"  # the same step under the routes the policy acts with (anchored runs)
# its early window, steps 1..20: scored on every update there (metrics.update_kl_window), read there
KL_EARLY_STEPS = 20
# the token log-ratio split into a routing, a weights and an engine part (moe_rl.metrics.ratio_stats.ratio_split_parts)
RATIO_SPLIT_ROUTING_VAR = "ratio/split/routing_var"
RATIO_SPLIT_WEIGHTS_VAR = "ratio/split/weights_var"
RATIO_SPLIT_COV = "ratio/split/cov"
RATIO_SPLIT_ROUTING_SHARE = "ratio/split/routing_share"
RATIO_SPLIT_FLIPPED_MASS = "ratio/split/flipped_mass"
RATIO_SPLIT_FLIP_LOGP = "ratio/split/flip_logp"
RATIO_SPLIT_ENGINE_VAR = "ratio/split/engine_var"
CLIP_FLIPPED_SHARE = "clip/flipped_share"

# --- reward, task, optimisation, rollout, time -----------------------------------------------------
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
REWARD_ZERO_VAR_GROUP_FRAC = "reward/zero_var_group_frac"
REWARD_ERRORS = "reward/errors"
TASK_ACCURACY = "task/accuracy"
POLICY_ENTROPY = "policy/entropy"
OPTIM_GRAD_NORM = "optim/grad_norm"
LOSS = "loss"
LOSS_POLICY = "loss/policy"
LOSS_OFFPOLICY_SEQ_MASKED_FRAC = "loss/offpolicy_seq_masked_frac"
LOSS_AUX = "loss/aux"
LOSS_ROUTER_Z = "loss/router_z"
ROLLOUT_LOGP_GAP = "rollout/logp_gap"
ROLLOUT_TOKEN_MULT_PROB_ERROR = "rollout/token_mult_prob_error"
ROLLOUT_LOGP_GAP_OVER_LN2 = "rollout/logp_gap_over_ln2"
# the rollout/trainer mismatch under the names peers log (AReaL, NeMo-RL)
ROLLOUT_LOGP_GAP_OVER_LN5 = "rollout/logp_gap_over_ln5"
ROLLOUT_K3_KL = "rollout/k3_kl"
ROLLOUT_LOGP_ABS_DIFF = "rollout/logp_abs_diff"
ROLLOUT_LOGP_SQ_DIFF = "rollout/logp_sq_diff"
ROLLOUT_RESPONSE_LEN = "rollout/response_len"
ROLLOUT_ENGINE_STALENESS = "rollout/engine_staleness"
ROLLOUT_ENGINE_SYNC_MAX_DIFF = "rollout/engine_sync_max_diff"
ROLLOUT_ENGINE_SYNC_OFF_TOKENS = "rollout/engine_sync_off_tokens"
ROLLOUT_ENGINE_SYNC_ROUTE_DIFFS = "rollout/engine_sync_route_diffs"
TIME_PREFIX = "time/"
TIME_ROLLOUT_S = "time/rollout_s"
TIME_OLD_LOGP_S = "time/old_logp_s"
TIME_UPDATE_S = "time/update_s"
TIME_EVAL_S = "time/eval_s"
TIME_ENGINE_SYNC_S = "time/engine_sync_s"
ROUTE_MOVE_RMS = "route/old_vs_new/move/rms"
ROUTE_REPLAY_FALLBACK_FRAC = "route/replay_fallback_frac"
RATIO_ROUTER_SHIFT_SCALE = "ratio/router_shift_scale"
RATIO_ROUTER_SHIFT_FLOOR_FRAC = "ratio/router_shift_floor_frac"
ROLLOUT_IS_WEIGHT_MEAN = "rollout/is_weight_mean"
ROLLOUT_IS_TRUNCATED_FRAC = "rollout/is_truncated_frac"
ROLLOUT_IS_MASKED_FRAC = "rollout/is_masked_frac"


def pass_at_key(k: int | str) -> str:
    """`eval/pass@{k}`: unbiased pass@k on the held-out split."""
    return f"eval/pass@{k}"


# The ratio split's metrics (moe_rl.metrics.ratio_stats.ratio_split_finalize), in the order it returns them.
SPLIT_KEYS = (
    RATIO_SPLIT_ROUTING_VAR,
    RATIO_SPLIT_WEIGHTS_VAR,
    RATIO_SPLIT_COV,
    RATIO_SPLIT_ROUTING_SHARE,
    RATIO_SPLIT_FLIPPED_MASS,
    CLIP_FLIPPED_SHARE,
    RATIO_SPLIT_FLIP_LOGP,
)

# Also logged averaged over the off-policy updates 2..N only, as `{key}/offpolicy`: update 1 runs on
# the old policy's weights, so its flips and ratio spread are ~0 and dilute the step mean by (N-1)/N.
OFFPOLICY_KEYS = (
    ROUTE_FLIP_RATE,
    ROUTE_EXPERT_FLIP_FRAC,
    ROUTE_TOKEN_FLIP_RATE,
    ROUTE_SHIFT_MEAN,
    RATIO_TOKEN_VAR,
    RATIO_SEQ_VAR,
    KL_K3,
    ROUTE_MOVE_RMS,
    *SPLIT_KEYS,
)


@dataclass(frozen=True)
class Metric:
    """One logged key (or key pattern) and what it measures, as one line of markdown."""

    key: str
    meaning: str
    per_layer: bool = False  # also logged per MoE layer as `{key}/layer_{i}`


METRICS: tuple[Metric, ...] = (
    Metric(
        ROUTE_LOAD_ENTROPY,
        "normalised entropy `H(p_l) / log E` of the expert load `p_l(e)` (share of the update pass's valid (token, "
        "slot) assignments expert e received at MoE layer l); 1 = balanced",
        per_layer=True,
    ),
    Metric(
        ROUTE_LOAD_MAX_SHARE,
        "`max_e p_l(e)`: the busiest expert's share of the load (1/E when balanced)",
        per_layer=True,
    ),
    Metric(ROUTE_LOAD_DEAD_FRAC, "share of experts whose load is under `1 / (10 E)`", per_layer=True),
    Metric(
        ROUTE_LOAD_SHIFT,
        "total-variation distance `1/2 sum_e |p_old(e) - p_new(e)|` between the old pass's and the update's load",
        per_layer=True,
    ),
    Metric(
        ROUTE_ROUTER_LOGIT_RMS, "root mean square of the router logits over valid tokens and experts", per_layer=True
    ),
    Metric(
        ROUTE_ROUTER_Z,
        "ST-MoE's z statistic (arXiv 2202.08906): mean over valid tokens of `logsumexp(router logits)^2`",
        per_layer=True,
    ),
    Metric(
        OPTIM_ROUTER_DRIFT,
        "relative Frobenius distance `||W_l - W_l(0)|| / ||W_l(0)||` of each router's weights from the cold start",
        per_layer=True,
    ),
    Metric(
        OPTIM_EXPERT_STEP_RMS,
        "RMS of each expert's move over the step (its N optimizer updates), mean over experts and layers; an "
        "instrumented step holds a whole copy of the expert weights on every rank (under FSDP too)",
    ),
    Metric(
        OPTIM_EXPERT_STEP_LOW_OVER_HIGH,
        "mean move RMS of the experts that were routed fewer than their layer's median (token, slot) assignments "
        "in the step (the replayed routes, else the old pass's: the updates' own routes differ by the flips "
        "within the step) over that of the rest (1: AdamW moves an expert as far whatever its tokens; below 1: "
        "the move grows with the tokens)",
    ),
    Metric(
        OPTIM_EXPERT_ACTIVE + "layer_{i}/expert_{e}",
        "share of the step's updates in which expert e of MoE layer i received any (token, slot) assignment (the "
        "routes the experts received, pooled over processes): p_e; instrumented steps only",
    ),
    Metric(
        OPTIM_EXPERT_MOVE_ACTIVE + "layer_{i}/expert_{e}",
        "RMS of that expert's move in one update (w_after - w_before of the update), mean over the step's updates "
        "in which it was active (the 1/sqrt(p_e) prediction's outcome); absent if it was active in none",
    ),
    Metric(route_key("{pair}", FLIP_RATE), "mean over valid (t, l) of `1[S_a != S_b]`", per_layer=True),
    Metric(route_key("{pair}", EXPERT_FLIP_FRAC), "mean over valid (t, l) of `1 - |S_a ∩ S_b| / k`", per_layer=True),
    Metric(route_key("{pair}", TOKEN_FLIP_RATE), "mean over valid t of `1[exists l: S_a != S_b]`"),
    Metric(
        position_key("{p}"),
        "old-vs-new flip rate over the inputs that predict completion tokens p .. p + `position_bucket` - 1 "
        "(default 4; p = 0 is the last prompt token)",
    ),
    Metric(
        ROUTE_USED_VS_CACHED_FLIP_RATE,
        "flip rate of the routes the experts received vs the cached ones: 0 whenever replay works",
    ),
    Metric(
        ROUTE_MARGIN_MEAN,
        "mean over valid (t, l) of the gap between the k-th and (k+1)-th router probability "
        "in the old pass (small margins predict flips)",
    ),
    Metric(ROUTE_MARGIN_P10, "10th percentile of the same margins"),
    Metric(
        ROUTE_SHIFT_MEAN,
        "router shift (RSPO, arXiv 2510.23027), mean over valid completion tokens of "
        "`gamma_t = exp(-(1/L) sum_l (1/k) sum_{e in S_old(t,l)} |log p_new(e) - log p_old(e)|)`, with `p` the "
        "router's selection probabilities and `S_old` the old pass's top-k; 1 = the router put the same "
        "probability on every previously activated expert, smaller = it moved",
    ),
    Metric(ROUTE_SHIFT_P10, "10th percentile of `gamma_t` over valid completion tokens"),
    Metric(
        route_key(OLD_VS_NEW, "shift/layer_{i}"),
        "router shift of MoE layer i alone (`gamma_t` with L = 1), mean over valid completion tokens",
    ),
    Metric(
        margin_bin_key("n", "{b}"),
        "valid (t, l) pairs whose old margin lies in bin b of `MARGIN_EDGES` "
        "(0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, inf), summed over updates 2..N of a step",
    ),
    Metric(
        margin_bin_key("flips", "{b}"),
        "those of them whose top-k set flipped; `moe_rl.studies.drift.flip_vs_margin` pools both into P(flip | margin)",
    ),
    Metric(
        RATIO_TOKEN_VAR,
        "population variance of the token ratio `r = exp(delta)` over valid response tokens, "
        "before clipping, with `delta = logp - old_logp`",
    ),
    Metric(RATIO_TOKEN_MAX, "largest token ratio (a step keeps the max over its updates)"),
    Metric(
        RATIO_SEQ_VAR, "population variance, across non-empty sequences, of the GSPO sequence ratio `exp(mean_t delta)`"
    ),
    Metric(RATIO_ESS, "normalised effective sample size `(sum r)^2 / (N sum r^2)`, in (0, 1]"),
    Metric(RATIO_EXTREME_FRAC, "fraction of valid tokens with `|delta| > ln 2`"),
    Metric(
        RATIO_CLIPFRAC_LOW,
        "fraction of valid tokens (GSPO: sequences) on the clipped branch below `1 - eps_low` (CISPO: tokens "
        "whose weight is truncated there, whatever the advantage; DPPO: tokens with a negative advantage masked "
        "because their probability fell past the divergence bound `eps_low`; SAPO and VESPO have no clip: 0)",
    ),
    Metric(
        RATIO_CLIPFRAC_HIGH,
        "fraction of valid tokens (GSPO: sequences) on the clipped branch above `1 + eps_high` (DPPO: a positive "
        "advantage, risen past `eps_high`; CISPO, SAPO, VESPO: as above)",
    ),
    Metric(KL_K3, "`mean(exp(-delta) - 1 + delta)`: the k3 estimate of the old/new policy gap"),
    Metric(
        KL_UPDATE_K3,
        "per-update KL: k3 estimate of `KL(pi_before || pi_after)` across each optimizer update, on that update's own "
        "tokens: mean over its valid response tokens of `exp(d) - 1 - d`, `d = logp_after - logp_before`, both under "
        "the policy's own routing (the router's choice, also under replay); a step logs the mean over its updates, on "
        "the updates `metrics.update_kl_window` schedules (every update of the early window, steps 1..20, then one "
        "update of each route instruments' step). One "
        "extra no-grad forward of the update's rows after the optimizer step (under replay one more before it, for the "
        "native `logp_before`). Unlike `kl/k3`, which measures how far update u has drifted from the rollout's policy, "
        "this is each update's own step, nonzero at N = 1",
    ),
    Metric(
        KL_UPDATE_K3_ACTING,
        "`kl/update_k3` under the routes the policy acts with where they are not its router's: under anchored routing "
        "(the cold start's routes, forced in the rollout, the old pass and every update), both log-probs under those "
        "routes (`logp_before` is the loss's own; one more no-grad forward after the step). The divergence that acts "
        "on such a policy, which arms are matched on; absent where the policy samples with its own router",
    ),
    Metric(
        KL_REF_K3, "k3 KL to the reference policy (the cold start), aggregated like the loss; only when `algo.beta > 0`"
    ),
    Metric(
        RATIO_SPLIT_ROUTING_VAR,
        "population variance over valid response tokens of the routing part `rho = logp(native) - logp(replayed)`: "
        "one extra no-grad forward per update scores the same tokens with the same weights under the other routing "
        "(the router's own routes when the update replays, the replayed routes, R2's old-pass or R3's rollout "
        "routes, when it does not), on the steps that run the route instruments (`metrics.route_every`; every "
        "`replay.split_every`-th of them) and `metrics.split_rows` seeded rows of each update",
    ),
    Metric(
        RATIO_SPLIT_WEIGHTS_VAR,
        "population variance of the weights part `w = logp(replayed) - old_logp`; `rho + w = logp(native) - old_logp` "
        "is the token log-ratio without replay (the logged `delta` under `replay=none`; under replay `delta = w`)",
    ),
    Metric(RATIO_SPLIT_COV, "population covariance of `rho` and `w` over the same tokens"),
    Metric(
        RATIO_SPLIT_ROUTING_SHARE,
        "routing's share of the token log-ratio variance by the covariance split, `(Var rho + Cov) / Var(rho + w)` "
        "(the weights' share is `(Var w + Cov) / Var(rho + w)`, so the two add to 1); a step pools its updates' shares "
        "weighted by `n Var(rho + w)`, so an update without spread (update 1) weighs nothing",
    ),
    Metric(
        RATIO_SPLIT_FLIP_LOGP,
        "the log-probability change per changed route, in nats: `sum |rho|` over the tokens whose route changed in "
        "some MoE layer, over the number of (token, MoE layer) routes that changed; how much a flipped route moves "
        "a token's log-probability under the same weights (how much experts differ: expert specialisation). `rho` "
        "also carries what a flip at an earlier position passes on through attention; a step weights its updates "
        "by their changed routes",
    ),
    Metric(
        RATIO_SPLIT_FLIPPED_MASS,
        "share of `sum |rho + w|` over valid tokens carried by the tokens whose route changed: native and replayed "
        "routes of the token's own input position differ in some MoE layer (native: the pass without replay, "
        "replayed: the pass with it); a step weights its updates by `sum |rho + w|`. Per layer: the tokens whose "
        "route changed in MoE layer i (a token can count in several layers)",
        per_layer=True,
    ),
    Metric(
        CLIP_FLIPPED_SHARE,
        "share of the tokens the loss clipped (GSPO: every token of a clipped sequence) whose route changed, as in "
        "`ratio/split/flipped_mass`; a step weights its updates by their clipped tokens. Per layer: route changed in "
        "MoE layer i",
        per_layer=True,
    ),
    Metric(
        RATIO_SPLIT_ENGINE_VAR,
        "population variance over completion tokens of the engine part `old_logp - rollout_logp`, per step, when the "
        "rollout policy is not the trained one (`rollout.engine=vllm`, or a `rollout.dtype` other than training's)",
    ),
    Metric(REWARD_MEAN, "mean rollout reward"),
    Metric(REWARD_STD, "population standard deviation of the rollout rewards"),
    Metric(REWARD_ZERO_VAR_GROUP_FRAC, "fraction of prompt groups whose rewards all agree (advantage 0: no signal)"),
    Metric(REWARD_ERRORS, "completions of the step's rollout whose reward function raised (each scored 0)"),
    Metric(
        TASK_ACCURACY,
        "greedy accuracy on the held-out split, every `eval_every` steps (NaN in between in a wide frame)",
    ),
    Metric(
        POLICY_ENTROPY,
        "mean token entropy of the policy over valid response tokens, per update, averaged over the step",
    ),
    Metric(OPTIM_GRAD_NORM, "gradient norm before clipping, per update, averaged over the step"),
    Metric(
        LOSS,
        "the loss that was minimised (policy term plus `beta` times the KL term, plus the router terms `loss/aux` "
        "and `loss/router_z` times their coefficients when they are on), averaged over the step's updates",
    ),
    Metric(LOSS_POLICY, "the clipped policy term alone, without the KL term"),
    Metric(
        LOSS_OFFPOLICY_SEQ_MASKED_FRAC,
        "fraction of the update's non-empty sequences the off-policy sequence mask drops (DeepSeek-V3.2, arXiv "
        "2512.02556 eq. 9): a negative advantage and a mean `log(pi_old / pi)` over its tokens above "
        "`algo.offpolicy_mask_delta`; only when that is set",
    ),
    Metric(
        LOSS_AUX,
        "the family's load-balancing loss (transformers' `aux_loss`, Switch Transformer arXiv 2101.03961) on the "
        "update's tokens, unscaled; `loss` adds `algo.aux_loss_coef` times it (logged when that is > 0)",
    ),
    Metric(
        LOSS_ROUTER_Z,
        "ST-MoE's router z-loss (arXiv 2202.08906): mean over the update's tokens and MoE layers of "
        "`logsumexp(router logits)^2`, unscaled; `loss` adds `algo.router_z_loss_coef` times it (logged when that "
        "is > 0)",
    ),
    Metric(ROLLOUT_LOGP_GAP, "mean `|rollout logp - old logp|` over completion tokens (the inference/training gap)"),
    Metric(ROLLOUT_RESPONSE_LEN, "mean completion length in tokens"),
    Metric(TIME_ROLLOUT_S, "wall seconds of the rollout (sampling, decoding, rewards, advantages)"),
    Metric(TIME_OLD_LOGP_S, "wall seconds of the old-policy pass"),
    Metric(TIME_UPDATE_S, "wall seconds of the step's N updates"),
    Metric(TIME_EVAL_S, "wall seconds of an evaluation"),
    Metric(
        ROUTE_MOVE_RMS,
        "router-logit movement at the top-k boundary per update: with `e_k`, `e_{k+1}` the old pass's k-th and "
        "(k+1)-th experts and `g = log p_old(e_k) - log p_old(e_{k+1})` their logit gap, the RMS over valid "
        "(token, layer) of how much the update changed that gap (also per layer: `route/old_vs_new/move/layer_{i}`)",
    ),
    Metric(route_key(OLD_VS_NEW, "move/layer_{i}"), "the same movement at MoE layer i alone"),
    Metric(
        move_bin_key("n", "{b}"),
        "valid (t, l) pairs whose `x = g / move/layer_{l}` lies in bin b of `MOVE_EDGES` "
        "(0, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 10, inf), summed over updates 2..N of a step",
    ),
    Metric(move_bin_key("flips", "{b}"), "those of them whose top-k set flipped (`moe_rl.forecast`)"),
    Metric(
        ROLLOUT_TOKEN_MULT_PROB_ERROR,
        "mean over completion tokens of `exp(|rollout logp - old logp|)`: 1 when the rollout policy is the trained one",
    ),
    Metric(
        ROLLOUT_LOGP_GAP_OVER_LN2,
        "fraction of completion tokens with `|rollout logp - old logp| > ln 2` (probabilities off by more than 2x)",
    ),
    Metric(
        ROLLOUT_LOGP_GAP_OVER_LN5,
        "fraction of completion tokens with `|rollout logp - old logp| > ln 5` (probabilities off by more than 5x)",
    ),
    Metric(
        ROLLOUT_K3_KL,
        "k3 estimate of KL(rollout policy || trained policy) on the rollout's own samples: mean over completion tokens "
        "of `exp(e) - 1 - e` with `e = old logp - rollout logp` (AReaL's and slime's mismatch KL)",
    ),
    Metric(
        ROLLOUT_LOGP_ABS_DIFF,
        "mean over completion tokens of `|e|`: the same number as `rollout/logp_gap`, under AReaL's name",
    ),
    Metric(ROLLOUT_LOGP_SQ_DIFF, "mean over completion tokens of `e^2`"),
    Metric(
        ROUTE_CONFIDENCE,
        "routing confidence (prime-rl's `routing_confidence`, after Step 3.5 Flash, arXiv 2602.10604): mean over "
        "valid (t, l) of the old pass of the router's selection probability mass on its top-k, "
        "`sum_{e in S_old(t,l)} p_old(e)` (1 when the router puts all its mass on the chosen experts)",
    ),
    Metric(
        ROUTE_R3_FALLBACK_FRAC,
        "`replay=r3`: fraction of the rollout's real input tokens whose replayed route is missing (vLLM's -1 "
        "prefix-cached positions), so the live router routes them (NeMo-RL's "
        "`r3/routed_experts_fallback_token_route_fraction`)",
    ),
    Metric(
        ROUTE_REPLAY_REPLACE_RATE,
        "under replay: share of the replayed (t, l, slot) whose expert the pass did not use; prime-rl's "
        "`router_replay_replace_rate`, which counts the slots its score filter overrides. The harness replays "
        "without a filter, so this is `route/used_vs_cached/expert_flip_frac`: 0 whenever replay works",
    ),
    Metric(ROLLOUT_ENGINE_STALENESS, "`rollout.engine=vllm`: steps since the engine last took the trainer's weights"),
    Metric(
        ROLLOUT_ENGINE_SYNC_MAX_DIFF,
        "`rollout.engine=vllm`: largest |engine logp - trainer logp| on the step's rollout, checked after the first syncs",
    ),
    Metric(
        ROLLOUT_ENGINE_SYNC_OFF_TOKENS,
        "`rollout.engine=vllm`, float32: response tokens whose |engine logp - trainer logp| exceeds the per-token "
        "sync tolerance on a checked sync (near-ties routed differently; a failed sync moves every token and stops the run)",
    ),
    Metric(
        ROLLOUT_ENGINE_SYNC_ROUTE_DIFFS,
        "`rollout.engine=vllm` with recorded routes: (token, layer) pairs whose top-k set the engine and the trainer's "
        "routers chose differently on a checked sync",
    ),
    Metric(TIME_ENGINE_SYNC_S, "`rollout.engine=vllm`: wall seconds of the step's in-place weight sync"),
    Metric(
        ROUTE_REPLAY_FALLBACK_FRAC,
        "`replay.mode=r2_threshold|r3_threshold`: share of the replayed expert slots (valid t, every layer "
        "and slot) whose live router score fell below `replay.threshold` times the weakest live top-k "
        "score, so a live top-k expert took the slot",
    ),
    Metric(
        RATIO_ROUTER_SHIFT_SCALE,
        "`algo.router_shift=true` (RSPO): mean over valid response tokens of the constant factor "
        "`max(gamma_t, algo.router_shift_floor)` the token ratio was scaled by",
    ),
    Metric(RATIO_ROUTER_SHIFT_FLOOR_FRAC, "`algo.router_shift=true`: fraction of those tokens held at the floor"),
    Metric(
        ROLLOUT_IS_WEIGHT_MEAN,
        "`rollout.is_correction` set: mean over valid completion tokens of the engine-gap weight applied to "
        "each token's policy term (the behaviour/trainer ratio `exp(old logp - rollout logp)`, corrected); under "
        "`rollout.policy_lag` > 0 without one, the plain pi_prox / pi_behav of the decoupled loss",
    ),
    Metric(
        ROLLOUT_IS_TRUNCATED_FRAC,
        "`rollout.is_correction=tis`: fraction of valid completion tokens whose weight was truncated at the cap",
    ),
    Metric(
        ROLLOUT_IS_MASKED_FRAC,
        "`rollout.is_correction=mis|icepop`: fraction of valid completion tokens whose weight was set to 0",
    ),
    Metric(
        pass_at_key("{k}"),
        "unbiased pass@k on the held-out split from `pass_at_k.n` samples per problem (only when `pass_at_k.k` is set)",
    ),
)

_WILDCARDS = {
    "{pair}": "(?:" + "|".join(PAIRS) + ")",
    "{i}": r"\d+",
    "{e}": r"\d+",
    "{p}": r"\d+",
    "{b}": r"\d+",
    "{k}": r"\d+",
}


def _pattern(metric: Metric) -> str:
    pattern = re.escape(metric.key)
    for field, regex in _WILDCARDS.items():
        pattern = pattern.replace(re.escape(field), regex)
    suffixes = [r"/layer_\d+"] if metric.per_layer else []
    if any(re.fullmatch(pattern, key) for key in OFFPOLICY_KEYS):
        suffixes.append(re.escape(OFFPOLICY_SUFFIX))
    return pattern + (f"(?:{'|'.join(suffixes)})?" if suffixes else "")


_DEFINED = re.compile("|".join(f"(?:{_pattern(m)})" for m in METRICS))


def defines(key: str) -> bool:
    """Whether `key`, as logged, has a definition in `METRICS` (patterns and suffixes expanded)."""
    return _DEFINED.fullmatch(key) is not None
