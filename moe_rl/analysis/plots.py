"""Figures over a `load_results` frame. Each function returns a matplotlib Figure and does no I/O.

Curves are the mean over the runs (seeds) of a group; the shaded band is their min–max.
Figures are built with `matplotlib.figure.Figure` (not pyplot), so they work under any backend
and are never shown twice in a notebook.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from moe_rl.analysis.load import runs

By = str | Sequence[str]
BAND_NOTE = "mean over seeds, band = min–max"


def _by_list(by: By) -> list[str]:
    return [by] if isinstance(by, str) else list(by)


def _run_labels(df: pd.DataFrame, by: By) -> pd.Series:
    """Group label per run id: the `by` value, or "k=v, k=v" for several columns."""
    cols = _by_list(by)
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise KeyError(f"by={cols}: unknown column(s) {missing}")
    table = runs(df).set_index("run", drop=False).rename_axis(None)[cols]
    if len(cols) == 1:
        return table[cols[0]].astype(str)
    return table.apply(lambda r: ", ".join(f"{c}={r[c]}" for c in cols), axis=1)


def _colors(labels: pd.Series) -> dict[str, tuple]:
    """One colour per group, fixed by the sorted labels of the whole frame (stable across figures)."""
    cmap = colormaps["tab10"]
    return {label: cmap(i % 10) for i, label in enumerate(sorted(labels.unique()))}


def _need(df: pd.DataFrame, keys: Sequence[str]) -> None:
    present = set(df["key"].unique())
    if not any(k in present for k in keys):
        listed = sorted(k for k in present if not re.search(r"/(layer|pos)_\d+$", k))
        raise ValueError(f"none of {list(keys)} in the results; keys present (per layer/position omitted): {listed}")


def _curves(df: pd.DataFrame, key: str, labels: pd.Series) -> pd.DataFrame:
    """Per group and step: mean, min, max over runs (one value per run and step)."""
    sub = df.loc[df["key"] == key, ["run", "step", "value"]]
    per_run = sub.groupby(["run", "step"], as_index=False)["value"].mean()
    per_run["group"] = per_run["run"].map(labels)
    return (
        per_run.groupby(["group", "step"])["value"]
        .agg(["mean", "min", "max", "count"])
        .reset_index()
        .sort_values(["group", "step"])
    )


def _draw_curves(ax: Axes, curves: pd.DataFrame, colors: dict, *, marker: str | None = None) -> None:
    for group, c in curves.groupby("group", sort=True):
        color = colors[group]
        ax.fill_between(c["step"], c["min"], c["max"], color=color, alpha=0.2, linewidth=0)
        ax.plot(c["step"], c["mean"], color=color, marker=marker, label=group)


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes, color="0.4")


def _legend(ax: Axes, by: By) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(title=", ".join(_by_list(by)), fontsize="small")


def plot_metric(df: pd.DataFrame, key: str, *, by: By = "arm", logy: bool = False, title: str | None = None) -> Figure:
    """Any per-step metric vs step, one line per group."""
    _need(df, [key])
    labels = _run_labels(df, by)
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    _draw_curves(ax, _curves(df, key, labels), _colors(labels))
    if logy:
        ax.set_yscale("log")
    ax.set(xlabel="step", ylabel=key, title=title or f"{key} ({BAND_NOTE})")
    _legend(ax, by)
    return fig


def plot_flip_rate(
    df: pd.DataFrame, pair: str = "old_vs_new", *, metric: str = "flip_rate", by: By = "arm"
) -> Figure:
    """Route flip rate vs step for one comparison pair (DESIGN §3), one line per group."""
    key = f"route/{pair}/{metric}"
    _need(df, [key])
    labels = _run_labels(df, by)
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    _draw_curves(ax, _curves(df, key, labels), _colors(labels))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set(
        xlabel="step",
        ylabel=metric.replace("_", " "),
        title=f"Routing {metric.replace('_', ' ')}, {pair.replace('_', ' ')}\n({BAND_NOTE})",
    )
    _legend(ax, by)
    return fig


def _indexed_keys(df: pd.DataFrame, prefix: str, kind: str) -> dict[str, int]:
    """Keys `{prefix}/{kind}_{i}` present in df, mapped to i."""
    pattern = re.compile(rf"^{re.escape(prefix)}/{kind}_(\d+)$")
    found = {k: pattern.match(k) for k in df["key"].unique()}
    return {k: int(m.group(1)) for k, m in found.items() if m}


def _edges(centers: np.ndarray) -> np.ndarray:
    """Cell edges around sorted centres (half-way between neighbours; ±0.5 for a single one)."""
    c = np.asarray(centers, dtype=float)
    if len(c) == 1:
        return np.array([c[0] - 0.5, c[0] + 0.5])
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[c[0] - (mid[0] - c[0])], mid, [c[-1] + (c[-1] - mid[-1])]])


def plot_layer_heatmap(
    df: pd.DataFrame, arm: str | Sequence[str] | None = None, *, pair: str = "old_vs_new", by: By = "arm"
) -> Figure:
    """Per-layer flip rate as a (MoE layer x step) heatmap averaged over seeds, one panel per group.

    `arm` picks one group (or a list); None shows every group that logged per-layer flips.
    """
    layer_of = _indexed_keys(df, f"route/{pair}/flip_rate", "layer")
    if not layer_of:
        raise ValueError(f"no per-layer keys route/{pair}/flip_rate/layer_<i> in the results")
    labels = _run_labels(df, by)
    sub = df.loc[df["key"].isin(layer_of), ["run", "step", "key", "value"]]
    sub = sub.assign(layer=sub["key"].map(layer_of), group=sub["run"].map(labels))
    available = sorted(sub["group"].unique())
    if arm is None:
        groups = available
    else:
        groups = [arm] if isinstance(arm, str) else list(arm)
        unknown = [g for g in groups if g not in available]
        if unknown:
            raise ValueError(f"no per-layer flips for {unknown}; groups with data: {available}")
    # average over runs per (layer, step): runs first, so each seed weighs the same
    per_run = sub.groupby(["group", "run", "layer", "step"])["value"].mean()
    mean = per_run.groupby(["group", "layer", "step"]).mean()
    steps = np.sort(sub["step"].unique())
    layers = np.arange(max(layer_of.values()) + 1)
    grids = {
        g: mean.loc[g].unstack("step").reindex(index=layers, columns=steps).to_numpy(dtype=float) for g in groups
    }
    vmax = max(float(np.nanmax(m)) if np.isfinite(m).any() else 0.0 for m in grids.values()) or 1.0

    fig = Figure(figsize=(8, 0.6 + len(groups) * (0.6 + 0.35 * len(layers))), layout="constrained")
    axes = fig.subplots(len(groups), 1, sharex=True, squeeze=False)[:, 0]
    x, y = _edges(steps), _edges(layers)
    mesh = None
    for ax, g in zip(axes, groups):
        mesh = ax.pcolormesh(x, y, np.ma.masked_invalid(grids[g]), vmin=0.0, vmax=vmax, cmap="viridis")
        ax.set_yticks(layers)
        ax.set(ylabel="MoE layer", title=g)
    axes[-1].set_xlabel("step")
    fig.colorbar(mesh, ax=list(axes), label="flip rate", format=PercentFormatter(1.0))
    fig.suptitle(f"Per-layer routing flip rate, {pair.replace('_', ' ')} (mean over seeds)")
    return fig


def plot_flip_by_position(df: pd.DataFrame, pair: str = "old_vs_new", *, by: By = "arm") -> Figure:
    """Flip rate by response-position bucket (run mean over steps, then mean/min–max over seeds)."""
    pos_of = _indexed_keys(df, f"route/{pair}/flip_rate", "pos")
    if not pos_of:
        raise ValueError(f"no per-position keys route/{pair}/flip_rate/pos_<p> in the results")
    labels = _run_labels(df, by)
    colors = _colors(labels)
    sub = df.loc[df["key"].isin(pos_of), ["run", "key", "value"]]
    per_run = sub.groupby(["run", "key"], as_index=False)["value"].mean()
    per_run = per_run.assign(pos=per_run["key"].map(pos_of), group=per_run["run"].map(labels))
    stats = per_run.groupby(["group", "pos"])["value"].agg(["mean", "min", "max"]).reset_index()
    starts = np.sort(stats["pos"].unique())
    width = int(np.diff(starts).min()) if len(starts) > 1 else 4

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    for group, s in stats.groupby("group", sort=True):
        ax.fill_between(s["pos"], s["min"], s["max"], color=colors[group], alpha=0.2, linewidth=0)
        ax.plot(s["pos"], s["mean"], color=colors[group], marker="o", label=group)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set(
        xlabel=f"response position (first token of a {width}-token bucket)",
        ylabel="flip rate",
        title=f"Routing flip rate by response position, {pair.replace('_', ' ')}\n(mean over steps; {BAND_NOTE})",
    )
    _legend(ax, by)
    return fig


def plot_ratio_variance(df: pd.DataFrame, *, by: By = "arm") -> Figure:
    """Token-ratio and GSPO sequence-ratio variance vs step (log y), one line per group."""
    keys = {"ratio/token_var": "token ratio variance", "ratio/seq_var": "sequence ratio variance"}
    _need(df, list(keys))
    labels = _run_labels(df, by)
    colors = _colors(labels)
    fig = Figure(figsize=(11, 4), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, (key, name) in zip(axes, keys.items()):
        curves = _curves(df, key, labels)
        if curves.empty:
            _no_data(ax, key)
        else:
            _draw_curves(ax, curves, colors)
            ax.set_yscale("log")
        ax.set(xlabel="step", ylabel=f"{name} (before clipping)", title=name)
        _legend(ax, by)
    fig.suptitle(f"Importance-ratio variance ({BAND_NOTE})")
    return fig


def _collapse_points(df: pd.DataFrame, events: pd.DataFrame | None) -> pd.DataFrame:
    """(run, step) of every collapse: from `events` (load_events) or the frame's first_collapse_step."""
    if events is not None:
        return events[["run", "step"]].astype({"run": str})
    first = runs(df).set_index("run")["first_collapse_step"].dropna()
    return pd.DataFrame({"run": first.index, "step": first.to_numpy()})


