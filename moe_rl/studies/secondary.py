"""The mission's own outcomes beside every verdict of a declared study: collapse events, route flips (on the routes
the arm acts with and on the live router's), the token importance-ratio variance (early window and run mean) and
the clip fraction, each paired over starts like the primary outcome. They do not change a verdict; they say what
moved.

Per run (`per_run_secondary`, from its long-format metrics):
- `collapsed`: the run's collapse label (`relative` definition, `metrics.collapse`), 0 or 1;
- `flip_acting`: the run mean of the share of (token, MoE layer) routes that differ between the routes an update
  acts with and those of the old pass: `route/used_vs_cached/flip_rate` where the run replays or anchors its
  routes (0 when replay works), else the live router's `route/old_vs_new/flip_rate/offpolicy`;
- `flip_live`: the run mean of `route/old_vs_new/flip_rate/offpolicy`, what the live router would flip;
- `ratio_var_early`, `ratio_var`: the mean of `ratio/token_var/offpolicy` (the variance of the token importance
  ratio over an off-policy update's tokens, computed with the routes the update acts with) over steps 1..20 and
  over the run; contrasts of them are read on the log scale, as a ratio;
- `clip`: the run mean of `ratio/clipfrac_low + ratio/clipfrac_high`, the share of tokens whose ratio was clipped.

Per contrast (`secondary_table`): the contrast's combination of each, its mean over starts with the 95% t interval
over starts (a ratio for the variances), and for a two-cell contrast the collapse counts "k of n" over the paired
runs with the exact McNemar test on the discordant pairs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd
from scipy import stats

from moe_rl.analysis.power import t_interval
from moe_rl.metrics.names import (
    KL_EARLY_STEPS,
    RATIO_CLIPFRAC_HIGH,
    RATIO_CLIPFRAC_LOW,
    RATIO_TOKEN_VAR,
    ROUTE_FLIP_RATE,
    ROUTE_USED_VS_CACHED_FLIP_RATE,
    offpolicy_key,
)

FLIP_LIVE_KEY = offpolicy_key(ROUTE_FLIP_RATE)
RATIO_VAR_KEY = offpolicy_key(RATIO_TOKEN_VAR)
KEYS = (FLIP_LIVE_KEY, ROUTE_USED_VS_CACHED_FLIP_RATE, RATIO_VAR_KEY, RATIO_CLIPFRAC_LOW, RATIO_CLIPFRAC_HIGH)
SECONDARY = {  # column: what it is, in the words of the tables
    "collapsed": "collapse events",
    "flip_acting": "route flips, acting routes",
    "flip_live": "route flips, live router",
    "ratio_var_early": "ratio variance, early",
    "ratio_var": "ratio variance, run mean",
    "clip": "clip fraction",
}
LOG_SCALE = ("ratio_var_early", "ratio_var")  # read as a ratio of the cells (exp of the log combination)


def per_run_secondary(df: pd.DataFrame) -> pd.DataFrame:
    """The secondary outcomes of every run of a long-format frame (columns run, step, key, value) but `collapsed`
    (the run table's own): index run, one column per outcome; NaN where the run did not log it."""
    runs = pd.Index(df["run"].unique(), name="run")

    def mean(key: str, early: bool = False) -> pd.Series:
        rows = df[(df["key"] == key) & ((df["step"] <= KL_EARLY_STEPS) if early else True)]
        return rows.groupby("run")["value"].mean().reindex(runs)

    live = mean(FLIP_LIVE_KEY)
    clip = df[df["key"].isin([RATIO_CLIPFRAC_LOW, RATIO_CLIPFRAC_HIGH])].groupby(["run", "step"])["value"].sum()
    return pd.DataFrame(
        {
            "flip_acting": mean(ROUTE_USED_VS_CACHED_FLIP_RATE).combine_first(live),
            "flip_live": live,
            "ratio_var_early": mean(RATIO_VAR_KEY, early=True),
            "ratio_var": mean(RATIO_VAR_KEY),
            "clip": clip.groupby("run").mean().reindex(runs),
        },
        index=runs,
    )


Pair = Callable[[pd.DataFrame, dict[tuple[str, str], float], str], pd.DataFrame]  # runs, weights, column -> pairs


def _combination(runs: pd.DataFrame, weights: dict[tuple[str, str], float], column: str, pair: Pair) -> pd.DataFrame:
    """Per run seed where every cell ran: the block it counts under and sum_c w_c * column (of its log for
    LOG_SCALE), paired by `pair` as the primary outcome is (the study's `study_rule.pair_values`)."""
    values = runs[column].astype(float)
    if column in LOG_SCALE:
        values = np.log(values.where(values > 0))
    return pair(runs.assign(_value=values), weights, "_value").dropna(subset=["value"])


def secondary_row(
    runs: pd.DataFrame, weights: dict[tuple[str, str], float], column: str, pair: Pair
) -> dict[str, object]:
    """One contrast's reading of one secondary outcome: starts, estimate and 95% t interval over starts (a ratio
    for LOG_SCALE), and for `collapsed` on two cells the counts and the exact McNemar p."""
    pairs = _combination(runs, weights, column, pair)
    means = pairs.groupby("start")["value"].mean().to_numpy(float) if len(pairs) else np.zeros(0)
    row: dict[str, object] = {"outcome": column, "starts": len(means), "estimate": math.nan}
    row.update(lo=math.nan, hi=math.nan)
    if len(means):
        row["estimate"] = float(means.mean())
    if len(means) >= 2 and np.ptp(means) > 0:
        _, lo, hi, _, _ = t_interval(means)
        row.update(lo=float(lo), hi=float(hi))
    elif len(means) >= 2:
        row.update(lo=row["estimate"], hi=row["estimate"])
    if column in LOG_SCALE:
        row.update({k: math.exp(float(row[k])) for k in ("estimate", "lo", "hi")})  # type: ignore[arg-type]
    if column == "collapsed" and len(weights) == 2:
        (a, wa), (b, _) = sorted(weights.items(), key=lambda kv: -kv[1])
        cells = [f"{a[0]}@{a[1]}", f"{b[0]}@{b[1]}"]
        wide = runs[runs["cell"].isin(cells)].pivot_table(index="seed", columns="cell", values=column, aggfunc="first")
        if set(cells) <= set(wide.columns):
            wide = wide[cells].dropna().astype(bool)
            only_a = int((wide[cells[0]] & ~wide[cells[1]]).sum())
            only_b = int((~wide[cells[0]] & wide[cells[1]]).sum())
            row.update(first=cells[0], second=cells[1], runs=len(wide))
            row.update(k_first=int(wide[cells[0]].sum()), k_second=int(wide[cells[1]].sum()))
            row["mcnemar_p"] = float(stats.binomtest(only_a, only_a + only_b).pvalue) if only_a + only_b else 1.0
    return row


def secondary_table(runs: pd.DataFrame, contrasts: dict[str, dict[tuple[str, str], float]], pair: Pair) -> pd.DataFrame:
    """Every secondary outcome of every contrast (name: its cell weights) on the finished runs (`per_run`)."""
    rows = []
    for name, weights in contrasts.items():
        for column in SECONDARY:
            if column in runs and runs[column].notna().any():
                rows.append({"contrast": name, **secondary_row(runs, weights, column, pair)})
    return pd.DataFrame(rows)


def describe(table: pd.DataFrame, contrast: str) -> str:
    """One contrast's secondary outcomes in a line: each with its estimate and interval ("" where none)."""
    parts = []
    for r in table[table["contrast"] == contrast].itertuples():
        name, est, lo, hi = SECONDARY[str(r.outcome)], float(r.estimate), float(r.lo), float(r.hi)  # type: ignore[arg-type]
        if math.isnan(est):
            continue
        text = f"{name} {cell_text(pd.Series({'estimate': est, 'lo': lo, 'hi': hi, 'outcome': r.outcome}))}"
        if r.outcome == "collapsed" and isinstance(getattr(r, "first", None), str):
            text += (
                f" ({int(r.k_first)} vs {int(r.k_second)} of {int(r.runs)}, "  # type: ignore[arg-type]
                f"McNemar p {float(r.mcnemar_p):.2g})"  # type: ignore[arg-type]
            )
        parts.append(text)
    return "; ".join(parts)


def cell_text(r: pd.Series) -> str:
    """ "estimate [lo, hi]" in the outcome's units (no interval where one start gives none)."""
    est, lo, hi = float(r["estimate"]), float(r["lo"]), float(r["hi"])
    if r["outcome"] in LOG_SCALE:
        return f"{est:.2f}x" + ("" if math.isnan(lo) else f" [{lo:.2f}, {hi:.2f}]")
    return f"{100 * est:+.1f} pp" + ("" if math.isnan(lo) else f" [{100 * lo:+.1f}, {100 * hi:+.1f}]")


def markdown(table: pd.DataFrame) -> str:
    """The secondary outcomes as a table: a row per contrast, a column per outcome ("estimate [95% CI]"; the
    collapse counts and McNemar p in their own column)."""
    shown = table[table["starts"] > 0]
    outcomes = [o for o in SECONDARY if o in set(shown["outcome"])]
    head = ["contrast", "starts", *(SECONDARY[o] for o in outcomes), "collapses (McNemar p)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":---", "---:", *([":---"] * (len(head) - 2))]) + "|"]
    for name, g in shown.groupby("contrast", sort=False):
        by = g.set_index("outcome")
        cells = [cell_text(pd.Series({**by.loc[o], "outcome": o})) if o in by.index else "" for o in outcomes]
        counts = ""
        if "collapsed" in by.index and isinstance(by.loc["collapsed"].get("first"), str):
            c = by.loc["collapsed"]
            counts = f"{int(c['k_first'])} vs {int(c['k_second'])} of {int(c['runs'])} ({float(c['mcnemar_p']):.2g})"
        lines.append(f"| {name} | {int(g['starts'].max())} | " + " | ".join([*cells, counts]) + " |")
    return "\n".join(lines)
