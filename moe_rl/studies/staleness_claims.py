"""Claims 10 and 11, re-declared on the staleness axes their papers use (`moe_rl.studies.staleness`).

Both are decided on the `staleness_long` block (`rollout.staleness` S = 1, 2, 4, 8, 24 from seeds 6..17), comparing
edges paired on starts and seeds over the hierarchical bootstrap's draws. An edge past the grid is censored: it is
past every located edge, and two censored edges tie (a tie decides nothing). Their earlier looks are kept in each
claim's notes and counted: the N axis of the frontier (`moe_rl.studies.frontier_claims`), then the first block's axis
(claim 10: `rollout.staleness` to S = 8; claim 11: `rollout.policy_lag`, where at one update per rollout the
decoupled ratio is 1 and GRPO, DPPO-TV and plain IS make the same runs). With three looks an ordering must hold in
1 - 0.05 / 3 of the draws; the second look was read at 1 - 0.05 / 2 when it was the last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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

LOOKS = 3  # the frontier's N axis, the first block's axis, the staleness_long block
SURE = 1 - 0.05 / LOOKS
SECOND_SURE = 1 - 0.05 / 2  # the first block's look, read when it was the second of two
DECIDING = "staleness_long"
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
    return st.axis_tables(runs, spec)


def _look_note(c: Claim, which: str, where: str, old: Claim) -> None:
    c.notes.append(f"{which} look (counted), {where}: {old.verdict} ({old.reason}); rule: {old.rule}")


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


def _span_losses(table: pd.DataFrame) -> str | None:
    """Each row's change at the axis' last value minus its first, paired (`staleness.span_loss`): a summary beside
    the rule, never part of it."""
    if "loss" not in table or table["loss"].isna().all():
        return None
    ends = sorted(float(c.split("@")[1]) for c in table.columns if c.startswith("change@"))

    def one(r: pd.Series) -> str:
        if pd.isna(r["loss"]):
            return f"{r['row']} —"
        ci = f" [{100 * r['loss_lo']:+.1f}, {100 * r['loss_hi']:+.1f}]" if pd.notna(r["loss_lo"]) else " (descriptive)"
        return f"{r['row']} {100 * r['loss']:+.1f}{ci}"

    head = (
        f"not part of the rule: each row's change at {ends[-1]:g} minus at {ends[0]:g}, paired on start and seed (pp)"
    )
    return f"{head}: " + "; ".join(one(r) for _, r in table.iterrows())


def _setup(c: Claim, root: Path, presets: Path, axis: str) -> tuple[pd.DataFrame, dict] | None:
    axes = _axes(str(root), str(presets))
    if axes is None or axis not in axes:
        c.reason = "no data"
        c.notes.append(f"no runs of the staleness study's {axis} yet: `python experiments/staleness.py` runs them")
        return None
    table, drawn = axes[axis]
    c.statistic = _text(table)
    c.notes.append(_changes(table))
    if (loss := _span_losses(table)) is not None:
        c.notes.append(loss)
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


def _vespo_far(c: Claim, table: pd.DataFrame, d: dict, sure: float, what: str) -> Claim:
    if _none_degrade(c, table, ("grpo_none", "sapo_none")):
        return c
    v, g, s = d["vespo_none"], d["grpo_none"], d["sapo_none"]
    with np.errstate(invalid="ignore"):
        far = float(np.mean((v >= FAR * g) & (v >= FAR * s) & np.isfinite(g) & np.isfinite(s)))
        below = max(float(np.mean((v <= g) & ~_censored_tie(v, g))), float(np.mean((v <= s) & ~_censored_tie(v, s))))
    c.test = f"share of draws with vespo {FAR:g}x past both {far:.3f}; at or below one of them {below:.3f}"
    c.verdict = REPRODUCED if far >= sure else NOT_REPRODUCED if below >= sure else INCONCLUSIVE
    c.reason = c.test
    c.plain = (
        f"On VESPO's own staleness design (the rollout grows S-fold and is consumed in one pass of S updates), {what}, "
        f"the S at which each method's accuracy change crosses -5 pp. Edges: {c.statistic}. Verdict: **{c.verdict}**. "
        f"What would change it: {would_change(c.verdict)}."
    )
    return c


def _vespo_rule(values: str, sure: float) -> str:
    return (
        f"on rollout.staleness ({values}; 192 updates per run), vespo+none's edge at least {FAR:g}x (in S) past both "
        f"grpo+none's and sapo+none's, each of theirs located on the grid, in {sure:.1%} of the paired draws: "
        f"reproduced; at or below either one's (ties of two censored edges excluded) in {sure:.1%}: not reproduced"
    )


Decide = Callable[[Claim, pd.DataFrame, dict, float, str], Claim]


@dataclass(frozen=True)
class Look:
    """One look at a staleness block: its axis label, where the claim's notes say it was, and the reading's words."""

    axis: str
    where: str
    what: str


def _looks(c: Claim, first: Claim, second: Claim, looks: tuple[Look, Look], decide: Decide, root: Path, presets: Path,
           note: Callable[[pd.DataFrame], str | None] | None = None) -> Claim:  # fmt: skip
    """The frontier's look (`first`) and the first block's (`second`, read at two looks) into `c`'s notes, counted;
    then `c` decided on the staleness_long block at three looks. `note` adds to the second look's reason."""
    _look_note(c, "first", "on the N axis of the frontier", first)
    found = _setup(second, root, presets, looks[0].axis)
    if found is not None:
        decide(second, *found, SECOND_SURE, looks[0].what)
        if note is not None and (extra := note(found[0])):
            second.reason += f"; {extra}"
    _look_note(c, "second", looks[0].where, second)
    found = _setup(c, root, presets, looks[1].axis)
    return c if found is None else decide(c, *found, SURE, looks[1].what)


