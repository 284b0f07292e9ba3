"""Every claim's verdict from the result folders: the list of claims and `evaluate_claims`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from moe_rl.analysis.claims.claim_drift import claim_depth, claim_expert_drift
from moe_rl.analysis.claims.claim_frontier import claim_no_trust_region, claim_vespo_staleness
from moe_rl.analysis.claims.claim_lead import claim_shift_leads
from moe_rl.analysis.claims.declared import declared_analyses
from moe_rl.analysis.claims.paired import PairedClaim, judge_paired
from moe_rl.analysis.claims.paired_claims import (
    AUX_HURTS,
    FROZEN_ROUTER,
    GSPO_STABLE,
    MOE_SPECIFIC,
    OFFPOLICY_GRPO,
    R3_VS_R2,
)
from moe_rl.analysis.claims.rules import INCONCLUSIVE, Claim

# in page order: a paired claim is a declaration (`paired_claims`), a claim with a statistic of its own a function
CLAIMS: tuple[PairedClaim | Callable[..., Claim], ...] = (
    claim_expert_drift,
    OFFPOLICY_GRPO,
    GSPO_STABLE,
    claim_depth,
    R3_VS_R2,
    claim_shift_leads,
    MOE_SPECIFIC,
    AUX_HURTS,
    FROZEN_ROUTER,
    claim_vespo_staleness,
    claim_no_trust_region,
)
DECLARED_BY = {claim_depth: "drift_scaling"}  # a claim function that reads its experiment file -> that file


def evaluate_claims(root: str | Path, experiment_files: str | Path | None = None) -> list[Claim]:
    """Every claim's verdict from the result folders under `root` (e.g. `results`), with the analyses
    declared in `experiment_files` (default experiments/conf/preset)."""
    root = Path(root)
    try:
        declared = declared_analyses(experiment_files)
    except (OSError, ValueError, KeyError, TypeError):
        declared = {}
    cache: dict = {}  # per-run outcomes, loaded once for the claims that read the same folder
    out = []
    for item in CLAIMS:
        try:
            if isinstance(item, PairedClaim):
                out.append(judge_paired(item, root, declared, cache=cache))
            elif item in DECLARED_BY:
                out.append(item(root, declared.get(DECLARED_BY[item])))
            else:
                out.append(item(root))
        except Exception as err:  # a malformed folder must not hide the other claims
            name = item.claim if isinstance(item, PairedClaim) else item.__name__
            out.append(
                Claim(
                    len(out) + 1,
                    name,
                    "",
                    "",
                    verdict=INCONCLUSIVE,
                    reason=f"analysis failed: {type(err).__name__}: {err}",
                )
            )
    return out
