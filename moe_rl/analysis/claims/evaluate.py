"""Every claim's verdict from the result folders: `evaluate_claims` over the claims the studies declare."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from moe_rl.analysis.claims.paired import PairedClaim, judge_paired
from moe_rl.analysis.claims.preset_analyses import declared_analyses
from moe_rl.analysis.claims.rules import INCONCLUSIVE, Claim

# a paired claim is a declaration judged by one engine; a claim with a statistic of its own a function of the
# results root and the presets folder
ClaimItem = PairedClaim | Callable[[Path, Path], Claim]


def evaluate_claims(root: str | Path, claims: Mapping[int, ClaimItem], presets: str | Path) -> list[Claim]:
    """The verdict of each of `claims` (id -> claim, in id order) from the result folders under `root` (e.g.
    `results`), with the analyses declared in the presets folder `presets` (experiments/conf/preset)."""
    root = Path(root)
    try:
        declared = declared_analyses(presets)
    except (OSError, ValueError, KeyError, TypeError):
        declared = {}
    cache: dict = {}  # per-run outcomes, loaded once for the claims that read the same folder
    out = []
    for id_, item in sorted(claims.items()):
        try:
            if isinstance(item, PairedClaim):
                out.append(judge_paired(item, root, declared, cache=cache))
            else:
                out.append(item(root, Path(presets)))
        except Exception as err:  # a malformed folder must not hide the other claims
            name = item.claim if isinstance(item, PairedClaim) else getattr(item, "__name__", f"claim {id_}")
            out.append(
                Claim(
                    id_,
                    name,
                    "",
                    "",
                    verdict=INCONCLUSIVE,
                    reason=f"analysis failed: {type(err).__name__}: {err}",
                )
            )
    return out
