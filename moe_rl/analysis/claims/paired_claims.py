"""The claims that compare arms on paired runs, each a `PairedClaim` declaration (2, 3, 5 and 7)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from moe_rl.analysis.claims.cells import (
    START_STEPS,
    ladder_pairs,
    load_experiment,
    low_precision_large_n,
    offpolicy_runs,
)
from moe_rl.analysis.claims.paired import COLLAPSE_OUTCOMES, AlsoOn, PairedClaim
from moe_rl.analysis.claims.rules import (
    ACCURACY_DEFINITION,
    ACCURACY_MARGIN,
    COLLAPSE_MARGIN,
    INCONCLUSIVE,
    UNTESTABLE_HERE,
)
from moe_rl.metrics.names import (
    FLIP_RATE,
    ROLLOUT_LOGP_GAP,
    ROLLOUT_LOGP_GAP_OVER_LN2,
    ROLLOUT_TOKEN_MULT_PROB_ERROR,
    ROLLOUT_VS_OLD,
    TOKEN_FLIP_RATE,
    route_key,
)

# claim 5's measured gap, a note beside its verdict

R3_PAPER_GAP = "~10% of routers and 94% of tokens route differently between inference and training (Qwen3-30B-A3B)"
ENGINE_GAP_KEYS = (
    ROLLOUT_LOGP_GAP,
    ROLLOUT_TOKEN_MULT_PROB_ERROR,
    ROLLOUT_LOGP_GAP_OVER_LN2,
    route_key(ROLLOUT_VS_OLD, FLIP_RATE),
    route_key(ROLLOUT_VS_OLD, TOKEN_FLIP_RATE),
)


def engine_gap(root: Path) -> list[str]:
    """Mean engine/trainer gap over all steps and runs of engine_mismatch (per-run means, then the mean), beside
    the R3 paper's: a different scale, shown, not compared."""
    df = load_experiment(root, "engine_mismatch", list(ENGINE_GAP_KEYS))
    if df is None or df.empty:
        return []
    means = df.groupby(["run", "key"])["value"].mean().groupby("key").mean()
    parts = [f"{k.split('/', 1)[1]} {means[k]:.3g}" for k in ENGINE_GAP_KEYS if k in means]
    return [
        "measured engine (vLLM, bfloat16) vs trainer (float32) gap, mean over steps and runs: "
        + "; ".join(parts)
        + f". The R3 paper reports {R3_PAPER_GAP}: a different scale (a 30B model, long sequences), shown "
        "side by side, not compared"
    ]


FAMILY_PHASES = {"phase_mixtral": "mixtral"}  # phase maps of other families: claims 2 and 3 per family and pooled
FAMILY_NOTES = tuple(
    note
    for experiment, family in FAMILY_PHASES.items()
    for note in (
        AlsoOn(experiment, f"{family} alone ({experiment}): **{{verdict}}** ({{reason}}); {{statistic}}"),
        AlsoOn(
            experiment,
            f"{{families}} and {family} pooled (phase and {experiment}, pairs within a family): **{{verdict}}** "
            "({reason}); {statistic}",
            pooled=True,
        ),
    )
)
OFFPOLICY_NO_ARMS = (INCONCLUSIVE, "no off-policy runs of {missing}")

OFFPOLICY_GRPO = PairedClaim(
    2,
    "Off-policy (N >= 2), GRPO without replay is less stable than GRPO with R2",
    "GSPO 2507.18071; R3 2510.11370",
    "grpo+r2 vs grpo+none, paired by seed in the off-policy (lr, N) cells where the two arms' mean final "
    f"accuracy ends below the cold start's. Primary outcomes: final accuracy ({ACCURACY_DEFINITION}) "
    "and reward AUC (sign-flip test, bootstrap interval) and time to collapse (log-rank stratified on the "
    "pairs), Holm over the three and Bonferroni over the looks at the data. reproduced if one favours R2 at "
    "p < 0.05 and none favours no replay; not reproduced if one favours no replay, or the accuracy and reward "
    f"AUC intervals lie inside ±{ACCURACY_MARGIN}; inconclusive otherwise. **fragile** when another "
    "definition of collapse in the declared grid gives another verdict. Collapse counts: secondary, exact "
    "McNemar on the pairs",
    experiment="phase",
    worse="grpo+none",
    better="grpo+r2",
    runs=offpolicy_runs,
    agreement=True,
    also=FAMILY_NOTES,
    no_arms=OFFPOLICY_NO_ARMS,
    no_cell=(INCONCLUSIVE, "no off-policy cell where the runs degrade: the grid never reached instability"),
)

