"""Tables across seeds: per-run means, then their mean and spread over runs."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd

from moe_rl.analysis.accuracy import final_accuracy, start_accuracy
from moe_rl.analysis.dose import kl_per_run
from moe_rl.analysis.load import COLLAPSED_STATUSES, INCOMPLETE_STATUSES, run_key_columns, runs
from moe_rl.metrics.names import (
    KL_UPDATE_K3,
    OFFPOLICY_SUFFIX,
    RATIO_CLIPFRAC_HIGH,
    RATIO_CLIPFRAC_LOW,
    RATIO_SEQ_VAR,
    RATIO_SPLIT_ROUTING_SHARE,
    RATIO_TOKEN_VAR,
    ROUTE_EXPERT_FLIP_FRAC,
    ROUTE_FLIP_RATE,
)

# t_{0.975, dof} for dof = 1..30 (two-sided 95%); checked against a numeric CDF in the tests
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip

# summary name -> metric key; each is averaged over a run's steps, then across seeds
SUMMARY_METRICS = {
    "flip_rate": ROUTE_FLIP_RATE,
    "expert_flip_frac": ROUTE_EXPERT_FLIP_FRAC,
    "token_var": RATIO_TOKEN_VAR,
    "routing_share": RATIO_SPLIT_ROUTING_SHARE,
    "seq_var": RATIO_SEQ_VAR,
    "clipfrac_low": RATIO_CLIPFRAC_LOW,
    "clipfrac_high": RATIO_CLIPFRAC_HIGH,
}
VARIANTS = ("auto", "all", "offpolicy")


def t_quantile_975(dof: int) -> float:
    """t_{0.975, dof}: table for dof <= 30, Cornish-Fisher expansion (A&S 26.7.5) beyond."""
    if dof < 1:
        return math.nan
    if dof <= len(_T975):
        return _T975[dof - 1]
    z = 1.959963984540054
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / dof + g2 / dof**2 + g3 / dof**3 + g4 / dof**4


def mean_ci95(values: Sequence[float] | pd.Series) -> tuple[float, float]:
    """(mean, 95% half-width) over the non-NaN values: t_{0.975,n-1} * sd / sqrt(n); NaN for n < 2."""
    x = pd.Series(values, dtype="float64").dropna()
    n = len(x)
    if n == 0:
        return math.nan, math.nan
    mean = float(x.mean())
    if n < 2:
        return mean, math.nan
    return mean, t_quantile_975(n - 1) * float(x.std(ddof=1)) / math.sqrt(n)


def per_run_mean(df: pd.DataFrame, key: str, *, last_frac: float = 1.0) -> pd.Series:
    """Mean of `key` per run over the last `last_frac` of that run's logged steps (1.0 = all)."""
    if not 0.0 < last_frac <= 1.0:
        raise ValueError(f"last_frac must be in (0, 1], got {last_frac}")
    sub = df.loc[df["key"] == key, ["run", "step", "value"]]
    if last_frac < 1.0 and len(sub):
        steps = sub.groupby("run")["step"]
        rank = steps.rank(method="dense", ascending=False)  # 1 = last step
        keep = np.ceil(last_frac * steps.transform("nunique"))
        sub = sub[rank <= keep]
    return sub.groupby("run")["value"].mean()


def grouping(
    df: pd.DataFrame, by: Sequence[str] | str, pool: Sequence[str] = ()
) -> tuple[list[str], list[str], list[str]]:
    """(group columns, keys added to `by`, keys pooled) for a table that must not average unlike runs.

    Every run key that still varies inside a group of `by` is added, in column order, unless it is
    in `pool`; keys fixed by the ones already there (algo and replay under arm) add nothing. The
    pooled keys are `pool` (those that vary) and seed.
    """
    by = [by] if isinstance(by, str) else list(by)
    table = runs(df)
    unknown = [c for c in [*by, *pool] if c not in table.columns]
    if unknown:
        raise KeyError(f"unknown run key(s) {unknown}; run keys are {run_key_columns(df)}")
    cols, added = list(by), []
    for c in run_key_columns(df):
        if c in cols or c in pool or c in ("run", "seed"):
            continue
        if table.groupby(cols, dropna=False)[c].nunique(dropna=False).gt(1).any():
            cols.append(c)
            added.append(c)
    pooled = [c for c in pool if table.groupby(cols, dropna=False)[c].nunique(dropna=False).gt(1).any()]
    return cols, added, [*pooled, "seed"]


