"""The papers' claims, each with a verdict computed from the result folders (docs/design.md §7).

`evaluate_claims(results_root)` reads the folders named below (a missing folder gives
`inconclusive` with reason "no data") and `format_claims_markdown` writes results/CLAIMS.md with
the verdict rules next to the table. Every verdict follows one pattern: **reproduced** when the
predicted direction is significant (alpha 0.05; Holm where a claim runs several tests), **not
reproduced** when the opposite direction is significant or the interval of the effect lies inside
a margin too small to matter (collapse probability 0.10, accuracy 0.05, drift 10% of its level),
**inconclusive** otherwise.

Modules by job: `rules` (labels, margins, the Claim row, shared verdict rules and wording), `cells`
(the runs and cells a claim reads), `declared` (the experiment files' declared analyses and their
extensions), `pooled` (collapse pooled over cells), `arms` (paired arm comparisons), one module per
claim family (`claim_drift`: 1 and 4, `claim_stability`: 2 and 3, `claim_mismatch`: 5, `claim_lead`:
6, `claim_dense`: 7), `evaluate` (all claims), `scale` (the scale paragraph) and `markdown` (the page).
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
from moe_rl.analysis.claims.cells import degrading_cells, grid_definitions, phase_outcomes, runs_folder
from moe_rl.analysis.claims.claim_dense import (
    DENSE_CONTROL,
    DENSE_FAMILY,
    MOE_FAMILY,
    claim_moe_specific,
    moe_degrading,
    own_start_drop,
    per_cell_notes,
)
from moe_rl.analysis.claims.claim_drift import PAPER_BAND, claim_depth, claim_expert_drift
from moe_rl.analysis.claims.claim_lead import claim_shift_leads, run_series, shift_before_collapse
from moe_rl.analysis.claims.claim_mismatch import claim_r3_vs_r2
from moe_rl.analysis.claims.claim_stability import FAMILY_PHASES, claim_gspo_stable, claim_offpolicy_grpo, family_notes
from moe_rl.analysis.claims.declared import EXPERIMENT_FILES, Declared, declared_analyses, extension_of
from moe_rl.analysis.claims.evaluate import CLAIMS, DECLARED_BY, evaluate_claims
from moe_rl.analysis.claims.markdown import format_claims_markdown
from moe_rl.analysis.claims.pooled import compare_collapse, kappa_by_cell, pooled_rate_difference
from moe_rl.analysis.claims.rules import (
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
    UNTESTABLE,
    UNTESTABLE_HERE,
    Claim,
    direction_verdict,
)
from moe_rl.analysis.claims.scale import models_and_tasks

__all__ = [
    "ACCURACY_MARGIN",
    "ALPHA",
    "CLAIMS",
    "COLLAPSE_MARGIN",
    "CONTINUOUS",
    "Claim",
    "Comparison",
    "DECLARED_BY",
    "DENSE_CONTROL",
    "DENSE_FAMILY",
    "DRIFT_MARGIN",
    "Declared",
    "EXPERIMENT_FILES",
    "FAMILY_PHASES",
    "FRAGILE",
    "INCONCLUSIVE",
    "LEAD_MARGIN",
    "MOE_FAMILY",
    "NOT_REPRODUCED",
    "N_BOOT",
    "PAPER_BAND",
    "PRIMARY",
    "REPRODUCED",
    "REWARD_MARGIN",
    "UNTESTABLE",
    "UNTESTABLE_HERE",
    "arm_verdict",
    "claim_depth",
    "claim_expert_drift",
    "claim_gspo_stable",
    "claim_moe_specific",
    "claim_offpolicy_grpo",
    "claim_r3_vs_r2",
    "claim_shift_leads",
    "compare_arms",
    "compare_collapse",
    "continuous_compare",
    "count_verdict",
    "declared_analyses",
    "degrading_cells",
    "direction_verdict",
    "evaluate_claims",
    "extension_of",
    "family_notes",
    "format_claims_markdown",
    "grid_definitions",
    "kappa_by_cell",
    "models_and_tasks",
    "moe_degrading",
    "own_start_drop",
    "per_cell_notes",
    "phase_outcomes",
    "pooled_rate_difference",
    "run_series",
    "runs_folder",
    "shift_before_collapse",
    "survival_compare",
]
