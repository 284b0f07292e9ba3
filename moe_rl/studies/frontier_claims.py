"""Claims 10 and 11: staleness edges on the stability frontier (`moe_rl.studies.frontier`).

Both are decided on the N axis by the bootstrap over seeds of each arm's edge (the preset's `claims_rules`):
a claim is reproduced when its ordering of edges holds in at least 95% of the draws, not reproduced when the
opposite ordering does, inconclusive otherwise, and while an edge it reads is not yet located.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.claims.rules import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, Claim, would_change
from moe_rl.studies import frontier as fr_

SURE = 0.95  # the share of bootstrap draws an ordering must hold in
GRPO, SAPO, VESPO = ("qwen3_moe", "grpo_none"), ("qwen3_moe", "sapo_none"), ("qwen3_moe", "vespo_none")
CISPO, PLAIN_IS, DPPO = ("qwen3_moe", "cispo_none"), ("qwen3_moe", "is_none"), ("qwen3_moe", "dppo_tv_none")
NO_TRUST_REGION, TRUST_REGION = (CISPO, PLAIN_IS), (GRPO, DPPO)


@lru_cache(maxsize=2)
def _frontier(root: str, presets: str) -> tuple[pd.DataFrame, fr_.Frontier, dict]:
    """The frontier's runs (its folder and the sources it borrows) and every edge, once per results root."""
    fr = fr_.load_frontier(Path(presets))
    runs = fr_.load_runs([Path(root)])
    return runs, fr, fr_.edges(runs, fr)


def _edge_text(runs: pd.DataFrame, edge: fr_.Edge) -> str:
    from moe_rl.studies.frontier_report import row_label

    return f"{row_label(runs, edge.row)} {edge.label} {edge.interval}"


def _claim(id_: int, claim: str, source: str, rule: str) -> Claim:
    return Claim(id_, claim, source, rule, experiment="frontier", cells="the N axis at lr 3e-4 (N = 1 ... 32)")


def _edges(
    c: Claim, root: Path, presets: Path, rows: list[tuple[str, str]]
) -> tuple[list[fr_.Edge], pd.DataFrame, fr_.Frontier] | None:
    """The staleness edges of `rows`, the frontier's runs and declaration, with the claim's statistic set to the edges; None
    (the claim left inconclusive, with its reason) without a frontier folder or while an edge is not located."""
    if not (Path(root) / "frontier").is_dir():
        return None
    runs, fr, edges = _frontier(str(root), str(presets))
    found = [edges[(row, "N")] for row in rows]
    c.statistic = "; ".join(_edge_text(runs, e) for e in found)
    unlocated = [e.row[1] for e in found if not e.located]
    if unlocated:
        c.reason = f"edges not located yet: {', '.join(unlocated)} (run `python experiments/frontier.py`)"
        return None
    return found, runs, fr


def claim_vespo_staleness(root: Path, presets: Path) -> Claim:
    c = _claim(
        10,
        "VESPO stays stable far past the staleness where GRPO and SAPO collapse",
        "VESPO, arXiv 2602.10693",
        "on the N axis, vespo+none's edge at least two grid points (4x in N) above both grpo+none's and "
        "sapo+none's in 95% of the bootstrap draws: reproduced; at or below either one's in 95%: not reproduced",
    )
    found = _edges(c, root, presets, [VESPO, GRPO, SAPO])
    if found is None:
        return c
    v, g, s = found[0]
    far = float(np.mean((v.draws - g.draws >= 2) & (v.draws - s.draws >= 2)))
    below = max(float(np.mean(v.draws <= g.draws)), float(np.mean(v.draws <= s.draws)))
    c.test = f"share of draws with vespo two points past both {far:.3f}; at or below one of them {below:.3f}"
    c.verdict = REPRODUCED if far >= SURE else NOT_REPRODUCED if below >= SURE else INCONCLUSIVE
    c.reason = c.test
    c.plain = (
        f"We located, by bisection over N = 1 ... 32 at lr 3e-4, the last number of updates per rollout at which "
        f"each arm still holds its cold start's accuracy (mean change >= -5 pp, at most a quarter collapsed). "
        f"Edges: {c.statistic}. Verdict: **{c.verdict}**. What would change it: {would_change(c.verdict)}."
    )
    return c


def claim_no_trust_region(root: Path, presets: Path) -> Claim:
    c = _claim(
        11,
        "Methods without a trust region collapse as the mismatch grows",
        "DPPO, arXiv 2602.04879",
        "on the N axis, the edges of cispo+none and plain IS both below those of grpo+none and dppo_tv+none in "
        "95% of the bootstrap draws (all four pairs): reproduced; either at or above either in 95%: not reproduced",
    )
    rows = [*NO_TRUST_REGION, *TRUST_REGION]
    found = _edges(c, root, presets, rows)
    if found is None:
        return c
    edges, runs, fr = dict(zip(rows, found[0])), found[1], found[2]
    below = np.ones_like(edges[GRPO].draws, dtype=bool)
    at_or_above = 0.0
    for a in NO_TRUST_REGION:
        for b in TRUST_REGION:
            da, db = edges[a].draws, edges[b].draws
            below &= da < db
            at_or_above = max(at_or_above, float(np.mean(da >= db)))
    c.test = f"share of draws with both below both {np.mean(below):.3f}; largest share of one at or above one {at_or_above:.3f}"
    c.verdict = REPRODUCED if np.mean(below) >= SURE else NOT_REPRODUCED if at_or_above >= SURE else INCONCLUSIVE
    c.reason = c.test
    from moe_rl.studies.frontier_report import gap_by_n

    gap = gap_by_n(runs, fr, rows)
    if not gap.empty:
        c.notes.append(
            "off-policy token log-ratio variance by N (descriptive): "
            + "; ".join(
                f"{col}: " + ", ".join(f"N={int(n)} {v:.3g}" for n, v in gap[col].dropna().items()) for col in gap
            )
        )
    c.plain = (
        f"Plain importance sampling and CISPO (no clip that zeroes a token's gradient) against GRPO's clip and "
        f"DPPO's probability-change mask, on the staleness axis. Edges: {c.statistic}. Verdict: **{c.verdict}**. "
        f"What would change it: {would_change(c.verdict)}."
    )
    return c