def plot_reward_accuracy(df: pd.DataFrame, events: pd.DataFrame | None = None, *, by: By = "arm") -> Figure:
    """reward/mean and task/accuracy vs step per group; x markers at each run's collapse step.

    The marker sits on that run's own curve (its value interpolated at the collapse step).
    """
    keys = {"reward/mean": "mean reward", "task/accuracy": "eval accuracy"}
    _need(df, list(keys))
    labels = _run_labels(df, by)
    colors = _colors(labels)
    points = _collapse_points(df, events)
    points = points[points["run"].isin(labels.index)]
    fig = Figure(figsize=(11, 4), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, (key, name) in zip(axes, keys.items()):
        curves = _curves(df, key, labels)
        if curves.empty:
            _no_data(ax, key)
        else:
            _draw_curves(ax, curves, colors, marker="o" if key == "task/accuracy" else None)
        xs, ys, cs = [], [], []
        sub = df.loc[df["key"] == key, ["run", "step", "value"]].dropna()
        for run, step in points.itertuples(index=False):
            own = sub[sub["run"] == run].groupby("step")["value"].mean()
            if own.empty:
                continue
            xs.append(step)
            ys.append(float(np.interp(step, own.index.to_numpy(dtype=float), own.to_numpy())))
            cs.append(colors[labels[run]])
        if xs:
            ax.scatter(xs, ys, c=cs, marker="x", s=70, linewidths=2, zorder=5, label="collapse")
        ax.set(xlabel="step", ylabel=name, title=name)
        _legend(ax, by)
    fig.suptitle(f"Reward and accuracy ({BAND_NOTE}; x = collapse event)")
    return fig
