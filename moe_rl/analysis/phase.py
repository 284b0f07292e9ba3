"""Stability phase map: per (lr, N) cell and arm, collapse probability and outcomes across seeds.

Pipeline: `run_outcomes(df)` (one row per run) -> `phase_table` (one row per cell and arm) and
`phase_tests` (one row per cell and compared arm, Holm-corrected over the whole map).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from moe_rl.analysis.accuracy import final_accuracy, late_accuracy, start_accuracy
from moe_rl.analysis.clustered import MIN_UNITS, hierarchical_bootstrap, starts_or_own
from moe_rl.analysis.collapse_definitions import COLLAPSE_DEFINITIONS, MAIN_DEFINITION, collapse_events, collapse_wide
from moe_rl.analysis.load import COLLAPSED_STATUSES, run_key_columns, runs
from moe_rl.analysis.stats import collapse_test, holm, wilson_interval
from moe_rl.metrics.names import REWARD_MEAN

AXES = ("lr", "N")
REFERENCE_ARM = "grpo+none"


def reward_auc(steps: np.ndarray, values: np.ndarray) -> float:
    """Area under the reward curve over the logged steps divided by their span (a mean reward, in reward units)."""
    order = np.argsort(steps)
    s, v = np.asarray(steps, dtype=float)[order], np.asarray(values, dtype=float)[order]
    keep = np.isfinite(v)
    s, v = s[keep], v[keep]
    if len(s) == 0:
        return math.nan
    if len(s) == 1 or s[-1] == s[0]:
        return float(v.mean())
    trapezoid = getattr(np, "trapezoid", None) or getattr(np, "trapz")  # noqa: B009 (numpy < 2 has only trapz)
    return float(trapezoid(v, s) / (s[-1] - s[0]))


def run_outcomes(df: pd.DataFrame, definitions: dict | None = None) -> pd.DataFrame:
    """One row per run: run keys, status, `start_accuracy` (step 0), `final_accuracy` (the last
    evaluation), `late_accuracy` (the mean of the last 3; all three `moe_rl.analysis.accuracy`),
    reward_auc, last_step, in-loop collapse and `collapsed_<def>` / `collapse_step_<def>` /
    `trigger_<def>` for every collapse definition."""
    table = runs(df).set_index("run", drop=False).rename_axis(None)
    table["start_accuracy"] = start_accuracy(df)
    table["final_accuracy"] = final_accuracy(df)
    table["late_accuracy"] = late_accuracy(df)
    rew = df.loc[df["key"] == REWARD_MEAN, ["run", "step", "value"]]
    table["reward_auc"] = pd.Series(
        {r: reward_auc(x["step"].to_numpy(), x["value"].to_numpy()) for r, x in rew.groupby("run")}, dtype=float
    )
    table["collapsed_in_loop"] = (table["n_collapse_events"] > 0) | table["status"].isin(COLLAPSED_STATUSES)
    table["collapse_step_in_loop"] = table["first_collapse_step"]
    wide = collapse_wide(collapse_events(df, definitions)).set_index("run")
    return table.join(wide, how="left").reset_index(drop=True)


def _cells(outcomes: pd.DataFrame, axes: Sequence[str]) -> list[str]:
    missing = [a for a in axes if a not in outcomes.columns]
    if missing:
        raise KeyError(f"phase map axes {missing} are not run keys; run keys: {run_key_columns(outcomes)}")
    return list(axes)


def phase_table(
    outcomes: pd.DataFrame,
    *,
    axes: Sequence[str] = AXES,
    arm_col: str = "arm",
    definition: str = MAIN_DEFINITION,
    confidence: float = 0.95,
    seed: int = 0,
    start_col: str = "start",
) -> pd.DataFrame:
    """Per cell of `axes` and arm: n, the cold starts behind it (`start_col`, each run its own start without
    it), collapsed k, collapse probability with a Wilson interval, mean step of first collapse over the collapsed
    runs, final accuracy and reward AUC with hierarchical bootstrap intervals (starts, then runs within each).
    Below MIN_UNITS starts a cell is descriptive: its intervals are NaN."""
    axes = _cells(outcomes, axes)
    col = f"collapsed_{definition}"
    if col not in outcomes:
        raise KeyError(
            f"no collapse definition {definition!r}; have {[c[10:] for c in outcomes if c.startswith('collapsed_')]}"
        )
    rows = []
    for values, g in outcomes.groupby([*axes, arm_col], sort=True):
        k, n = int(g[col].sum()), len(g)
        starts = starts_or_own(g, start_col)
        decided = starts.nunique() >= MIN_UNITS
        lo, hi = wilson_interval(k, n, confidence) if decided else (math.nan, math.nan)
        row = dict(zip([*axes, arm_col], values))
        row.update(
            {
                "n": n,
                "starts": starts.nunique(),
                "k": k,
                "p_collapse": k / n,
                "p_lo": lo,
                "p_hi": hi,
                "mean_collapse_step": float(g.loc[g[col], f"collapse_step_{definition}"].mean()),
            }
        )
        for name in ("final_accuracy", "reward_auc"):
            mean, mlo, mhi = hierarchical_bootstrap(g[name], starts, confidence=confidence, seed=seed)
            mlo, mhi = (mlo, mhi) if decided else (math.nan, math.nan)
            row.update({name: mean, f"{name}_lo": mlo, f"{name}_hi": mhi})
        rows.append(row)
    return pd.DataFrame(rows)


def phase_tests(
    outcomes: pd.DataFrame,
    *,
    axes: Sequence[str] = AXES,
    arm_col: str = "arm",
    reference: str = REFERENCE_ARM,
    definition: str = MAIN_DEFINITION,
    method: str = "boschloo",
    alpha: float = 0.05,
    start_col: str = "start",
) -> pd.DataFrame:
    """Per cell and arm other than `reference`: reference minus arm collapse probability, a two-sided
    exact test (`collapse_test`), and Holm-adjusted p over every testable (cell, arm) of the map.

    A pair where all runs ended alike (no collapse in either arm, or all collapsed) has p = NaN and
    is not counted in the Holm family: it could never be significant. Nor is a pair whose arms rest on fewer
    than MIN_UNITS cold starts (`start_col`; `descriptive` True): runs of one start are not independent draws.
    """
    axes = _cells(outcomes, axes)
    col = f"collapsed_{definition}"
    rows = []
    for values, g in outcomes.groupby(axes, sort=True):
        ref = g[g[arm_col] == reference]
        if ref.empty:
            continue
        k0, n0 = int(ref[col].sum()), len(ref)
        for arm, h in g[g[arm_col] != reference].groupby(arm_col, sort=True):
            k1, n1 = int(h[col].sum()), len(h)
            # a cell where every run of both arms ended alike cannot reach significance: left out of
            # the Holm family (Tarone), shown as untestable
            starts = min(starts_or_own(ref, start_col).nunique(), starts_or_own(h, start_col).nunique())
            descriptive = starts < MIN_UNITS
            testable = 0 < k0 + k1 < n0 + n1 and not descriptive
            rows.append(
                {
                    **dict(zip(axes, values if isinstance(values, tuple) else (values,))),
                    "arm": arm,
                    "k_ref": k0,
                    "n_ref": n0,
                    "k": k1,
                    "n": n1,
                    "diff": k0 / n0 - k1 / n1,
                    "starts": starts,
                    "descriptive": descriptive,
                    "p_value": collapse_test(k0, n0, k1, n1, method=method) if testable else math.nan,
                }
            )
    columns = [*axes, "arm", "k_ref", "n_ref", "k", "n", "diff", "starts", "descriptive", "p_value"]
    tests = pd.DataFrame(rows, columns=columns)
    tests["p_holm"] = holm(tests["p_value"].to_numpy()) if len(tests) else []
    tests["significant"] = tests["p_holm"] < alpha
    tests.attrs.update(reference=reference, definition=definition, method=method, alpha=alpha)
    return tests


def cell_label(keys: Sequence[str], values: Sequence) -> str:
    """ "lr=0.0003, N=8": a cell's keys and values, numbers in %g."""
    return ", ".join(
        f"{k}={v:g}" if isinstance(v, (int, float, np.number)) else f"{k}={v}" for k, v in zip(keys, values)
    )


