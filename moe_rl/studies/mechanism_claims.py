"""The dense control's and the mechanism ladder's claims (7, 8 and 9), each a `PairedClaim` declaration."""

from __future__ import annotations

from functools import partial

from moe_rl.analysis.claims.cells import (
    START_STEPS,
    ladder_pairs,
)
from moe_rl.analysis.claims.paired import AlsoOn, PairedClaim
from moe_rl.analysis.claims.rules import (
    ACCURACY_DEFINITION,
    ACCURACY_MARGIN,
    INCONCLUSIVE,
    UNTESTABLE_HERE,
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
