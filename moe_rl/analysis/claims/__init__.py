"""The papers' claims as CLAIMS.md reads them (docs/design.md §7): each claim's reading is a reader of the results
root and the presets folder, declared by the study that decides it (`moe_rl.studies`, the folder of declarations).

`evaluate_claims(results_root, readers, presets)` calls each claim's reader (a failing one gives `inconclusive`
with its error as the reason) and `format_claims_markdown` writes results/CLAIMS.md with the rule beside the
table. A declared study's contrast is decided by the one rule (`moe_rl.studies.study_rule`); a study its presets ran
is re-read by the same rule as it ran (`as_ran`); a claim with a statistic of its own (1: `studies.drift_claims`;
6: `studies.shift_claim`) is a reader in its study's module. Adding a claim is a contrast in a declaration and its
`decides` entry (docs/experiments.md, "Declared studies").
"""

from __future__ import annotations

from moe_rl.analysis.claims.cells import runs_folder
from moe_rl.analysis.claims.evaluate import ClaimItem, evaluate_claims
from moe_rl.analysis.claims.markdown import format_claims_markdown
from moe_rl.analysis.claims.rules import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, UNTESTABLE_HERE, Claim

__all__ = [
    "Claim",
    "ClaimItem",
    "INCONCLUSIVE",
    "NOT_REPRODUCED",
    "REPRODUCED",
    "UNTESTABLE_HERE",
    "evaluate_claims",
    "format_claims_markdown",
    "runs_folder",
]
