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

A claim is decided by a declared study (experiments/conf/study/NAME.yaml) under the one rule
(`moe_rl.studies.study_rule`); adding one is a contrast in a declaration and its study's row in `moe_rl.studies`
(docs/experiments.md, "Declared studies"). The `PairedClaim` engine here (`paired.judge_paired`) only re-reads
the earlier looks of claims 2, 3, 5, 7, 8 and 9 for their history notes; a claim with a statistic of its own is a
function of the results root and the presets folder in its study's module (1 and 4: `studies.drift_claims`; 6:
`studies.shift_claim`).
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
from moe_rl.analysis.claims.preset_analyses import Declared, declared_analyses, declared_or_none, extension_of
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
