"""The frontier table, its figure and its report section (`results/frontier/`).

Per row (model, arm): the edge on each axis with its bracket and bootstrap interval, the headroom against
grpo+none (edge ratio, with an interval), the price of stability (reward AUC where every arm learns, paired by
seed against grpo+none) and the bench's outcome at its edge cell (lr 3e-4, N = 8).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moe_rl.analysis.clustered import descriptive_reason, paired_by_start
from moe_rl.analysis.folder_report import with_provenance, write_csv, write_png
from moe_rl.analysis.stats import pair_by
from moe_rl.run.atomic import write_atomic
from moe_rl.studies import frontier as fr_

BENCH_CELL = {"lr": 3e-4, "N": 8}  # the stabilizer bench's edge cell


def row_label(runs: pd.DataFrame, row: tuple[str, str]) -> str:
    """The arm's name as runs log it (`sapo+none+tau_pos=5+tau_neg=5`), `(dense)` for the dense model."""
    family, arm = row
    found = runs.loc[(runs["family"] == family) & (runs["arm_file"] == arm), "arm"]
    name = str(found.iloc[0]) if len(found) else arm
    return name if family == fr_.REFERENCE[0] else f"{name} ({family.split('_')[-1]})"


def price(runs: pd.DataFrame, row: tuple[str, str]) -> tuple[float, float, float, int]:
    """Reward AUC at the price point minus grpo+none's, paired on (cold start, seed): (difference, lo, hi, pairs); the
    interval over starts, then seeds (`paired_by_start`), NaN below 5 starts (the difference is then descriptive)."""
    a, b = fr_.at_point(runs, row, fr_.PRICE_POINT), fr_.at_point(runs, fr_.REFERENCE, fr_.PRICE_POINT)
    if row == fr_.REFERENCE or a.empty or b.empty:
        return np.nan, np.nan, np.nan, 0
    both = pd.concat([a.assign(side="a"), b.assign(side="b")])
    pairs = pair_by(both, arm_col="side", a="a", b="b", value="reward_auc", on=("start", "seed"))
    if len(pairs) < 2:
        return np.nan, np.nan, np.nan, len(pairs)
    test = paired_by_start(pairs["a"] - pairs["b"], pairs["start"])
    return float(test["mean_diff"]), float(test["lo"]), float(test["hi"]), len(pairs)  # type: ignore[arg-type]


def frontier_table(runs: pd.DataFrame, fr: fr_.Frontier, edges: dict | None = None) -> pd.DataFrame:
    """One row per frontier row: edges, intervals, headroom against grpo+none, price and the bench cell."""
    edges = edges if edges is not None else fr_.edges(runs, fr)
    out = []
    for row in fr.rows:
        rec: dict = {"arm": row_label(runs, row), "family": row[0], "arm_file": row[1]}
        own = runs[(runs["family"] == row[0]) & (runs["arm_file"] == row[1])]
        rec["starts"] = int(own["start"].nunique())
        few = descriptive_reason(rec["starts"])  # the edges' intervals resample seeds: from 5 starts up only
        for axis in fr.axes:
            edge, ref = edges[(row, axis.name)], edges[(fr_.REFERENCE, axis.name)]
            rec[f"{axis.name}_edge"] = edge.label
            rec[f"{axis.name}_interval"] = (
                f"({rec['starts']} start{'s' * (rec['starts'] != 1)})" if few else edge.interval
            )
            rec[f"{axis.name}_runs"] = int(edge.points["n"].sum()) if len(edge.points) else 0
            ratio = fr_.edge_ratio(edge, ref) if edge.located and ref.located else (np.nan,) * 3
            ratio = (ratio[0], np.nan, np.nan) if few else ratio
            rec[f"{axis.name}_headroom"], rec[f"{axis.name}_headroom_lo"], rec[f"{axis.name}_headroom_hi"] = ratio
        rec["price_auc_diff"], rec["price_lo"], rec["price_hi"], rec["price_pairs"] = price(runs, row)
        bench = fr_.at_point(runs, row, BENCH_CELL)
        rec["bench_change"] = float(bench["change"].mean()) if len(bench) else np.nan
        rec["bench_survival"] = float(1 - bench["collapsed"].mean()) if len(bench) else np.nan
        rec["bench_runs"] = len(bench)
        out.append(rec)
    return pd.DataFrame(out)


