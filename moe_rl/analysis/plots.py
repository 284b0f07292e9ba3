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
from moe_rl.metrics.names import (
    FLIP_RATE,
    OLD_VS_NEW,
    RATIO_SEQ_VAR,
    RATIO_TOKEN_VAR,
    REWARD_MEAN,
    TASK_ACCURACY,
    route_key,
)

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


MAX_LINES = 6  # lines per panel a reader can tell apart; more groups are split into panels


def _facets(df: pd.DataFrame, by: By) -> list[tuple[str, pd.Series]]:
    """[(panel title, run -> line label)]: one panel when the groups fit MAX_LINES, else one panel per
    value of the sweep keys after the first `by` column (lines = the first column, e.g. arm)."""
    cols = _by_list(by)
    labels = _run_labels(df, cols)
    if labels.nunique() <= MAX_LINES or len(cols) == 1:
        return [("", labels)]
    table = runs(df).set_index("run", drop=False).rename_axis(None)
    lines = table[cols[0]].astype(str)
    out = []
    for values, g in table.groupby(cols[1:], sort=True):
        values = values if isinstance(values, tuple) else (values,)
        out.append((", ".join(f"{c}={v}" for c, v in zip(cols[1:], values)), lines.loc[g.index]))
    return out


def _grid(n_panels: int, rows: int = 1, *, panel: tuple[float, float] = (4.2, 3.2), max_cols: int = 4):
    """Figure and a (rows, n_panels) array of axes, wrapped into lines of at most `max_cols` panels."""
    cols = min(n_panels, max_cols)
    wraps = -(-n_panels // cols)
    fig = Figure(figsize=(panel[0] * cols, panel[1] * rows * wraps), layout="constrained")
    grid = fig.subplots(rows * wraps, cols, squeeze=False)
    axes = np.empty((rows, n_panels), dtype=object)
    for r in range(rows):
        for i in range(n_panels):
            axes[r, i] = grid[(i // cols) * rows + r, i % cols]
    for extra in grid.flat[:]:
        if extra not in axes.flat:
            extra.set_axis_off()
    return fig, axes


def _titled(title: str, facet: str) -> str:
    return f"{title}\n{facet}" if facet else title


def plot_metric(df: pd.DataFrame, key: str, *, by: By = "arm", logy: bool = False, title: str | None = None) -> Figure:
    """Any per-step metric vs step, one line per group (one panel per sweep value when groups are many)."""
    _need(df, [key])
    facets = _facets(df, by)
    colors = _colors(pd.concat([lab for _, lab in facets]))
    fig, axes = _grid(len(facets), panel=(7, 4) if len(facets) == 1 else (4.2, 3.2))
    for ax, (facet, labels) in zip(axes[0], facets):
        _draw_curves(ax, _curves(df, key, labels), colors)
        if logy:
            ax.set_yscale("log")
        ax.set(
            xlabel="step",
            ylabel=key,
            title=_titled(title or f"{key} ({BAND_NOTE})" if len(facets) == 1 else key, facet),
        )
        _legend(ax, _by_list(by)[:1] if facet else by)
    return fig


def plot_flip_rate(df: pd.DataFrame, pair: str = OLD_VS_NEW, *, metric: str = FLIP_RATE, by: By = "arm") -> Figure:
    """Route flip rate vs step for one comparison pair (docs/design.md §3), one line per group."""
    key = route_key(pair, metric)
    _need(df, [key])
    facets = _facets(df, by)
    colors = _colors(pd.concat([lab for _, lab in facets]))
    fig, axes = _grid(len(facets), panel=(7, 4) if len(facets) == 1 else (4.2, 3.2))
    for ax, (facet, labels) in zip(axes[0], facets):
        _draw_curves(ax, _curves(df, key, labels), colors)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set(
            xlabel="step",
            ylabel=metric.replace("_", " "),
            title=_titled(
                f"Routing {metric.replace('_', ' ')}, {pair.replace('_', ' ')}\n({BAND_NOTE})"
                if len(facets) == 1
                else "",
                facet,
            ),
        )
        _legend(ax, _by_list(by)[:1] if facet else by)
    if len(facets) > 1:
        fig.suptitle(f"Routing {metric.replace('_', ' ')}, {pair.replace('_', ' ')} ({BAND_NOTE})")
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
    df: pd.DataFrame,
    arm: str | Sequence[str] | None = None,
    *,
    pair: str = OLD_VS_NEW,
    by: By = "arm",
    key: str | None = None,
) -> Figure:
    """A per-layer metric as a (MoE layer x step) heatmap averaged over seeds, one panel per group: the
    flip rate of `pair` by default, or any `key` logged per layer as `<key>/layer_<i>` (e.g.
    `ratio/split/flipped_mass`, the share of the token log-ratio mass on tokens whose route changed there).

    `arm` picks one group (or a list); None shows every group that logged the per-layer key.
    """
    key = key or route_key(pair, FLIP_RATE)
    layer_of = _indexed_keys(df, key, "layer")
    if not layer_of:
        raise ValueError(f"no per-layer keys {key}/layer_<i> in the results")
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
            raise ValueError(f"no per-layer {key} for {unknown}; groups with data: {available}")
    # average over runs per (layer, step): runs first, so each seed weighs the same
    per_run = sub.groupby(["group", "run", "layer", "step"])["value"].mean()
    mean = per_run.groupby(["group", "layer", "step"]).mean()
    steps = np.sort(sub["step"].unique())
    layers = np.arange(max(layer_of.values()) + 1)
    grids = {g: mean.loc[g].unstack("step").reindex(index=layers, columns=steps).to_numpy(dtype=float) for g in groups}
    vmax = max(float(np.nanmax(m)) if np.isfinite(m).any() else 0.0 for m in grids.values()) or 1.0

    # panels wrap into a grid of at most 4 columns; panel height grows slowly with depth and is capped,
    # so a 16-group sweep stays about one screen (12 x 9 in) instead of a 2568 px column
    cols = min(len(groups), 4)
    rows = -(-len(groups) // cols)
    panel_h = min(2.6, 0.9 + 0.12 * len(layers))
    fig = Figure(figsize=(min(12.0, 1.2 + 3.3 * cols), min(9.0, 0.8 + rows * panel_h)), layout="constrained")
    grid = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)
    axes = list(grid.flat[: len(groups)])
    for extra in grid.flat[len(groups) :]:
        extra.set_axis_off()
    x, y = _edges(steps), _edges(layers)
    mesh = None
    for i, (ax, g) in enumerate(zip(axes, groups)):
        mesh = ax.pcolormesh(x, y, np.ma.masked_invalid(grids[g]), vmin=0.0, vmax=vmax, cmap="viridis")
        ax.set_yticks(layers if len(layers) <= 8 else layers[:: -(-len(layers) // 8)])
        ax.set_title(g, fontsize="small")
        if i % cols == 0:
            ax.set_ylabel("MoE layer")
        if i >= len(groups) - cols:
            ax.set_xlabel("step")
    if key == route_key(pair, FLIP_RATE):
        label, title = "flip rate", f"Per-layer routing flip rate, {pair.replace('_', ' ')} (mean over seeds)"
    else:
        label, title = key, f"Per-layer {key} (mean over seeds)"
    fig.colorbar(mesh, ax=axes, label=label, format=PercentFormatter(1.0))
    fig.suptitle(title)
    return fig


def plot_flip_by_position(df: pd.DataFrame, pair: str = OLD_VS_NEW, *, by: By = "arm") -> Figure:
    """Flip rate by response-position bucket (run mean over steps, then mean/min–max over seeds)."""
    pos_of = _indexed_keys(df, route_key(pair, FLIP_RATE), "pos")
    if not pos_of:
        raise ValueError(f"no per-position keys route/{pair}/flip_rate/pos_<p> in the results")
    facets = _facets(df, by)
    colors = _colors(pd.concat([lab for _, lab in facets]))
    sub = df.loc[df["key"].isin(pos_of), ["run", "key", "value"]]
    per_run = sub.groupby(["run", "key"], as_index=False)["value"].mean()
    per_run = per_run.assign(pos=per_run["key"].map(pos_of))
    starts = np.sort(per_run["pos"].unique())
    width = int(np.diff(starts).min()) if len(starts) > 1 else 4

    fig, axes = _grid(len(facets), panel=(7, 4) if len(facets) == 1 else (4.2, 3.2))
    for ax, (facet, labels) in zip(axes[0], facets):
        mine = per_run[per_run["run"].isin(labels.index)]
        mine = mine.assign(group=mine["run"].map(labels))
        stats = mine.groupby(["group", "pos"])["value"].agg(["mean", "min", "max"]).reset_index()
        for group, s in stats.groupby("group", sort=True):
            ax.fill_between(s["pos"], s["min"], s["max"], color=colors[group], alpha=0.2, linewidth=0)
            ax.plot(s["pos"], s["mean"], color=colors[group], marker="o", label=group)
        ax.set_xticks(starts)  # one tick per bucket, labelled by its first position
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set(
            xlabel=f"response position (first token of a {width}-token bucket)",
            ylabel="flip rate",
            title=_titled(
                f"Routing flip rate by response position, {pair.replace('_', ' ')}\n(mean over steps; {BAND_NOTE})"
                if len(facets) == 1
                else "",
                facet,
            ),
        )
        _legend(ax, _by_list(by)[:1] if facet else by)
    return fig


def plot_ratio_variance(df: pd.DataFrame, *, by: By = "arm") -> Figure:
    """Token-ratio and GSPO sequence-ratio variance vs step (log y), one line per group."""
    keys = {RATIO_TOKEN_VAR: "token ratio variance", RATIO_SEQ_VAR: "sequence ratio variance"}
    _need(df, list(keys))
    facets = _facets(df, by)
    colors = _colors(pd.concat([lab for _, lab in facets]))
    if len(facets) == 1:  # one row: token and sequence variance side by side
        fig = Figure(figsize=(11, 4), layout="constrained")
        axes = np.asarray(fig.subplots(1, 2), dtype=object).reshape(2, 1)
    else:  # a row per statistic, a column per sweep value
        fig, axes = _grid(len(facets), rows=2, panel=(3.6, 2.8))
    for col, (facet, labels) in enumerate(facets):
        for row, (key, name) in enumerate(keys.items()):
            ax = axes[row, col]
            curves = _curves(df, key, labels)
            if curves.empty:
                _no_data(ax, key)
            else:
                _draw_curves(ax, curves, colors)
                if (curves["max"] > 0).any():  # N = 1: the ratio is exactly 1, the variance 0
                    ax.set_yscale("log")
            ax.set(
                xlabel="step",
                ylabel=f"{name} (before clipping)" if col == 0 or len(facets) == 1 else "",
                title=_titled(name, facet),
            )
            _legend(ax, _by_list(by)[:1] if facet else by)
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
    keys = {REWARD_MEAN: "mean reward", TASK_ACCURACY: "eval accuracy"}
    _need(df, list(keys))
    facets = _facets(df, by)
    colors = _colors(pd.concat([lab for _, lab in facets]))
    if len(facets) == 1:
        fig = Figure(figsize=(11, 4), layout="constrained")
        axes = np.asarray(fig.subplots(1, 2), dtype=object).reshape(2, 1)
    else:
        fig, axes = _grid(len(facets), rows=2, panel=(3.6, 2.8))
    for col, (facet, labels) in enumerate(facets):
        points = _collapse_points(df, events)
        points = points[points["run"].isin(labels.index)]
        for row, (key, name) in enumerate(keys.items()):
            _reward_panel(
                axes[row, col], df, key, _titled(name, facet), labels, colors, points, _by_list(by)[:1] if facet else by
            )
    fig.suptitle(f"Reward and accuracy ({BAND_NOTE}; x = collapse event)")
    return fig


def _reward_panel(
    ax: Axes, df: pd.DataFrame, key: str, name: str, labels: pd.Series, colors: dict, points: pd.DataFrame, by: By
) -> None:
    """One panel of plot_reward_accuracy: curves per group and x at each run's collapse step."""
    curves = _curves(df, key, labels)
    if curves.empty:
        _no_data(ax, key)
    else:
        _draw_curves(ax, curves, colors, marker="o" if key == TASK_ACCURACY else None)
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
    ax.set(xlabel="step", ylabel=name.split("\n")[0], title=name)
    _legend(ax, by)


def _cell_grid(frame: pd.DataFrame, value: str, axes: Sequence[str]) -> tuple[np.ndarray, list, list]:
    """(values as an array [len(y), len(x)], x labels, y labels) of a per-cell column; x = axes[0], y = axes[1]."""
    x_name, y_name = axes
    xs, ys = sorted(frame[x_name].unique()), sorted(frame[y_name].unique())
    grid = frame.pivot_table(index=y_name, columns=x_name, values=value, aggfunc="first")
    return grid.reindex(index=ys, columns=xs).to_numpy(dtype=float), xs, ys


def _cell_axes(ax: Axes, xs: list, ys: list, axes: Sequence[str]) -> None:
    ax.set_xticks(range(len(xs)), [f"{v:g}" if isinstance(v, (int, float, np.number)) else str(v) for v in xs])
    ax.set_yticks(range(len(ys)), [f"{v:g}" if isinstance(v, (int, float, np.number)) else str(v) for v in ys])
    ax.set(xlabel=axes[0], ylabel=axes[1])


def plot_phase_map(
    table: pd.DataFrame, *, axes: Sequence[str] = ("lr", "N"), arm_col: str = "arm", title: str = ""
) -> Figure:
    """Collapse probability per (lr, N) cell, one heatmap per arm, each cell annotated "k/n" (`phase_table`)."""
    if table.empty:
        raise ValueError("empty phase table")
    arms = sorted(table[arm_col].unique())
    fig, grid = _grid(len(arms), panel=(3.6, 3.0))
    mesh = None
    for ax, arm in zip(grid[0], arms):
        sub = table[table[arm_col] == arm]
        values, xs, ys = _cell_grid(sub, "p_collapse", axes)
        k, _, _ = _cell_grid(sub, "k", axes)
        n, _, _ = _cell_grid(sub, "n", axes)
        mesh = ax.imshow(np.ma.masked_invalid(values), origin="lower", vmin=0, vmax=1, cmap="magma_r", aspect="auto")
        for (i, j), v in np.ndenumerate(values):
            if np.isfinite(v):
                ax.text(
                    j,
                    i,
                    f"{int(k[i, j])}/{int(n[i, j])}",
                    ha="center",
                    va="center",
                    color="white" if v > 0.55 else "black",
                    fontsize="small",
                )
        _cell_axes(ax, xs, ys, axes)
        ax.set_title(arm)
    fig.colorbar(mesh, ax=list(grid.flat), label="P(collapse)")
    fig.suptitle(title or "Collapse probability per cell (k/n runs collapsed)")
    return fig


def plot_phase_difference(tests: pd.DataFrame, *, axes: Sequence[str] = ("lr", "N"), title: str = "") -> Figure:
    """Reference-arm minus arm collapse probability per cell (`phase_tests`), one panel per arm;
    * marks cells significant after Holm, · cells that cannot be tested (all runs alike)."""
    if tests.empty:
        raise ValueError("no phase tests (is the reference arm in the results?)")
    ref = tests.attrs.get("reference", "reference")
    arms = sorted(tests["arm"].unique())
    fig, grid = _grid(len(arms), panel=(3.6, 3.0))
    mesh = None
    for ax, arm in zip(grid[0], arms):
        sub = tests[tests["arm"] == arm]
        diff, xs, ys = _cell_grid(sub, "diff", axes)
        sig, _, _ = _cell_grid(sub.assign(sig=sub["significant"].astype(float)), "sig", axes)
        p, _, _ = _cell_grid(sub, "p_value", axes)
        mesh = ax.imshow(np.ma.masked_invalid(diff), origin="lower", vmin=-1, vmax=1, cmap="RdBu_r", aspect="auto")
        for (i, j), v in np.ndenumerate(diff):
            if np.isfinite(v):
                mark = " *" if sig[i, j] == 1 else (" ·" if np.isnan(p[i, j]) else "")
                ax.text(
                    j,
                    i,
                    f"{v:+.2f}{mark}",
                    ha="center",
                    va="center",
                    fontsize="small",
                    color="white" if abs(v) > 0.6 else "black",
                )
        _cell_axes(ax, xs, ys, axes)
        ax.set_title(f"{ref} − {arm}")
    fig.colorbar(mesh, ax=list(grid.flat), label="difference in P(collapse)")
    method = tests.attrs.get("method", "exact")
    fig.suptitle(title or f"Collapse probability difference (* Holm-significant, {method} test; · untestable)")
    return fig


def plot_metric_vs_axis(
    values: pd.DataFrame, metrics: dict[str, str], axis: str, *, by: str = "arm", logx: bool = False
) -> Figure:
    """Per-run summary metrics against a sweep axis: the mean over cold starts of their runs' means with a 95%
    hierarchical bootstrap interval (starts, then runs; none drawn below 5 starts), one line per `by` value, one
    panel per metric. `values`: one row per run with `axis`, `by`, the metric columns and `start` (without it each
    run is its own start); `metrics` maps a column to its axis label."""
    from moe_rl.analysis.clustered import MIN_UNITS, hierarchical_bootstrap, starts_or_own

    def point(s: pd.DataFrame, col: str) -> tuple[float, float, float]:
        starts = starts_or_own(s)
        m, lo, hi = hierarchical_bootstrap(s[col], starts, n_resamples=1999)
        return (m, lo, hi) if starts.nunique() >= MIN_UNITS else (m, np.nan, np.nan)

    groups = sorted(values[by].astype(str).unique())
    colors = {g: colormaps["tab10"](i % 10) for i, g in enumerate(groups)}
    fig, grid = _grid(len(metrics), panel=(4.2, 3.2))
    for ax, (col, label) in zip(grid[0], metrics.items()):
        for g, sub in values.assign(**{by: values[by].astype(str)}).groupby(by, sort=True):
            pts = [(x, *point(s, col)) for x, s in sub.groupby(axis, sort=True)]
            if not pts:
                continue
            x, m, lo, hi = (np.array(v, dtype=float) for v in zip(*pts))
            ax.errorbar(
                x,
                m,
                yerr=[np.nan_to_num(m - lo), np.nan_to_num(hi - m)],
                marker="o",
                capsize=3,
                color=colors[g],
                label=g,
            )
        if logx:
            ax.set_xscale("log")
        ax.set(xlabel=axis, ylabel=label, title=label)
        _legend(ax, by)
    fig.suptitle(f"Per-run means against {axis} (mean over starts, 95% interval from 5 starts up)")
    return fig


def plot_survival(
    outcomes: pd.DataFrame, *, definition: str, axes: Sequence[str] = ("lr", "N"), arm_col: str = "arm", title: str = ""
) -> Figure:
    """Kaplan-Meier curves of time to collapse (censored at a run's last step), one panel per cell in which
    some run collapsed under `definition`, one curve per arm (`run_outcomes` columns)."""
    from moe_rl.analysis.stats import kaplan_meier

    col, step = f"collapsed_{definition}", f"collapse_step_{definition}"
    if col not in outcomes:
        raise ValueError(f"no collapse definition {definition!r} in the outcomes")
    cells = [(v, g) for v, g in outcomes.groupby(list(axes), sort=True) if g[col].any()]
    if not cells:
        raise ValueError(f"no run collapsed under {definition!r}: nothing to draw")
    fig, grid = _grid(len(cells), panel=(3.8, 3.0))
    for ax, (values, g) in zip(grid.flat, cells):
        for arm, h in g.groupby(arm_col, sort=True):
            event = h[col].to_numpy(bool)
            time = np.where(event, h[step], h["last_step"]).astype(float)
            km = kaplan_meier(time, event)
            xs = np.r_[0.0, km["time"].to_numpy(), time.max()]
            ys = np.r_[1.0, km["survival"].to_numpy(), km["survival"].iloc[-1] if len(km) else 1.0]
            ax.step(xs, ys, where="post", label=f"{arm} ({int(event.sum())} of {len(h)})")
        values = values if isinstance(values, tuple) else (values,)
        ax.set_title(", ".join(f"{a}={v:g}" for a, v in zip(axes, values)), fontsize="medium")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize="x-small")
    for ax in list(grid.flat)[len(cells) :]:
        ax.set_visible(False)
    grid.flat[0].set_ylabel("runs not yet collapsed (Kaplan-Meier)")
    fig.suptitle(title or f"Time to collapse per cell, {definition} definition")
    return fig