def claim_vespo_staleness(root: Path, presets: Path) -> Claim:
    title, source = "VESPO stays stable far past the staleness where GRPO and SAPO collapse", "VESPO, arXiv 2602.10693"
    c = Claim(
        10,
        title,
        source,
        _vespo_rule("the staleness_long block: S = 1, 2, 4, 8, 24, 6 starts x 2 seeds", SURE),
        experiment="staleness",
        cells="rollout.staleness to S = 24 at N = 1, 6 cold starts x 2 seeds",
    )
    second = Claim(10, title, source, _vespo_rule("S = 1, 2, 4, 8, 6 starts", SECOND_SURE))
    looks = (
        Look("rollout.staleness", "on rollout.staleness to S = 8 (seeds 0..5)", "from 6 starts"),
        Look(DECIDING, "", "to S = 24 from 6 starts x 2 seeds"),
    )
    return _looks(c, frontier_claims.claim_vespo_staleness(root, presets), second, looks, _vespo_far, root, presets)


NO_TRUST = ("cispo_none", "is_none")
TRUST = ("grpo_none", "dppo_tv_none")


def _trust_rule(axis: str, sure: float) -> str:
    return (
        f"on {axis}, the edges of cispo+none and plain IS both below those of grpo+none and dppo_tv+none (all four "
        f"pairs) in {sure:.1%} of the paired draws: reproduced; either at or above either (ties of two censored edges "
        f"excluded) in {sure:.1%}: not reproduced"
    )


def _same_runs_note(table: pd.DataFrame) -> str | None:
    """Where the lag axis makes GRPO, DPPO-TV and plain IS the same runs (equal changes at every k), a note saying so."""
    changes = table.set_index("row").filter(like="change@")
    if not changes.shape[1] or "grpo_none" not in changes.index:
        return None
    grpo = changes.loc["grpo_none"]
    same = [r for r in ("dppo_tv_none", "is_none") if r in changes.index and changes.loc[r].equals(grpo)]
    if not same:
        return None
    return (
        f"grpo_none, {', '.join(same)} are the same runs at every lag (equal changes at every k): at one update per "
        "rollout the ratio their clip, mask or weight reads (the policy over the proximal one that sampled, AReaL's "
        "decoupled loss) is 1, so no trust region acts and this axis cannot tell them apart"
    )


def _trust_order(c: Claim, table: pd.DataFrame, d: dict, sure: float, what: str) -> Claim:
    if _none_degrade(c, table, (*TRUST, *NO_TRUST)):
        return c
    below = np.ones_like(d["grpo_none"], dtype=bool)
    at_or_above = 0.0
    with np.errstate(invalid="ignore"):
        for a in NO_TRUST:
            for b in TRUST:
                below &= d[a] < d[b]
                at_or_above = max(at_or_above, float(np.mean((d[a] >= d[b]) & ~_censored_tie(d[a], d[b]))))
    c.test = f"share of draws with both below both {np.mean(below):.3f}; largest share of one at or above one {at_or_above:.3f}"
    c.verdict = REPRODUCED if np.mean(below) >= sure else NOT_REPRODUCED if at_or_above >= sure else INCONCLUSIVE
    c.reason = c.test
    c.plain = (
        f"Plain importance sampling and CISPO against GRPO's clip and DPPO's probability-change mask, {what}. "
        f"Edges: {c.statistic}. Verdict: **{c.verdict}**. What would change it: {would_change(c.verdict)}."
    )
    return c


def claim_no_trust_region(root: Path, presets: Path) -> Claim:
    title, source = "Methods without a trust region collapse as the mismatch grows", "DPPO, arXiv 2602.04879"
    c = Claim(
        11,
        title,
        source,
        _trust_rule("rollout.staleness (the staleness_long block: S = 1, 2, 4, 8, 24, 6 starts x 2 seeds)", SURE),
        experiment="staleness",
        cells="rollout.staleness to S = 24 at N = 1, 6 cold starts x 2 seeds",
    )
    lag = _trust_rule("rollout.policy_lag (k = 0, 4, 8, 16; AReaL's decoupled ratio)", SECOND_SURE)
    looks = (
        Look("rollout.policy_lag", "on rollout.policy_lag (seeds 0..5)", "as each rollout is sampled by an ever older policy"),
        Look(DECIDING, "", "as each rollout grows S-fold and is consumed in one pass (its last mini-batch S - 1 updates stale)"),
    )  # fmt: skip
    first = frontier_claims.claim_no_trust_region(root, presets)
    return _looks(c, first, Claim(11, title, source, lag), looks, _trust_order, root, presets, _same_runs_note)
