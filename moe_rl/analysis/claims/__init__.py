"""The verdict engine of the papers' claims (docs/design.md §7); the claims themselves are declared by the
studies that decide them (`moe_rl.studies`).

`evaluate_claims(results_root, claims, presets)` reads the folders each claim names (a missing folder gives
`inconclusive` with reason "no data") and `format_claims_markdown` writes results/CLAIMS.md with the verdict
rules next to the table. Every verdict follows one pattern: **reproduced** when the predicted direction is
significant (alpha 0.05; Holm where a claim runs several tests), **not reproduced** when the opposite direction
is significant or the interval of the effect lies inside a margin too small to matter (collapse probability
0.10, accuracy 0.05, drift 10% of its level), **inconclusive** otherwise, and wherever fewer than 5 independent
cold starts stand behind the runs compared by seed (`rules.descriptive`: the seed-level reading stays in the
reason).

A claim that compares arms on paired runs (2, 3, 5, 7, 8, 9) is a `PairedClaim` declaration in its study's
module, judged by one engine, `paired.judge_paired`; a claim with a statistic of its own is a function of the
results root and the presets folder in its study's module (1 and 4: `studies.drift_claims`; 6:
`studies.shift`; 10 and 11: `studies.frontier_claims`).

Adding a paired claim: declare it in its study's module and add it to the study's row in `moe_rl.studies`
(the claims it decides, by id). The first five fields are the id, the claim, its source, the rule as the page
states it and the experiment (the result folder; its preset's `analysis` block gives the claims and outcomes
it declares and the extensions added after a look, which the verdict counts); then `worse` and `better`, the
arm predicted to win. The defaults compare final accuracy, reward AUC and time to collapse (Holm over the
three, the grid of collapse definitions for robustness) in the cells where both arms end below their cold
start, paired by the phase map's cells and seed. Say only what differs, e.g. for "MoE with the auxiliary loss
is more stable than without" on a phase-style sweep::

    AUX_LOSS = PairedClaim(
        8, "The load-balancing loss stabilizes RL", "its source", "the rule, in words",
        experiment="aux_loss", worse="grpo+none", better="grpo+none+aux", runs=offpolicy_runs,
        degrading=("grpo+none",),
    )

Final accuracy is one definition in every claim, `rules.ACCURACY` (`late_accuracy`: the mean of a run's last 3
evaluations). Where a paired claim is judged pooled over several cells, its notes give the same rule on each cell
alone, descriptive, beside the pooled verdict, which decides.

Other fields: `rivals` (comparisons that must not come out reproduced), `holds_start` (the better arm must
not end below its own cold start), `outcomes=COLLAPSE_OUTCOMES` (collapse pooled over cells and final
accuracy), `compare_by` (arms in another run column, e.g. the model family), `from_own_start`, `pairing`,
`margins`, `also` (the same judgement on another experiment, as a note) and the wording of the page.

Modules by job: `rules` (labels, margins, the Claim row, shared verdict rules and wording), `cells`
(the runs and cells a claim reads), `declared` (the experiment files' declared analyses and their
extensions), `pooled` (collapse pooled over cells), `arms` (paired arm comparisons and their wording),
`paired` (the record and its engine), `evaluate` (the claims' verdicts), `scale` (the scale paragraph) and
`markdown` (the page).
"""

from __future__ import annotations

from moe_rl.analysis.claims.arms import (
    Comparison,
    arm_verdict,
    compare_arms,
    continuous_compare,
    count_verdict,
    survival_compare,
)
from moe_rl.analysis.claims.cells import (
    degrading_cells,
    grid_definitions,
    independent_starts,
    ladder_pairs,
    low_precision_large_n,
    offpolicy_runs,
    phase_outcomes,
    runs_folder,
    runs_in_cells,
)
from moe_rl.analysis.claims.declared import Declared, declared_analyses, declared_or_none, extension_of
from moe_rl.analysis.claims.evaluate import ClaimItem, evaluate_claims
from moe_rl.analysis.claims.markdown import format_claims_markdown
from moe_rl.analysis.claims.paired import (
    ARMS_OUTCOMES,
    COLLAPSE_OUTCOMES,
    AlsoOn,
    PairedClaim,
    combine,
    from_own_start,
    judge_paired,
    own_start_drop,
)
from moe_rl.analysis.claims.pooled import compare_collapse, kappa_by_cell, pooled_rate_difference
from moe_rl.analysis.claims.rules import (
    ACCURACY,
    ACCURACY_MARGIN,
    ALPHA,
    COLLAPSE_MARGIN,
    CONTINUOUS,
    DRIFT_MARGIN,
    FRAGILE,
    INCONCLUSIVE,
    LEAD_MARGIN,
    N_BOOT,
    NOT_REPRODUCED,
    PRIMARY,
    REPRODUCED,
    REWARD_MARGIN,
    UNTESTABLE_HERE,
    Claim,
    descriptive,
    direction_verdict,
)
from moe_rl.analysis.claims.scale import models_and_tasks

__all__ = [
    "ACCURACY",
    "ACCURACY_MARGIN",
    "ALPHA",
    "ARMS_OUTCOMES",
    "AlsoOn",
    "COLLAPSE_MARGIN",
    "COLLAPSE_OUTCOMES",
    "CONTINUOUS",
    "Claim",
    "ClaimItem",
    "Comparison",
    "DRIFT_MARGIN",
    "Declared",
    "FRAGILE",
    "INCONCLUSIVE",
    "LEAD_MARGIN",
    "ladder_pairs",
    "NOT_REPRODUCED",
    "N_BOOT",
    "PRIMARY",
    "PairedClaim",
    "REPRODUCED",
    "REWARD_MARGIN",
    "UNTESTABLE_HERE",
    "arm_verdict",
    "combine",
    "compare_arms",
    "compare_collapse",
    "continuous_compare",
    "count_verdict",
    "declared_analyses",
    "declared_or_none",
    "degrading_cells",
    "descriptive",
    "direction_verdict",
    "evaluate_claims",
    "extension_of",
    "format_claims_markdown",
    "from_own_start",
    "grid_definitions",
    "independent_starts",
    "judge_paired",
    "kappa_by_cell",
    "low_precision_large_n",
    "models_and_tasks",
    "offpolicy_runs",
    "own_start_drop",
    "phase_outcomes",
    "pooled_rate_difference",
    "runs_folder",
    "runs_in_cells",
    "survival_compare",
]
