"""Claims 10 and 11, re-declared on the staleness axes their papers use (`moe_rl.studies.staleness`).

Claim 10 (VESPO) reads the `rollout.staleness` axis, claim 11 (DPPO) the `rollout.policy_lag` axis; both compare
edges paired on starts and seeds, over the hierarchical bootstrap's draws. An edge past the grid is censored: it
is past every located edge, and two censored edges tie (a tie decides nothing). Their first look, on the N axis of
the frontier (`moe_rl.studies.frontier_claims`), is kept in each claim's notes and counted: with two looks, an
ordering must hold in 1 - 0.05 / 2 = 97.5% of the draws.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.claims.rules import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    UNTESTABLE_HERE,
    Claim,
    would_change,
)
from moe_rl.studies import frontier_claims
from moe_rl.studies import staleness as st

LOOKS = 2  # the frontier's N axis, then these axes
SURE = 1 - 0.05 / LOOKS
FAR = 4.0  # claim 10: "far past" reads at least 4x in 1 + age


@lru_cache(maxsize=2)
def _axes(root: str, presets: str) -> dict[str, tuple[pd.DataFrame, dict]] | None:
    """Per axis, its table and its edges' draws; None without the study's runs."""
    folder = Path(root) / "staleness" / "runs"
    if not folder.is_dir():
        return None
    from moe_rl import analysis

    spec = st.load_spec(Path(presets))
    runs = st.per_run(analysis.load_results(folder, keys=st.fr_.KEYS))
    return {axis.name: st.axis_table(runs, spec, axis) for axis in spec.axes}


def _first_look(c: Claim, old: Claim) -> None:
    c.notes.append(
        f"first look (counted), on the N axis of the frontier: {old.verdict} ({old.reason}); rule: {old.rule}"
    )


def _edge_label(v: float) -> str:
    if np.isnan(v):
        return "—"
    return "> last value" if v == np.inf else "< first value" if v == -np.inf else f"{v:.2g}"


def _text(table: pd.DataFrame) -> str:
    def one(r: pd.Series) -> str:
        ci = f" [{_edge_label(r['edge_lo'])}, {_edge_label(r['edge_hi'])}]" if not r["descriptive"] else ""
        return f"{r['row']} {_edge_label(r['edge'])}{ci}" + (f" ({r['descriptive']})" if r["descriptive"] else "")

    return "; ".join(one(r) for _, r in table.iterrows())


def _changes(table: pd.DataFrame) -> str:
    """Each row's mean accuracy change at each value of the axis run so far (descriptive)."""
    cols = sorted((c for c in table.columns if c.startswith("change@")), key=lambda c: float(c.split("@")[1]))

    def one(r: pd.Series) -> str:
        cells = [f"{c.split('@')[1]}: {100 * r[c]:+.1f}" for c in cols if pd.notna(r[c])]
        return f"{r['row']} " + ", ".join(cells)

    return "mean accuracy change (pp) by value: " + "; ".join(one(r) for _, r in table.iterrows())


def _setup(c: Claim, root: Path, presets: Path, axis: str) -> tuple[pd.DataFrame, dict] | None:
    axes = _axes(str(root), str(presets))
    if axes is None:
        c.reason = "no data"
        c.notes.append("no runs of the staleness study yet: `python experiments/staleness.py` runs them")
        return None
    table, drawn = axes[axis]
    c.statistic = _text(table)
    c.notes.append(_changes(table))
    thin = table[table["descriptive"] != ""]
    if len(thin):
        c.reason = "not decided yet: " + "; ".join(f"{r['row']} {r['descriptive']}" for _, r in thin.iterrows())
        return None
    return table, drawn