GSPO_STABLE = PairedClaim(
    3,
    "GSPO is stable without routing replay",
    "GSPO, arXiv 2507.18071",
    "in the off-policy cells where grpo+none's mean final accuracy ends below the cold start's, paired by "
    "seed: gspo+none vs grpo+none and grpo+r2 vs gspo+none, each on the three primary outcomes of claim 2 "
    "(Holm within a comparison, Bonferroni over looks). reproduced if gspo+none beats grpo+none and grpo+r2 "
    "does not beat gspo+none; not reproduced if grpo+r2 beats gspo+none, or gspo+none vs grpo+none is not "
    "reproduced (grpo+none better, or both differences inside their margins); inconclusive otherwise. "
    "**fragile** when the grid of collapse definitions disagrees",
    experiment="phase",
    worse="grpo+none",
    better="gspo+none",
    rivals=(("gspo+none", "grpo+r2"),),
    runs=offpolicy_runs,
    degrading=("grpo+none",),
    label="vs {worse}",
    test="as claim 2, per comparison",
    also=FAMILY_NOTES,
    no_arms=OFFPOLICY_NO_ARMS,
    no_cell=(INCONCLUSIVE, "grpo+none never degrades off-policy: no unstable cell to test"),
)

R3_VS_R2 = PairedClaim(
    5,
    "With a train/inference gap and large N, R3 beats R2",
    "arXiv 2512.01374",
    "runs with rollouts from a real inference engine (vLLM in bfloat16, float32 training) and the largest N "
    "(N >= 4 where present), in the cells where grpo+r2 and grpo+r3 end below their cold start on average: "
    "grpo+r3 vs grpo+r2 on collapse (exact CMH over cells, one-sided) and final accuracy "
    f"({ACCURACY_DEFINITION}, as in claims 2 and 3; paired by seed and cell: bootstrap interval, "
    "sign-flip test), Holm over the two and Bonferroni over the looks at the data (cells added by an extension "
    "of the experiment file). reproduced if either favours R3 at Holm p < 0.05 and neither favours "
    "R2; not reproduced if either favours R2 at Holm p < 0.05, or both intervals lie within their margins "
    f"(collapse ±{COLLAPSE_MARGIN}, accuracy ±{ACCURACY_MARGIN}); inconclusive otherwise; "
    f"{UNTESTABLE_HERE} when no cell degrades. The same test "
    "on `phase_mismatch` (the gap emulated by casting the rollout model to bfloat16) is reported as a note",
    experiment="engine_mismatch",
    worse="grpo+r2",
    better="grpo+r3",
    outcomes=COLLAPSE_OUTCOMES,
    runs=low_precision_large_n,
    names={"grpo+r2": "R2", "grpo+r3": "R3"},
    cells_text="{n} cell(s): {cells}",
    also=(
        AlsoOn(
            "phase_mismatch",
            "emulated gap (`phase_mismatch`, bfloat16 cast of the rollout model): {verdict} ({reason}); "
            "{statistic}; {test}",
        ),
        AlsoOn(
            "engine_mismatch_stable",
            "the first engine cells (`engine_mismatch_stable`): {verdict} ({reason}); {statistic}",
        ),
    ),
    describe=engine_gap,
    no_arms=(INCONCLUSIVE, "no grpo+r2 and grpo+r3 runs with a low-precision engine rollout"),
)

DENSE_CONTROL = "dense_control"
MECHANISM = "mechanism"  # the ladder (experiments/conf/preset/mechanism.yaml): rungs from matched starts
MECHANISM_GENTLE = "mechanism_gentle"  # the same ladder at the gentler cell lr 3e-4, N = 4
MECHANISM_FINE = "mechanism_fine"  # its moe and dense rungs at the fine-grained geometry (64 experts, top-8)
GENTLE_NOTE = (
    "at the gentler cell (`mechanism_gentle`: lr 3e-4, N = 4, matched starts, 2 cold-start seeds x 5 seeds), "
    "reported beside: **{verdict}** ({reason}); {statistic}"
)
MOE_FAMILY, DENSE_FAMILY = "qwen3_moe", "qwen3_dense"  # the default model and its dense control (moe_rl.models)
MOE_SPECIFIC = PairedClaim(
    7,
    "At this scale the instability is specific to MoE",
    "dense control of the phase map (this harness)",
    f"{DENSE_FAMILY} (the dense control: same attention and active width, no routing) vs {MOE_FAMILY}, paired by "
    "(lr, N, algorithm arm, seed), in the cells where the MoE model's mean final accuracy ends below its cold "
    "start's. The three primary outcomes of claim 2, measured from each run's own start since each model has "
    f"its own cold start (accuracy change: final accuracy, {ACCURACY_DEFINITION}, minus step-0 accuracy; "
    "reward AUC minus the mean reward of the "
    f"first {START_STEPS} steps: sign-flip test and bootstrap interval; time to collapse under the relative "
    "definition: log-rank stratified on the pairs; Holm over the three), and whether the dense runs end below "
    "their own cold start (accuracy change, one-sided sign-flip test). reproduced if "
    "the dense model beats the MoE model at p < 0.05 with no outcome favouring MoE, and does not end below its "
    "cold start at p < 0.05; not reproduced if the dense model ends below its cold start (the degradation needs "
    "no routing) or the MoE model is not worse (an outcome favours it, or the accuracy and reward AUC intervals "
    f"lie inside ±{ACCURACY_MARGIN}); inconclusive otherwise; {UNTESTABLE_HERE} without runs of both models or "
    "without a cell where the MoE model degrades. **fragile** when the grid of collapse definitions disagrees",
    experiment=DENSE_CONTROL,
    worse=MOE_FAMILY,
    better=DENSE_FAMILY,
    holds_start="the dense control",
    compare_by="family",
    pairing=("lr", "N", "algo_arm"),  # a control pair shares the cell and the algorithm arm, and the seed
    degrading=(MOE_FAMILY,),
    from_own_start=True,
    names={DENSE_FAMILY: "dense", MOE_FAMILY: "MoE"},
    runs=partial(ladder_pairs, rungs=("moe", "dense")),  # the ladder's moe and dense rungs, for the note below
    also=(
        AlsoOn(
            MECHANISM,
            "from matched starts (`mechanism`: rungs moe and dense, each warmed up to the same sampled reward, 2 "
            "cold-start seeds x 4 seeds): **{verdict}** ({reason}); {statistic}",
        ),
        AlsoOn(MECHANISM_GENTLE, GENTLE_NOTE),
        AlsoOn(
            MECHANISM_FINE,
            "with many small experts (`mechanism_fine`: 64 experts of width 16, top-8, 4 layers, and the dense twin, "
            "lr 3e-4, N = 8, matched starts, 10 pairs), reported beside: **{verdict}** ({reason}); {statistic}",
        ),
    ),
    plain=(
        "We trained the dense control ({better}: the same attention and as many parameters per token, no "
        "routing) next to {worse} from its own cold start, with the same seeds, in the cells where the MoE "
        "model loses accuracy. Over {pairs} seed-matched pairs, each measured from its own cold start, the dense "
        "model ended {ahead} the MoE model; the dense runs ended {better_change:+.1f} points from their own cold "
        "start ({better_below} of {better_runs} below it), the MoE runs {worse_change:+.1f}. Verdict: "
        "**{verdict}**. What would change it: {would_change}."
    ),
    no_data=(UNTESTABLE_HERE, "no runs of {experiment}"),
    no_arms=(UNTESTABLE_HERE, "no runs of {missing} in {experiment}"),
    no_cell=(UNTESTABLE_HERE, f"{MOE_FAMILY} ends below its cold start in no cell with paired runs"),
)

