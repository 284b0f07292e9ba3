"""Router shift (RSPO, arXiv 2510.23027) against clip bursts and collapse: does the router move first?

Two views over a `load_results` frame: the lagged cross-correlation of step-to-step changes in the
router shift (1 - gamma) with changes in the clip fraction, and the event-aligned means of both
around each collapse event. Pure: returns frames and Figures, no I/O.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moe_rl.analysis.collapse_definitions import HISTORY_KEYS, MAIN_DEFINITION, collapse_events, main_definition_kwargs
from moe_rl.analysis.stats import event_aligned_mean, lagged_xcorr
from moe_rl.metrics.names import RATIO_CLIPFRAC_HIGH, RATIO_CLIPFRAC_LOW, ROUTE_SHIFT_MEAN, offpolicy_key

SHIFT_KEY = ROUTE_SHIFT_MEAN  # gamma in (0, 1]: 1 = the router did not move (moe_rl.routing.router_shift)
SHIFT_KEYS = (offpolicy_key(SHIFT_KEY), SHIFT_KEY)  # the off-policy mean (updates 2..N) where logged
SHIFT_AMOUNT = "router shift 1 - gamma"
CLIP_KEYS = (RATIO_CLIPFRAC_LOW, RATIO_CLIPFRAC_HIGH)
MAX_LAG = 5
CLIP = "clip fraction (low + high)"


def pooled_xcorr(
    df: pd.DataFrame, x_key: str, y_keys: tuple[str, ...], *, max_lag: int = MAX_LAG, diff: bool = True
) -> pd.DataFrame:
    """Per run `lagged_xcorr(x, sum of y_keys)` over steps (first differences when `diff`, so slow
    trends do not masquerade as a lead); one row per (run, lag) with r and n (router_shift.png)."""
    rows = []
    for run, g in df[df["key"].isin([x_key, *y_keys])].groupby("run"):
        wide = g.pivot_table(index="step", columns="key", values="value").sort_index()
        if x_key not in wide or not all(k in wide for k in y_keys) or len(wide) < 2 * max_lag + 5:
            continue
        x, y = wide[x_key].to_numpy(), wide[list(y_keys)].sum(axis=1, min_count=len(y_keys)).to_numpy()
        if diff:
            x, y = np.diff(x), np.diff(y)
        rows.append(lagged_xcorr(x, y, max_lag).assign(run=run))
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=["lag", "r", "n", "run"])


def shift_series(df: pd.DataFrame) -> pd.DataFrame:
    """Per run and step: the router shift 1 - gamma (off-policy mean where logged) and the clip fraction."""
    key = next((k for k in SHIFT_KEYS if k in set(df["key"])), None)
    if key is None:
        raise ValueError(f"none of {list(SHIFT_KEYS)} in these runs")
    shift = df[df["key"] == key].assign(key=SHIFT_AMOUNT, value=lambda f: 1.0 - f["value"])
    clip = df[df["key"].isin(CLIP_KEYS)].groupby(["run", "step"], as_index=False)["value"].sum().assign(key=CLIP)
    return pd.concat([shift[["run", "step", "key", "value"]], clip], ignore_index=True)


def event_aligned_shift(df: pd.DataFrame, *, before: int = 30, after: int = 10) -> tuple[pd.DataFrame, int]:
    """Mean shift and clip fraction at each offset from the collapse events (main definition), and the
    number of events."""
    events = collapse_events(df[df["key"].isin(HISTORY_KEYS)], {MAIN_DEFINITION: main_definition_kwargs()})
    events = events[events["collapsed"]][["run", "step"]]
    series = shift_series(df)
    frames = []
    for name in (SHIFT_AMOUNT, CLIP):
        values = series.loc[series["key"] == name, ["run", "step", "value"]]
        frames.append(event_aligned_mean(values, events, before=before, after=after).assign(series=name))
    return pd.concat(frames, ignore_index=True), len(events)


def plot_shift_dynamics(df: pd.DataFrame, *, max_lag: int = 5, before: int = 30, after: int = 10) -> Figure:
    """Left: pooled r(lag) of first differences, shift at t vs clip fraction at t + lag (positive lag:
    shift leads), band = 2.5-97.5% of runs. Right: event-aligned means around collapse events."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    series = shift_series(df)
    per_run = pooled_xcorr(series, SHIFT_AMOUNT, (CLIP,), max_lag=max_lag)
    table = per_run.pivot_table(index="run", columns="lag", values="r").dropna(how="all") if len(per_run) else None
    if table is not None and len(table):
        lags = table.columns.to_numpy()
        left.fill_between(
            lags, table.quantile(0.025), table.quantile(0.975), color="tab:blue", alpha=0.2, label="2.5-97.5% of runs"
        )
        left.plot(lags, table.mean(), "o-", color="tab:blue", label=f"mean over {len(table)} runs")
        left.axvline(0, color="0.5", lw=0.8)
        left.axhline(0, color="0.5", lw=0.8)
        left.legend(fontsize=8)
    else:  # say why the panel is empty
        left.text(
            0.5,
            0.5,
            f"no run with >= {2 * max_lag + 5} steps where router shift\nand clip fraction both vary step to step",
            ha="center",
            va="center",
            transform=left.transAxes,
        )
    left.set_xlabel("lag (steps; > 0: router shift leads the clip fraction)")
    left.set_ylabel("Pearson r of first differences")
    left.set_title("Router shift vs clip fraction, step to step")
    aligned, n_events = event_aligned_shift(df, before=before, after=after)
    if n_events:
        twin = right.twinx()
        for ax, name, color in ((right, SHIFT_AMOUNT, "tab:purple"), (twin, CLIP, "tab:orange")):
            sub = aligned[aligned["series"] == name]
            ax.plot(sub["offset"], sub["mean"], color=color, label=name)
            ax.fill_between(sub["offset"], sub["mean"] - sub["sem"], sub["mean"] + sub["sem"], color=color, alpha=0.2)
            ax.set_ylabel(name, color=color)
        right.axvline(0, color="0.3", ls="--", lw=0.8)
        right.set_title(f"Around {n_events} collapse events (mean ± s.e.m.)")
    else:
        right.text(0.5, 0.5, "no collapse events", ha="center", va="center", transform=right.transAxes)
        right.set_title("Around collapse events")
    right.set_xlabel("steps from the collapse event (main definition)")
    return fig


def shift_summary(df: pd.DataFrame, *, max_lag: int = 5) -> dict:
    """Pooled r at each lag (mean over runs) and the number of runs, for a LOG entry or a table."""
    per_run = pooled_xcorr(shift_series(df), SHIFT_AMOUNT, (CLIP,), max_lag=max_lag)
    mean_r = per_run.groupby("lag")["r"].mean() if len(per_run) else pd.Series(dtype=float)
    return {
        "n_runs": int(per_run["run"].nunique()) if len(per_run) else 0,
        "mean_r": {int(k): float(v) for k, v in mean_r.items()},
        "peak_lag": int(mean_r.idxmax()) if len(mean_r) and np.isfinite(mean_r).any() else None,
    }
