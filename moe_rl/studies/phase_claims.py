"""The phase map's claims (2 and 3): GRPO without replay against R2, GSPO against both, paired by seed in
the off-policy cells where the runs degrade, each a `PairedClaim` declaration."""

from __future__ import annotations

from moe_rl.analysis.claims.cells import (
    offpolicy_runs,
)
from moe_rl.analysis.claims.paired import AlsoOn, PairedClaim
from moe_rl.analysis.claims.rules import (
    ACCURACY_DEFINITION,
    ACCURACY_MARGIN,
    INCONCLUSIVE,
)

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
