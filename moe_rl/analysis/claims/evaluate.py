"""Every claim's verdict from the result folders: the list of claims and `evaluate_claims`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from moe_rl.analysis.claims.cells import phase_outcomes
from moe_rl.analysis.claims.claim_dense import DENSE_CONTROL, claim_moe_specific
from moe_rl.analysis.claims.claim_drift import claim_depth, claim_expert_drift
from moe_rl.analysis.claims.claim_lead import claim_shift_leads
from moe_rl.analysis.claims.claim_mismatch import claim_r3_vs_r2
from moe_rl.analysis.claims.claim_stability import claim_gspo_stable, claim_offpolicy_grpo, family_notes
from moe_rl.analysis.claims.declared import declared_analyses
from moe_rl.analysis.claims.rules import INCONCLUSIVE, Claim

CLAIMS: tuple[Callable[[Path], Claim], ...] = (
    claim_expert_drift,
    claim_offpolicy_grpo,
    claim_gspo_stable,
    claim_depth,
    claim_r3_vs_r2,
    claim_shift_leads,
    claim_moe_specific,
)
DECLARED_BY = {
    claim_depth: "drift_scaling",
    claim_moe_specific: DENSE_CONTROL,
    claim_r3_vs_r2: "engine_mismatch",
}  # claim -> its experiment file


def evaluate_claims(root: str | Path, experiment_files: str | Path | None = None) -> list[Claim]:
    """Every claim's verdict from the result folders under `root` (e.g. `results`), with the analyses
    declared in `experiment_files` (default experiments/conf/preset)."""
    root = Path(root)
    outcomes = phase_outcomes(root, "phase", grid=True)
    try:
        declared = declared_analyses(experiment_files)
    except (OSError, ValueError, KeyError, TypeError):
        declared = {}
    out = []
    for fn in CLAIMS:
        try:
            if fn in (claim_offpolicy_grpo, claim_gspo_stable):
                out.append(fn(root, outcomes, declared.get("phase")))
                out[-1].notes += family_notes(root, fn, outcomes, declared)
            else:
                out.append(fn(root, declared.get(DECLARED_BY[fn])) if fn in DECLARED_BY else fn(root))
        except Exception as err:  # a malformed folder must not hide the other claims
            out.append(
                Claim(
                    len(out) + 1,
                    fn.__name__,
                    "",
                    "",
                    verdict=INCONCLUSIVE,
                    reason=f"analysis failed: {type(err).__name__}: {err}",
                )
            )
    return out