def _num(x: float, spec: str = ".2f") -> str:
    return "—" if x is None or not np.isfinite(x) else f"{x:{spec}}"


def _interval(x: float, lo: float, hi: float, spec: str = ".2f") -> str:
    """`x [lo, hi]`, or `x (descriptive)` where the cell rests on too few starts for an interval."""
    if not np.isfinite(lo):
        return _num(x, spec) if not np.isfinite(x) else f"{_num(x, spec)} (descriptive)"
    return f"{_num(x, spec)} [{_num(lo, spec)}, {_num(hi, spec)}]"


def format_phase_markdown(
    table: pd.DataFrame, tests: pd.DataFrame | None = None, *, axes: Sequence[str] = AXES, arm_col: str = "arm"
) -> str:
    """Markdown of `phase_table` (and the matching `phase_tests`, if given) for a results page."""
    axes = list(axes)
    head = [
        *axes,
        arm_col,
        "starts × runs",
        "collapsed",
        "P(collapse) [95% Wilson]",
        "mean first-collapse step",
        "final acc [95% boot]",
        "reward AUC [95% boot]",
    ]
    have_tests = tests is not None and len(tests)
    if have_tests:
        head += [f"vs {tests.attrs.get('reference', REFERENCE_ARM)}: p (Holm)"]
        tmap = tests.set_index([*axes, "arm"])
    lines = ["| " + " | ".join(head) + " |", "|" + ":---|" * (len(axes) + 1) + "---:|" * (len(head) - len(axes) - 1)]
    for _, r in table.iterrows():
        cells = [f"{r[a]:g}" if isinstance(r[a], (float, np.floating)) else str(r[a]) for a in axes]
        cells += [
            str(r[arm_col]),
            f"{int(r['starts'])} × {int(r['n']) / int(r['starts']):.3g}",
            f"{int(r['k'])} of {int(r['n'])}",
            _interval(r["p_collapse"], r["p_lo"], r["p_hi"]),
            _num(r["mean_collapse_step"], ".0f"),
            _interval(r["final_accuracy"], r["final_accuracy_lo"], r["final_accuracy_hi"]),
            _interval(r["reward_auc"], r["reward_auc_lo"], r["reward_auc_hi"], ".3f"),
        ]
        if have_tests:
            key = (*[r[a] for a in axes], r[arm_col])
            if key in tmap.index:
                t = tmap.loc[key]
                cells.append(
                    "descriptive"
                    if t.get("descriptive", False)
                    else "untestable"
                    if np.isnan(t["p_value"])
                    else f"{t['p_value']:.3g} ({t['p_holm']:.3g}){' *' if t['significant'] else ''}"
                )
            else:
                cells.append("ref" if r[arm_col] == tests.attrs.get("reference") else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


__all__ = [
    "AXES",
    "COLLAPSE_DEFINITIONS",
    "REFERENCE_ARM",
    "format_phase_markdown",
    "phase_table",
    "phase_tests",
    "reward_auc",
    "run_outcomes",
]
