"""Arms against a reference arm, within each stratum of the other grouping keys (docs/design.md §7).

Collapse counts: k of n with Wilson intervals and Boschloo's exact test. Continuous outcomes
(final accuracy, the last evaluation as `moe_rl.analysis.accuracy` defines it; reward AUC): paired
by seed (and any pooled key) — arms of a seed share the cold start and the prompts — with the cold
start as the unit (`moe_rl.analysis.clustered`): the mean over starts of the mean paired difference,
a hierarchical bootstrap interval, a sign-flip p with one sign per start and the share of starts
that improve. Below `clustered.MIN_UNITS` starts the difference is descriptive: no interval, no p.
Holm over each column's tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from moe_rl.analysis import clustered
from moe_rl.analysis.power import start_mean_interval
from moe_rl.analysis.stats import collapse_test, holm, wilson_interval

CONTINUOUS = ("final_accuracy", "reward_auc")


def default_reference(values: Sequence[str]) -> str:
    """grpo+r2 (the replay baseline of the papers) when present, else the first value."""
    values = sorted(map(str, values))
    return "grpo+r2" if "grpo+r2" in values else values[0]


def arm_tests(
    outcomes: pd.DataFrame,
    *,
    groups: Sequence[str],
    compare: str = "arm",
    reference: str | None = None,
    collapse_cols: Sequence[str] = ("collapsed_in_loop",),
    pair_on: Sequence[str] = ("seed",),
    start_col: str = "start",
) -> pd.DataFrame:
    """One row per group (`groups`, which include `compare`): collapse k, n, Wilson interval and p vs the
    reference group of the same stratum for each of `collapse_cols` (none below MIN_UNITS starts in either: the
    counts alone, descriptive); for CONTINUOUS outcomes the
    paired difference to the reference (`<name>_diff`, `_lo`, `_hi`, `_p`, `_poi`, and `_starts`, `_pairs`:
    the independent starts and the pairs behind it; `clustered.paired_by_start`), its interval and two-sided p from
    the one t on start means (`power.start_mean_interval`, as the declared studies' rule), so the interval excludes
    0 exactly when p < 0.05. `*_holm` columns hold Holm-adjusted p
    over the table's rows. The reference row has NaN tests. `start_col`: each run's cold start (outcomes
    without it count every pair as its own start).
    """
    groups = list(groups)
    strata = [g for g in groups if g != compare]
    reference = reference or default_reference(outcomes[compare].unique())
    rows = []
    for key, g in outcomes.groupby(groups, sort=True, dropna=False):
        values = dict(zip(groups, key if isinstance(key, tuple) else (key,)))
        row: dict = {**values, "n": len(g), "is_reference": values[compare] == reference}
        ref = outcomes[outcomes[compare] == reference]
        for c in strata:
            ref = ref[ref[c] == values[c]]
        # collapse counts: an interval and a test only where both arms rest on MIN_UNITS starts or more
        n_starts = [clustered.starts_or_own(x, start_col).nunique() for x in (g, ref)]
        row["starts"] = n_starts[0]
        decided = (
            min(n_starts) >= clustered.MIN_UNITS if not row["is_reference"] else n_starts[0] >= clustered.MIN_UNITS
        )
        for col in collapse_cols:
            k = int(g[col].sum())
            row[f"{col}_k"], row[f"{col}_n"] = k, len(g)
            row[f"{col}_lo"], row[f"{col}_hi"] = wilson_interval(k, len(g)) if decided else (math.nan, math.nan)
            k0, n0 = int(ref[col].sum()), len(ref)
            row[f"{col}_p"] = (
                collapse_test(k, len(g), k0, n0)
                if decided and not row["is_reference"] and n0 and 0 < k + k0 < len(g) + n0
                else math.nan
            )
        for name in CONTINUOUS:
            res: dict = {"mean_diff": math.nan, "lo": math.nan, "hi": math.nan, "p_value": math.nan}
            res.update(prob_improvement=math.nan, n_starts=0, n=0)
            if not row["is_reference"] and len(ref) and name in g:
                on = clustered.pair_keys((g, ref), [c for c in pair_on if c in g], start_col)
                cols = [*on, name, *([start_col] if start_col in g and start_col not in on else [])]
                joined = g[cols].merge(ref[cols], on=on, suffixes=("", "_ref"))
                if start_col in on:  # both runs of a pair began from it
                    joined[f"{start_col}_ref"] = joined[start_col]
                if len(joined) and not joined.duplicated(on).any():
                    starts = (
                        joined[start_col].astype(str) + " | " + joined[f"{start_col}_ref"].astype(str)
                        if start_col in g
                        else pd.Series(range(len(joined)))
                    )
                    d = joined[name] - joined[f"{name}_ref"]
                    res = clustered.paired_by_start(d, starts)
                    res["n"] = res.pop("n_pairs")
                    if res["descriptive"] is not None:  # below 5 starts only the difference itself is shown
                        res["prob_improvement"] = math.nan
                    else:  # interval and p from one statistic, the t on start means: they cannot disagree
                        iv = start_mean_interval(d, starts)
                        res.update(lo=iv.lo, hi=iv.hi, p_value=iv.p_value)
            row.update(
                {
                    f"{name}_diff": res["mean_diff"],
                    f"{name}_lo": res["lo"],
                    f"{name}_hi": res["hi"],
                    f"{name}_p": res["p_value"],
                    f"{name}_poi": res["prob_improvement"],
                    f"{name}_starts": res["n_starts"],
                    f"{name}_pairs": res["n"],
                }
            )
        rows.append(row)
    table = pd.DataFrame(rows)
    for col in [c for c in table.columns if c.endswith("_p")]:
        table[f"{col}_holm"] = holm(table[col].to_numpy())
    table.attrs.update(reference=reference, compare=compare)
    return table


def _p(p: float, p_holm: float) -> str:
    return "—" if not np.isfinite(p) else f"{p:.3g} ({p_holm:.3g})"


def _signed(x: float, s: str = ".1f", k: float = 100) -> str:
    """`k * x` with its sign in format `s` (default: percentage points to 0.1), or a dash when not finite."""
    return "—" if not np.isfinite(x) else f"{k * x:+{s}}"


def _interval(r: pd.Series, name: str, s: str = ".1f", k: float = 100) -> str:
    """`diff [lo, hi]`, or `diff (descriptive)` where too few starts stand behind it for an interval."""
    diff = _signed(r[f"{name}_diff"], s, k)
    if np.isfinite(r[f"{name}_lo"]):
        return f"{diff} [{_signed(r[f'{name}_lo'], s, k)}, {_signed(r[f'{name}_hi'], s, k)}]"
    return diff if diff == "—" else f"{diff} (descriptive)"


def format_arm_tests_markdown(
    table: pd.DataFrame, *, groups: Sequence[str], collapse_cols: dict[str, str] | None = None
) -> str:
    """Markdown of `arm_tests`; `collapse_cols` maps a collapse column to its header name."""
    collapse_cols = collapse_cols or {"collapsed_in_loop": "collapsed (in loop)"}
    head = [*groups]
    for name in collapse_cols.values():
        head += [f"{name} [95% Wilson]", "p vs ref (Holm)"]
    head += ["starts × seeds", "Δ final acc (pp) [95% boot]", "p (Holm)", "P(better)", "Δ reward AUC [95% boot]"]
    head += ["p (Holm)"]
    lines = ["| " + " | ".join(head) + " |", "|" + ":---|" * len(groups) + "---:|" * (len(head) - len(groups))]
    for _, r in table.iterrows():
        cells = [str(r[g]).replace("|", "\\|") for g in groups]
        for col in collapse_cols:
            count = f"{int(r[f'{col}_k'])} of {int(r[f'{col}_n'])}"
            if np.isfinite(r[f"{col}_lo"]):
                cells.append(f"{count} [{r[f'{col}_lo']:.2f}, {r[f'{col}_hi']:.2f}]")
                cells.append("ref" if r["is_reference"] else _p(r[f"{col}_p"], r[f"{col}_p_holm"]))
            else:  # below MIN_UNITS starts: the counts describe the runs, no interval and no test
                cells += [f"{count} (descriptive)", "ref" if r["is_reference"] else "—"]
        if r["is_reference"]:
            cells += ["—", "ref", "—", "—", "ref", "—"]
        else:
            a, auc = "final_accuracy", "reward_auc"
            n_starts, n_pairs = int(r[f"{a}_starts"]), int(r[f"{a}_pairs"])
            cells += [
                f"{n_starts} × {n_pairs / n_starts:.3g}" if n_starts else "—",
                _interval(r, a),
                _p(r[f"{a}_p"], r[f"{a}_p_holm"]),
                "—" if not np.isfinite(r[f"{a}_poi"]) else f"{r[f'{a}_poi']:.2f}",
                _interval(r, auc, ".3f", 1),
                _p(r[f"{auc}_p"], r[f"{auc}_p_holm"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