def _ratio(r: pd.Series, axis: str) -> str:
    if r["arm_file"] == fr_.REFERENCE[1] and r["family"] == fr_.REFERENCE[0]:
        return "ref"
    if pd.isna(r[f"{axis}_headroom"]):
        return "—"
    if pd.isna(r[f"{axis}_headroom_lo"]):  # fewer than 5 starts: descriptive
        return f"{r[f'{axis}_headroom']:.2g}x"
    return f"{r[f'{axis}_headroom']:.2g}x [{r[f'{axis}_headroom_lo']:.2g}, {r[f'{axis}_headroom_hi']:.2g}]"


def _price(r: pd.Series) -> str:
    if pd.isna(r["price_auc_diff"]):
        return "ref" if (r["family"], r["arm_file"]) == fr_.REFERENCE else "—"
    if pd.isna(r["price_lo"]):  # fewer than 5 starts: descriptive
        return f"{r['price_auc_diff']:+.3f} (descriptive)"
    return f"{r['price_auc_diff']:+.3f} [{r['price_lo']:+.3f}, {r['price_hi']:+.3f}]"


def format_frontier_markdown(table: pd.DataFrame, fr: fr_.Frontier) -> str:
    """The frontier table as markdown: an edge is the last stable point (the first unstable in parentheses)."""
    names = {a.name: ("lr at N = 8" if a.name == "lr" else f"N at lr {a.fixed.get('lr', 0):g}") for a in fr.axes}
    head = ["arm"]
    for a in fr.axes:
        head += [f"{names[a.name]}: edge", "95% boot", "headroom vs grpo+none", "runs"]
    head += ["price: Δ reward AUC at lr 1e-4, N = 8", "bench cell: Δ acc (pp), survival"]
    lines = ["| " + " | ".join(head) + " |", "|:---|" + "---:|" * (len(head) - 1)]
    for _, r in table.iterrows():
        cells = [str(r["arm"])]
        for a in fr.axes:
            cells += [r[f"{a.name}_edge"], r[f"{a.name}_interval"], _ratio(r, a.name), str(r[f"{a.name}_runs"])]
        cells.append(_price(r))
        bench = "—" if not r["bench_runs"] else f"{100 * r['bench_change']:+.1f}, {100 * r['bench_survival']:.0f}%"
        cells.append(f"{bench} ({r['bench_runs']})" if r["bench_runs"] else bench)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_frontier(runs: pd.DataFrame, fr: fr_.Frontier, edges: dict | None = None) -> Figure:
    """Per axis a panel: each row's probed points (green stable, red unstable, size by runs, label the mean
    accuracy change in pp) and its edge as a black bar between the last stable and the first unstable point."""
    edges = edges if edges is not None else fr_.edges(runs, fr)
    fig = Figure(figsize=(6.5 * len(fr.axes), 0.42 * len(fr.rows) + 1.6))
    axes = fig.subplots(1, len(fr.axes), sharey=True, squeeze=False)[0]
    labels = [row_label(runs, row) for row in fr.rows]
    for ax, axis in zip(axes, fr.axes):
        for y, row in enumerate(fr.rows):
            edge = edges[(row, axis.name)]
            for _, p in edge.points.iterrows():
                color = "tab:green" if p["stable"] else "tab:red"
                ax.scatter(p["index"], y, s=12 + 6 * p["n"], color=color, alpha=0.8, edgecolors="none")
                ax.annotate(f"{100 * p['change']:+.0f}", (p["index"], y), fontsize=6, ha="center", va="center")
            if len(edge.points):
                ax.plot([edge.index + 0.5] * 2, [y - 0.4, y + 0.4], color="black", lw=2 if edge.located else 1)
        ax.set_xticks(range(len(axis.grid)), [f"{g:g}" for g in axis.grid], rotation=45, fontsize=7)
        ax.set_xlim(-0.8, len(axis.grid) - 0.2)
        fixed = ", ".join(f"{k} = {v:g}" for k, v in axis.fixed.items())
        ax.set_title(f"{axis.name} ({fixed}): stable (green) / unstable (red), edge |", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(fr.rows)), labels, fontsize=7)
    axes[0].invert_yaxis()
    fig.tight_layout()
    return fig


