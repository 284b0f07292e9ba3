"""The divergence frontier's section of its declared report (`results/divergence/`): the crossings, the lr^2 N test.

Per row: every run's accuracy change against its early per-update KL, the isotonic fit and the KL where it crosses
-5 pp, with an interval over cold starts (then seeds); headroom as the ratio of a row's crossing to grpo+none's, on
the same draws. The lr^2 N test follows. A row with fewer than 5 starts is descriptive (no interval).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moe_rl.analysis.dose import isotonic_fit
from moe_rl.analysis.folder_report import write_csv, write_png
from moe_rl.studies import divergence as dv
from moe_rl.studies.design import Study
from moe_rl.studies.study_rule import StudyResult


def _kl(v: float) -> str:
    if not np.isfinite(v):
        return "> max" if v == math.inf else "—"
    return "< min" if v == 0 else f"{v:.2g}"


def _interval(lo: float, hi: float, fmt=_kl) -> str:
    if not (np.isfinite(lo) or lo == math.inf) or (isinstance(hi, float) and math.isnan(hi)):
        return "—"
    return f"[{fmt(lo)}, {fmt(hi)}]"


def _ratio(v: float) -> str:
    """A ratio of crossings; one censored crossing makes it unbounded on one side (> any, < any)."""
    if math.isnan(v):
        return "—"
    return "> any" if v == math.inf else "< any" if v == 0 else f"{v:.2f}"


def _undefined(share: float) -> str:
    """The share of draws where a ratio of crossings is undefined (both censored alike), where there are any."""
    return f" ({100 * share:.0f}% of draws undefined)" if pd.notna(share) and share > 0 else ""


def format_table(table: pd.DataFrame, spec: dv.Spec) -> str:
    """The crossings table in markdown: one line per declared row."""
    lines = [
        "| row | runs (starts x seeds per start) | crossing KL [95%] | headroom [95%] | early KL by lr | change by lr (pp) | "
        "collapsed |",
        "|---|---|---|---|---|---|---|",
    ]
    for _, r in table.iterrows():
        lrs = sorted(float(c.split("@")[1]) for c in table.columns if c.startswith("kl@") and pd.notna(r[c]))
        kls = ", ".join(f"{r[f'kl@{lr:g}']:.2g}" for lr in lrs) or "—"
        changes = ", ".join(f"{100 * r[f'change@{lr:g}']:+.1f}" for lr in lrs) or "—"
        lr_head = "/".join(f"{lr:g}" for lr in lrs)
        cross = _kl(r["crossing"]) + (
            f" {_interval(r['crossing_lo'], r['crossing_hi'])}" if not r["descriptive"] else ""
        )
        head = "—" if r["row"] == dv.REFERENCE[1] else _ratio(r["headroom"])
        if r["row"] != dv.REFERENCE[1] and pd.notna(r["headroom_lo"]):
            head += f" [{_ratio(r['headroom_lo'])}, {_ratio(r['headroom_hi'])}]" + _undefined(r["headroom_undefined"])
        if not r["runs"]:
            lines.append(f"| {r['row']} | not run yet | | | | | |")
            continue
        note = f" ({r['descriptive']})" if r["descriptive"] else ""
        if r.get("nonfinite_kl", 0):
            note += f" ({int(r['nonfinite_kl'])} without a finite KL, left out)"
        coll = f"{100 * r['collapsed']:.0f}%" if pd.notna(r["collapsed"]) else "—"
        lines.append(
            f"| {r['row']} | {r['runs']} ({r['starts']} x {r['seeds']}){note} | {cross} | {head} | "
            f"{kls} (lr {lr_head}) | {changes} | {coll} |"
        )
    return "\n".join(lines) + "\n"


def plot_rows(runs: pd.DataFrame, table: pd.DataFrame, spec: dv.Spec) -> Figure:
    """A panel per row: each run's accuracy change (pp) against its early per-update KL (log scale), coloured by lr
    (N = spec.N), the isotonic fit, the -5 pp line and the crossing with its interval."""
    names = list(table["row"])
    cols = 3
    nrows = max(1, math.ceil(len(names) / cols))
    fig = Figure(figsize=(4.2 * cols, 3.1 * nrows))
    axes = fig.subplots(nrows, cols, sharex=True, sharey=True, squeeze=False).ravel()
    at_n = runs[runs["N"].astype(float) == spec.N]
    lrs = sorted(at_n["lr"].unique())
    colors = dict(zip(lrs, ["tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:brown"], strict=False))
    for ax, name in zip(axes, names, strict=False):
        own = at_n[(at_n["row"] == name) & (at_n["kl_early"] > 0)]
        for lr, g in own.groupby("lr"):
            ax.scatter(g["kl_early"], 100 * g["change"], s=14, color=colors.get(lr, "grey"), label=f"lr {lr:g}")
        if len(own):
            x, fit = isotonic_fit(np.log(own["kl_early"].to_numpy(float)), own["change"].to_numpy(float))
            ax.plot(np.exp(x), 100 * fit, color="black", lw=1.2)
        ax.axhline(100 * spec.threshold, color="grey", ls="--", lw=0.8)
        rec = table[table["row"] == name].iloc[0]
        if np.isfinite(rec["crossing"]) and rec["crossing"] > 0:
            ax.axvline(rec["crossing"], color="black", ls=":", lw=1)
        lo, hi = rec["crossing_lo"], rec["crossing_hi"]
        if np.isfinite(lo) and lo > 0 and np.isfinite(hi):
            ax.axvspan(lo, hi, color="grey", alpha=0.15)
        ax.set_xscale("log")
        ax.set_title(f"{name} ({rec['starts']} starts)", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    for ax in axes[::cols]:
        ax.set_ylabel("accuracy change (pp)", fontsize=8)
    for ax in axes[-cols:]:
        ax.set_xlabel("early per-update KL (k3, steps <= 20)", fontsize=8)
    if len(names):
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def format_law(law: pd.DataFrame, pairs: pd.DataFrame) -> str:
    if law.empty:
        return "No runs at the law's second N yet.\n"
    lines = ["| outcome | b (log lr) [95%] | c (log N) [95%] | b / c [95%] | runs |", "|---|---|---|---|---|"]
    for _, r in law.iterrows():
        b, c = (f"{r[k]:+.3g} [{r[f'{k}_lo']:+.3g}, {r[f'{k}_hi']:+.3g}]" for k in ("b", "c"))
        lines.append(
            f"| {r['outcome']} | {b} | {c} | {r['b_over_c']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}] | {r['runs']} |"
        )
    lines += [
        "",
        "| equal | a | b | pairs (starts) | change a - b (pp) [95%] | early KL a / b [95%] |",
        "|---|---|---|---|---|---|",
    ]
    for _, r in pairs.iterrows():
        ci = (
            f" [{100 * r['change_lo']:+.1f}, {100 * r['change_hi']:+.1f}]"
            if not r["descriptive"]
            else f" ({r['descriptive']})"
        )
        kci = f" [{r['kl_ratio_lo']:.2f}, {r['kl_ratio_hi']:.2f}]" if not r["descriptive"] else ""
        lines.append(
            f"| {r['equal']} | {r['a']} | {r['b']} | {r['pairs']} ({r['starts']}) | {100 * r['change_diff']:+.1f}{ci} "
            f"| {r['kl_ratio']:.2f}{kci} |"
        )
    return "\n".join(lines) + "\n"


def frontier_section(study: Study, result: StudyResult, out: Path) -> tuple[list[str], list[Path]]:
    """The divergence study's own computation (named in its declaration's `sections`): divergence.csv (the
    crossings), law.csv and pairs.csv (the lr^2 N test) and divergence.png in `out`, and their markdown."""
    spec = dv.spec_of(study)
    every = dv.runs_of(study, result.runs)
    runs = dv.declared(every, spec)  # the declared points (runs of an amended grid stay in runs.csv)
    table = dv.frontier_table(runs, spec)
    law, pairs = dv.law_table(runs, spec), dv.matched_pairs(runs, spec)
    text = [
        "## The divergence frontier",
        "",
        f"{len(runs)} finished runs at the declared points ({len(every) - len(runs)} more in runs.csv), N = {spec.N}, lrs {', '.join(f'{v:g}' for v in spec.lrs)} "
        f"({', '.join(f'{k}: ' + ', '.join(f'{v:g}' for v in vs) for k, vs in spec.lrs_by_family.items())}); "
        f"{runs['start'].nunique()} cold starts.",
        "",
        (dv.__doc__ or "").split("\n\n", 2)[2].replace("\n", " ").strip(),
        "",
        format_table(table, spec),
        '"> max" and "< min": the fit stays above -5 pp up to the largest KL seen, or is below it from the smallest '
        '(censored); a headroom with a censored crossing is unbounded on that side ("> any", "< any").',
        "",
        "![divergence](divergence.png)",
        "",
        f"## Does lr^2 x N set the outcome? ({', '.join(spec.law_rows)} at N = {spec.law_N} and {spec.N})",
        "",
        "b / c of `y = row + b log lr + c log N`: 2 if lr^2 x N is what matters, 1 if lr x N. Pairs of points at "
        "equal lr^2 N should agree; at equal lr x N they should not if the law holds.",
        "",
        format_law(law, pairs),
    ]
    fig = plot_rows(runs, table, spec)
    written = [write_csv(out / "divergence.csv", table), write_png(out / "divergence.png", fig)]
    written += [write_csv(out / "law.csv", law), write_csv(out / "pairs.csv", pairs)]
    return text, written


LABELS = {  # the methods as the papers name them (README, CLAIMS.md)
    "grpo_none": "GRPO",
    "grpo_r2": "GRPO + R2",
    "gspo_none": "GSPO",
    "is_none": "plain IS (no clip)",
    "cispo_none": "CISPO",
    "sapo_none": "SAPO",
    "dppo_tv_none": "DPPO-TV",
    "vespo_none": "VESPO",
    "qwen3_dense:grpo_none": "GRPO, dense control",
}


def compact_table(table: pd.DataFrame) -> str:
    """The crossings in three columns (README, CLAIMS.md): row, crossing KL [95%], headroom over grpo+none [95%]."""
    lines = [
        "| method | runs (starts) | early per-update KL at -5 pp [95%] | x GRPO's [95%] |",
        "|:---|---:|---:|---:|",
    ]
    for _, r in table.iterrows():
        if not r["runs"]:
            lines.append(f"| {LABELS.get(r['row'], r['row'])} | not run yet | | |")
            continue
        cross = _kl(r["crossing"]) + (
            f" {_interval(r['crossing_lo'], r['crossing_hi'])}" if not r["descriptive"] else ""
        )
        head = "ref" if r["row"] == dv.REFERENCE[1] else _ratio(r["headroom"])
        if r["row"] != dv.REFERENCE[1] and pd.notna(r["headroom_lo"]):
            head += f" [{_ratio(r['headroom_lo'])}, {_ratio(r['headroom_hi'])}]" + _undefined(r["headroom_undefined"])
        lines.append(f"| {LABELS.get(r['row'], r['row'])} | {r['runs']} ({r['starts']}) | {cross} | {head} |")
    return "\n".join(lines) + "\n"


def read_table(root: Path) -> pd.DataFrame | None:
    """The shipped crossings (results/divergence/divergence.csv); None without it."""
    csv = Path(root) / "divergence" / "divergence.csv"
    if not csv.is_file():
        return None
    table = pd.read_csv(csv, keep_default_na=False, na_values=[""])
    table["descriptive"] = table["descriptive"].fillna("")
    return table


def claims_section(root: Path, presets: Path) -> list[str]:
    """The divergence frontier (its report's divergence.csv) for CLAIMS.md; none without it."""
    table = read_table(root)
    if table is None:
        return []
    return [
        "## Divergence frontier",
        "",
        "Each method's accuracy change against its realised early per-update KL, from a pool of cold starts: the KL "
        "at which an isotonic fit crosses -5 pp, with an interval over starts, and its ratio to grpo+none's (paired "
        "on starts). Rule, runs and figure: `divergence/summary.md`.",
        "",
        compact_table(table),
    ]


README_BLOCK = ("<!-- divergence table: python -m moe_rl.report --readme -->", "<!-- end of divergence table -->")


def readme_table(root: Path) -> str | None:
    """README.md's divergence table (between `README_BLOCK`'s markers): the shipped crossings; None without them."""
    table = read_table(root)
    return None if table is None else compact_table(table)
