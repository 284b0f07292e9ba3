"""The staleness study's report (`results/staleness/`): per axis, each row's edge with its interval, the mean accuracy
change at each value, and a figure of change against the axis, an arm per line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moe_rl.analysis.configs import format_starts, start_covariates
from moe_rl.analysis.folder_report import write_csv, write_png
from moe_rl.run.atomic import write_atomic
from moe_rl.studies import staleness as st


def _edge(v: float) -> str:
    if math.isnan(v):
        return "—"
    return "> last value" if v == math.inf else "< first value" if v == -math.inf else f"{v:.2g}"


def _loss(r: pd.Series) -> str:
    if pd.isna(r.get("loss", math.nan)):
        return "—"
    if pd.isna(r["loss_lo"]):
        return f"{100 * r['loss']:+.1f} pp ({r['loss_starts']:.0f} starts: descriptive)"
    return f"{100 * r['loss']:+.1f} pp [{100 * r['loss_lo']:+.1f}, {100 * r['loss_hi']:+.1f}]"


def format_axis(table: pd.DataFrame, axis: st.Axis) -> str:
    head = " | ".join(f"{axis.name.split('.')[-1]} = {v}" for v in axis.values)
    span = f"{axis.values[-1]} minus {axis.values[0]}, paired [95%]"
    lines = [
        f"| row | runs (starts) | edge [95%] | {head} | {span} |",
        "|---|---|---|" + "---|" * (len(axis.values) + 1),
    ]
    for _, r in table.iterrows():
        if not r["runs"]:
            lines.append(f"| {r['row']} | not run yet | |" + " |" * (len(axis.values) + 1))
            continue
        ci = f" [{_edge(r['edge_lo'])}, {_edge(r['edge_hi'])}]" if not r["descriptive"] else f" ({r['descriptive']})"
        cells = []
        for v in axis.values:
            change, down = r.get(f"change@{v}", math.nan), r.get(f"collapsed@{v}", math.nan)
            cells.append("—" if pd.isna(change) else f"{100 * change:+.1f} pp ({100 * down:.0f}% coll.)")
        cells.append(_loss(r))
        lines.append(f"| {r['row']} | {r['runs']} ({r['starts']}) | {_edge(r['edge'])}{ci} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def plot_axes(runs: pd.DataFrame, spec: st.Spec) -> Figure:
    """Per axis a panel: each row's mean accuracy change (pp) against the axis' value, with the runs behind it."""
    fig = Figure(figsize=(5.2 * len(spec.axes), 3.6))
    axes = fig.subplots(1, len(spec.axes), squeeze=False)[0]
    for ax, axis in zip(axes, spec.axes, strict=True):
        on = st.on_axis(runs, axis)
        for arm in axis.rows:
            own = on[on["arm_file"] == arm]
            if own.empty:
                continue
            x = 1 + own["age"].to_numpy(float)
            line = ax.plot(*zip(*sorted((1 + a, 100 * g["change"].mean()) for a, g in own.groupby("age"))), marker="o")
            ax.scatter(x * np.exp(np.random.default_rng(0).uniform(-0.04, 0.04, len(x))), 100 * own["change"],
                       s=6, alpha=0.35, color=line[0].get_color())  # fmt: skip
            line[0].set_label(arm)
        ax.axhline(100 * spec.threshold, color="grey", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_xticks([1 + axis.age(v) for v in axis.values], [str(v) for v in axis.values])
        ax.set_title(axis.label, fontsize=9)
        ax.set_xlabel(f"{axis.name} (log scale of 1 + the oldest sample's age in updates)", fontsize=8)
        ax.set_ylabel("accuracy change (pp)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_staleness_report(runs_dir: Path, out: Path, presets: Path) -> list[Path]:
    """results/staleness: per axis its edges table (edges.csv), runs.csv, starts.csv, staleness.png and summary.md."""
    from moe_rl import analysis

    spec = st.load_spec(presets)
    df = analysis.load_results(runs_dir, keys=st.fr_.KEYS)
    runs = st.per_run(df)
    info = df.drop_duplicates("run").set_index("run")
    runs["run_dir"] = runs["run"].map(info["run_dir"])
    runs["cold_seed"] = runs["run"].map(info["cold_seed"]) if "cold_seed" in info else np.nan
    tables = [st.axis_table(runs, spec, axis)[0] for axis in spec.axes]
    text = ["# staleness", "", (st.__doc__ or "").split("\n\n", 2)[2].replace("\n", " ").strip(), ""]
    for axis, table in zip(spec.axes, tables, strict=True):
        where = f" ({axis.name}, seeds {axis.seeds[0]}..{axis.seeds[-1]})" if axis.key else ""
        text += [f"## {axis.label}{where}", "", format_axis(table, axis)]
    text += [
        "![staleness](staleness.png)",
        "",
        "## The starts (the unit of replication)",
        "",
        format_starts(start_covariates(runs)),
    ]
    write_atomic(out / "summary.md", "\n".join(text).encode())
    written = [out / "summary.md", write_csv(out / "edges.csv", pd.concat(tables, ignore_index=True))]
    shipped = runs.drop(columns=["run_dir"], errors="ignore")  # no machine paths in a shipped table
    written += [write_png(out / "staleness.png", plot_axes(runs, spec)), write_csv(out / "runs.csv", shipped)]
    return [*written, write_csv(out / "starts.csv", start_covariates(runs))]