def _interp_edge(r: pd.Series) -> str:
    """`3.5 [2.9, 4.1]`; past or below the probed values `> 8` or `< 2`; descriptive below 5 starts."""
    if pd.isna(r["edge"]):
        return "—"

    def one(x: float) -> str:
        return f"> {r['last']:g}" if x == np.inf else f"< {r['first']:g}" if x == 0 else f"{x:.3g}"

    if r["descriptive"]:
        return f"{one(r['edge'])} ({r['starts']} start{'' if r['starts'] == 1 else 's'})"
    return f"{one(r['edge'])} [{one(r['lo'])}, {one(r['hi'])}]"


def format_interpolated(interp: pd.DataFrame, runs: pd.DataFrame, fr: fr_.Frontier) -> str:
    """The interpolated edges (`frontier.interpolated_edges`) as markdown: a row per arm, a column per axis."""
    head = ["arm", *(f"{a.name} edge, interpolated [95%]" for a in fr.axes)]
    lines = ["| " + " | ".join(head) + " |", "|:---|" + "---:|" * len(fr.axes)]
    by = interp.set_index(["family", "arm_file", "axis"])
    for row in fr.rows:
        cells = [row_label(runs, row), *(_interp_edge(by.loc[(row[0], row[1], a.name)]) for a in fr.axes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def frontier_section(runs: pd.DataFrame, fr: fr_.Frontier) -> tuple[pd.DataFrame, str, Figure, pd.DataFrame]:
    """The frontier table, the markdown section that opens the report's summary, its figure and the interpolated
    edges."""
    edges = fr_.edges(runs, fr)
    table = frontier_table(runs, fr, edges)
    interp = fr_.interpolated_edges(runs, fr)
    located = sum(e.located for e in edges.values())
    text = "\n".join(
        [
            "## The stability frontier",
            "",
            f"{len(runs)} finished runs read (this folder's and, for the same configs, those of "
            f"{', '.join(s for s in fr_.SOURCES if s != 'frontier')}); {located} of {len(edges)} edges located.",
            "",
            (fr_.__doc__ or "").split("\n\n", 1)[1].replace("\n", " ").strip(),
            "",
            format_frontier_markdown(table, fr),
            "![frontier](frontier.png)",
            "",
            "### The edges interpolated",
            "",
            " ".join((fr_.interpolated_edges.__doc__ or "").split(". Columns")[0].split())
            + ". The grid table above reads the last stable point; this one where the fitted change crosses -5 pp "
            "(`edges_interpolated.csv`).",
            "",
            format_interpolated(interp, runs, fr),
        ]
    )
    return table, text, plot_frontier(runs, fr, edges), interp


def write_frontier_report(runs_dir: Path, out: Path, presets: Path) -> list[Path]:
    """results/frontier: the table of every arm's edges, a csv and a figure, from its runs and those of the same
    configs in the folders beside it (`frontier.SOURCES`), as the preset in `presets` declares them."""
    runs = fr_.load_runs(dict.fromkeys(p.resolve() for p in (out.parent, runs_dir.parent.parent)))
    table, text, fig, interp = frontier_section(runs, fr_.load_frontier(presets))
    write_atomic(out / "summary.md", f"# frontier\n\n{text}".encode())
    written = [out / "summary.md", write_csv(out / "frontier.csv", table), write_png(out / "frontier.png", fig)]
    return [*written, write_csv(out / "edges_interpolated.csv", interp)]


def claims_section(root: Path, presets: Path) -> list[str]:
    """The frontier table (its report's frontier.csv) for CLAIMS.md; none without it."""
    csv = Path(root) / "frontier" / "frontier.csv"
    if not csv.is_file():
        return []
    return [
        "## Stability frontier",
        "",
        "Each method's edge along lr (N = 8) and staleness N (lr 3e-4), found by bisection; the table claims 10 "
        "and 11 read their staleness edges from. Rule, intervals and figure: `frontier/summary.md`.",
        "",
        format_frontier_markdown(pd.read_csv(csv, keep_default_na=False, na_values=[""]), fr_.load_frontier(presets)),
    ]


report = with_provenance(
    write_frontier_report
)  # the report its declaration names: summary.md says where its runs came from
