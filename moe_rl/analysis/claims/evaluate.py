"""Every claim's verdict from the result folders: `evaluate_claims` over the readers the studies declare."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from moe_rl.analysis.claims.rules import INCONCLUSIVE, Claim

# a claim's reader: a function of the results root and the presets folder (a declared study's contrast, or a claim
# with a statistic of its own)
ClaimItem = Callable[[Path, Path], Claim]


def evaluate_claims(root: str | Path, claims: Mapping[int, ClaimItem], presets: str | Path) -> list[Claim]:
    """The verdict of each of `claims` (id -> reader, in id order) from the result folders under `root` (e.g.
    `results`), the declarations read beside the presets folder `presets` (experiments/conf/preset)."""
    out = []
    for id_, item in sorted(claims.items()):
        try:
            out.append(item(Path(root), Path(presets)))
        except Exception as err:  # a malformed folder must not hide the other claims
            name = getattr(item, "__name__", f"claim {id_}")
            out.append(
                Claim(id_, name, "", "", verdict=INCONCLUSIVE, reason=f"analysis failed: {type(err).__name__}: {err}")
            )
    return out