def _censored_tie(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Draws where both edges are censored the same way (both past the grid, or both below it): a tie that orders
    nothing."""
    return (x == y) & np.isinf(x)


def _none_degrade(c: Claim, table: pd.DataFrame, rows: tuple[str, ...]) -> bool:
    """Untestable here when none of `rows` crosses -5 pp on the grid (every edge censored past it): the claim is
    about where they collapse, and they do not."""
    edges = table.set_index("row").loc[list(rows), "edge"]
    if not (edges == np.inf).all():
        return False
    c.verdict = UNTESTABLE_HERE
    c.reason = f"none of {', '.join(rows)} falls below -5 pp on the grid: no collapse for the claim to order"
    c.plain = (
        f"Edges: {c.statistic}. Verdict: **{c.verdict}** ({c.reason}). What would change it: {would_change(c.verdict)}."
    )
    return True


def claim_vespo_staleness(root: Path, presets: Path) -> Claim:
    c = Claim(
        10,
        "VESPO stays stable far past the staleness where GRPO and SAPO collapse",
        "VESPO, arXiv 2602.10693",
        f"on rollout.staleness (S = 1, 2, 4, 8; 192 updates per run), vespo+none's edge at least {FAR:g}x (in S) past "
        f"both grpo+none's and sapo+none's, each of theirs located on the grid, in {SURE:.1%} of the paired draws: "
        f"reproduced; at or below either one's (ties of two censored edges excluded) in {SURE:.1%}: not reproduced",
        experiment="staleness",
        cells="rollout.staleness at N = 1, 6 cold starts",
    )
    _first_look(c, frontier_claims.claim_vespo_staleness(root, presets))
    found = _setup(c, root, presets, "rollout.staleness")
    if found is None:
        return c
    table, d = found
    if _none_degrade(c, table, ("grpo_none", "sapo_none")):
        return c
    v, g, s = d["vespo_none"], d["grpo_none"], d["sapo_none"]
    with np.errstate(invalid="ignore"):
        far = float(np.mean((v >= FAR * g) & (v >= FAR * s) & np.isfinite(g) & np.isfinite(s)))
        below = max(float(np.mean((v <= g) & ~_censored_tie(v, g))), float(np.mean((v <= s) & ~_censored_tie(v, s))))
    c.test = f"share of draws with vespo {FAR:g}x past both {far:.3f}; at or below one of them {below:.3f}"
    c.verdict = REPRODUCED if far >= SURE else NOT_REPRODUCED if below >= SURE else INCONCLUSIVE
    c.reason = c.test
    c.plain = (
        f"On VESPO's own staleness design (the rollout grows S-fold and is consumed in one pass of S updates), the "
        f"S at which each method's accuracy change crosses -5 pp. Edges: {c.statistic}. Verdict: **{c.verdict}**. "
        f"What would change it: {would_change(c.verdict)}."
    )
    return c


def claim_no_trust_region(root: Path, presets: Path) -> Claim:
    c = Claim(
        11,
        "Methods without a trust region collapse as the mismatch grows",
        "DPPO, arXiv 2602.04879",
        f"on rollout.policy_lag (k = 0, 4, 8, 16; AReaL's decoupled ratio), the edges of cispo+none and plain IS both "
        f"below those of grpo+none and dppo_tv+none (all four pairs) in {SURE:.1%} of the paired draws: reproduced; "
        f"either at or above either (ties of two censored edges excluded) in {SURE:.1%}: not reproduced",
        experiment="staleness",
        cells="rollout.policy_lag at N = 1, 6 cold starts",
    )
    _first_look(c, frontier_claims.claim_no_trust_region(root, presets))
    found = _setup(c, root, presets, "rollout.policy_lag")
    if found is None:
        return c
    table, d = found
    changes = table.set_index("row").filter(like="change@")
    same = []
    if changes.shape[1] and "grpo_none" in changes.index:
        grpo = changes.loc["grpo_none"]
        same = [r for r in ("dppo_tv_none", "is_none") if r in changes.index and changes.loc[r].equals(grpo)]
    if same:
        c.notes.append(
            f"grpo_none, {', '.join(same)} are the same runs at every lag (equal changes at every k): at one update per "
            "rollout the ratio their clip, mask or weight reads (the policy over the proximal one that sampled, AReaL's "
            "decoupled loss) is 1, so no trust region acts and this axis cannot tell them apart; ordering them needs "
            "several updates per rollout under a lag (not run)"
        )
    if _none_degrade(c, table, ("grpo_none", "dppo_tv_none", "cispo_none", "is_none")):
        return c
    below = np.ones_like(d["grpo_none"], dtype=bool)
    at_or_above = 0.0
    with np.errstate(invalid="ignore"):
        for a in ("cispo_none", "is_none"):
            for b in ("grpo_none", "dppo_tv_none"):
                below &= d[a] < d[b]
                at_or_above = max(at_or_above, float(np.mean((d[a] >= d[b]) & ~_censored_tie(d[a], d[b]))))
    c.test = f"share of draws with both below both {np.mean(below):.3f}; largest share of one at or above one {at_or_above:.3f}"
    c.verdict = REPRODUCED if np.mean(below) >= SURE else NOT_REPRODUCED if at_or_above >= SURE else INCONCLUSIVE
    c.reason = c.test
    c.plain = (
        f"Plain importance sampling and CISPO against GRPO's clip and DPPO's probability-change mask, as each "
        f"rollout is sampled by an ever older policy (an asynchronous lag of k updates). Edges: {c.statistic}. "
        f"Verdict: **{c.verdict}**. What would change it: {would_change(c.verdict)}."
    )
    return c