def variant_per_run(df: pd.DataFrame, key: str, variant: str = "auto", *, last_frac: float = 1.0) -> pd.Series:
    """Per-run mean of `key` or of its off-policy companion `key/offpolicy` (updates 2..N only).

    "all": every update; "offpolicy": updates 2..N (NaN where a run did not log them); "auto": the
    off-policy value for runs with N > 1 that logged it, else every update. Update 1 of a step runs
    on the old policy's weights, so its flips and ratio spread are zero and dilute the step mean.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not valid; valid: {list(VARIANTS)}")
    every = per_run_mean(df, key, last_frac=last_frac)
    off = per_run_mean(df, key + OFFPOLICY_SUFFIX, last_frac=last_frac)
    if variant == "all" or off.empty:  # a key without an off-policy companion (e.g. clip fractions)
        return every
    if variant == "offpolicy":
        return off.reindex(every.index.union(off.index))
    out = every.copy()
    n = runs(df).set_index("run")["N"] if "N" in df.columns else None
    use = off.index if n is None else off.index[n.reindex(off.index).fillna(2).to_numpy() > 1]
    out = out.reindex(out.index.union(use))
    out.loc[use] = off.loc[use]
    return out


def summarize(
    df: pd.DataFrame,
    *,
    by: Sequence[str] | str = ("arm",),
    last_frac: float = 1.0,
    variant: str = "all",
    pool: Sequence[str] = (),
) -> pd.DataFrame:
    """One row per `by` combination, aggregated across seeds (one value per run, then mean ± 95% CI).

    Per-run values: mean over steps (the last `last_frac` of them) of each SUMMARY_METRICS key (or
    its off-policy companion, see `variant_per_run`);
    `final_accuracy` = the last evaluation (`moe_rl.analysis.accuracy`); `accuracy_gain` = the last
    minus the first (step 0) evaluation; where runs logged `kl/update_k3`, `update_kl_early` and `update_kl`, the
    realised per-update KL over steps 1..20 and over the run (`moe_rl.analysis.dose.kl_summary`). Across runs:
    `<name>_mean`, `<name>_ci95` (Student-t half-width, NaN for one run: it treats the runs as independent, which
    runs of one cold start are not) and `<name>_sd` (their spread). `collapsed` is "k of n" (a run counts when it
    logged a collapse event or its status is collapsed/diverged); `first_collapse_step` is the earliest over the group's runs. A group that
    mixes runs differing in a key outside `by` and `pool` is averaged with a warning (see `grouping`).
    """
    by = [by] if isinstance(by, str) else list(by)
    missing = [c for c in by if c not in df.columns]
    if missing:
        raise KeyError(f"summarize(by=...): unknown column(s) {missing}; run keys are {run_key_columns(df)}")
    table = runs(df).set_index("run", drop=False).rename_axis(None)
    for name, key in SUMMARY_METRICS.items():
        table[name] = variant_per_run(df, key, variant, last_frac=last_frac)
    final = final_accuracy(df)
    table["final_accuracy"] = final
    table["accuracy_gain"] = final - start_accuracy(df)
    table["is_collapsed"] = (table["n_collapse_events"] > 0) | table["status"].isin(COLLAPSED_STATUSES)
    measured = [*SUMMARY_METRICS, "final_accuracy", "accuracy_gain"]
    if (df["key"] == KL_UPDATE_K3).any():  # the realised per-update KL, where the runs logged it
        kl = kl_per_run(df)
        table["update_kl_early"], table["update_kl"] = kl["kl_early"], kl["kl_mean"]
        measured += ["update_kl_early", "update_kl"]

    others = [c for c in run_key_columns(df) if c not in {*by, *pool, "run", "seed"}]
    mixed: set[str] = set()
    rows = []
    for values, g in table.groupby(by, sort=True, dropna=False):
        mixed.update(c for c in others if g[c].nunique(dropna=False) > 1)
        row: dict = dict(zip(by, values))
        row["n_seeds"] = len(g)
        row["n_incomplete"] = int(g["status"].isin(INCOMPLETE_STATUSES).sum())
        for name in measured:
            row[f"{name}_mean"], row[f"{name}_ci95"] = mean_ci95(g[name])
            row[f"{name}_sd"] = float(g[name].std(ddof=1)) if g[name].notna().sum() > 1 else math.nan
        k = int(g["is_collapsed"].sum())
        row["n_collapsed"] = k
        row["collapsed"] = f"{k} of {len(g)}"
        row["first_collapse_step"] = float(g["first_collapse_step"].min())  # NaN when none
        rows.append(row)
    if mixed:
        warnings.warn(
            f"summarize(by={by}): groups mix runs that differ in {sorted(mixed)}; add them to `by`",
            stacklevel=2,
        )
    return pd.DataFrame(rows)


# (header, summary name, format): pct = fraction shown in %, pp = difference of fractions in
# percentage points, num = plain number (scientific when small)
_MD_COLUMNS = (
    ("flip rate (%)", "flip_rate", "pct"),
    ("expert flip (%)", "expert_flip_frac", "pct"),
    ("token ratio var", "token_var", "num"),
    ("routing share (%)", "routing_share", "pct"),
    ("seq ratio var", "seq_var", "num"),
    ("clip low (%)", "clipfrac_low", "pct"),
    ("clip high (%)", "clipfrac_high", "pct"),
    ("final acc (%)", "final_accuracy", "pct"),
    ("acc gain (pp)", "accuracy_gain", "pp"),
)
_KL_COLUMNS = (("update KL, steps <= 20", "update_kl_early", "num"), ("update KL, run", "update_kl", "num"))
DASH = "—"


def _column_style(means: pd.Series, kind: str) -> str:
    """One number format per column, so cells line up: decimals for %, fixed or scientific otherwise."""
    finite = means[np.isfinite(means) & (means != 0)].abs()
    if kind in ("pct", "pp"):
        return ".1f" if finite.empty or (100 * finite).min() >= 1 else ".2f"
    return ".1e" if len(finite) and (finite.min() < 1e-2 or finite.max() >= 1e4) else ".3g"


def _fmt_pair(mean: float, ci: float, kind: str, spec: str) -> str:
    if not np.isfinite(mean):
        return DASH if np.isnan(mean) else f"{mean}"
    if kind in ("pct", "pp"):
        mean, ci = 100 * mean, 100 * ci
    text = f"{mean:{'+' if kind == 'pp' else ''}{spec}}"
    return text if np.isnan(ci) else f"{text} ± {ci:{spec}}"


def format_summary_markdown(summary: pd.DataFrame) -> str:
    """Markdown table of a `summarize` result: "mean ± SD" cells (the runs' spread, not an interval: runs of one cold
    start are not independent, so a seed-level interval would claim what they cannot show), rates in %, "—" where
    missing."""
    by = list(summary.columns[: list(summary.columns).index("n_seeds")])
    columns = [*_MD_COLUMNS, *(c for c in _KL_COLUMNS if f"{c[1]}_mean" in summary)]
    headers = [*by, "seeds"]
    if "n_incomplete" in summary and summary["n_incomplete"].gt(0).any():
        headers.append("incomplete")
    headers += [h for h, _, _ in columns] + ["collapsed", "first collapse"]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join([":---"] * len(by) + ["---:"] * (len(headers) - len(by))) + "|",
    ]
    nan = pd.Series(np.nan, index=summary.index)
    styles = {name: _column_style(summary.get(f"{name}_mean", nan).astype(float), kind) for _, name, kind in columns}
    for _, row in summary.iterrows():
        cells = [str(row[c]).replace("|", "\\|") for c in by] + [str(int(row["n_seeds"]))]
        if "incomplete" in headers:
            cells.append(str(int(row["n_incomplete"])))
        for _, name, kind in columns:
            mean, ci = (float(row.get(f"{name}_{s}", np.nan)) for s in ("mean", "sd"))
            cells.append(_fmt_pair(mean, ci, kind, styles[name]))
        step = row["first_collapse_step"]
        cells += [str(row["collapsed"]), DASH if pd.isna(step) else str(int(step))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