LADDER_RULE = (
    "{better} vs {worse} on the `mechanism` ladder's runs (lr 3e-4, N = 8, grpo+none, matched starts), paired by "
    "(cold-start seed, seed), measured from each run's own start: accuracy change (final accuracy, "
    f"{ACCURACY_DEFINITION}, minus step 0) and reward AUC (minus the mean reward of the first "
    f"{START_STEPS} steps), sign-flip test and bootstrap interval, and time to collapse (log-rank stratified on "
    "the pairs), Holm over the three. reproduced if one favours {favoured} at p < 0.05 and none the other; not "
    f"reproduced if one favours the other, or the accuracy and reward AUC intervals lie inside ±{ACCURACY_MARGIN}; "
    f"inconclusive otherwise; {UNTESTABLE_HERE} where the MoE model does not degrade"
)


def ladder_claim(
    id: int, claim: str, source: str, *, worse: str, better: str, words: dict[str, str], names: dict[str, str]
) -> PairedClaim:
    """A claim that rung `better` beats rung `worse` on the mechanism ladder (`LADDER_RULE`, `words` filling
    its better / worse / favoured), paired by cold-start seed and seed, each run from its own start."""
    return PairedClaim(
        id,
        claim,
        source,
        LADDER_RULE.format(**words),
        experiment=MECHANISM,
        worse=worse,
        better=better,
        compare_by="rung",
        pairing=("lr", "N"),
        degrading=("moe",),
        from_own_start=True,
        runs=partial(ladder_pairs, rungs=tuple(sorted({worse, better}))),
        names=names,
        no_data=(UNTESTABLE_HERE, "no runs of {experiment}"),
        no_arms=(INCONCLUSIVE, "no runs of rung(s) {missing} in {experiment}"),
        no_cell=(UNTESTABLE_HERE, "the MoE model ends above its cold start: no degrading cell"),
        also=(AlsoOn(MECHANISM_GENTLE, GENTLE_NOTE),),
    )


AUX_HURTS = ladder_claim(
    8,
    "A load-balancing loss during GRPO hurts an MoE policy",
    "NeMo-RL #3169 (against TRL's default aux loss 0.001)",
    worse="aux1e-3",
    better="moe",
    words={
        "better": "moe (no aux loss)",
        "worse": "moe with the family's aux loss at 1e-3",
        "favoured": "no aux loss",
    },
    names={"aux1e-3": "aux 1e-3", "moe": "no aux"},
)
FROZEN_ROUTER = ladder_claim(
    9,
    "Freezing the router stabilises GRPO on MoE",
    "NeMo-RL's and verl's (Megatron) GRPO defaults",
    worse="moe",
    better="router_frozen",
    words={"better": "moe with a frozen router", "worse": "moe", "favoured": "the frozen router"},
    names={"router_frozen": "frozen router", "moe": "learning router"},
)

PAIRED_CLAIMS = (OFFPOLICY_GRPO, GSPO_STABLE, R3_VS_R2, MOE_SPECIFIC, AUX_HURTS, FROZEN_ROUTER)
