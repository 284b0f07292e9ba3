"""The causal study's report (`results/causal/`): per level each arm's accuracy change with its start-clustered
interval, the realised per-update KL and the mediators; the declared contrasts (claims 14, 15, 7) and the
exploratory ones; the 1/sqrt(p) test on the runs' expert-activity instrument; a figure of change against realised KL."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moe_rl.analysis import expert_activity
from moe_rl.analysis.claims.rules import fmt_num, fmt_pp
from moe_rl.analysis.configs import format_starts, start_covariates
from moe_rl.analysis.folder_report import write_csv, write_png
from moe_rl.run.atomic import write_atomic
from moe_rl.studies import causal
from moe_rl.studies import causal_claims as cc

# (arm, against): the declared contrasts first, then the exploratory ones (across models: paired on pool member,
# i.e. independent starts side by side)
PAIRS = (
    ("anchored", "moe"),
    ("load_aware", "moe"),
    ("dense_total_mup", "moe"),
    ("anchored_load_aware", "moe"),
    ("dense", "moe"),
    ("r2", "moe"),
    ("expert_lr_quarter", "moe"),
    ("expert_lr_quarter", "lr_matched"),
    ("nonexpert_lr_quarter", "moe"),
    ("soft_narrow", "moe"),
    ("dense_mlp_lr_quarter", "dense"),
    ("dense_total", "dense_total_mup"),
    ("dense_w256", "dense_w256_mup"),
    ("dense_total", "dense"),
    ("dense_w256", "dense"),
    ("dense_total_mup", "dense"),
)


def format_arms(table: pd.DataFrame, spec: causal.Spec) -> str:
    lines = []
    for level in spec.levels.values():
        own = table[table["level"] == level.name]
        if own.empty:
            continue
        lrs = ", ".join(f"{ref} {lr:g}" for ref, lr in level.lr.items())
        lines += [
            f"### {level.name}: grpo+none's early per-update KL {level.kl:g} (lr {lrs})",
            "",
            "| arm | lr | runs (starts) | accuracy change, pp [95%] | collapsed | early KL | flips old-new | "
            "router drift | low/high expert step | load entropy |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for _, r in own.iterrows():
            ci = f" [{fmt_pp(r['change_lo'])}, {fmt_pp(r['change_hi'])}]" if not r["descriptive"] else " (descriptive)"
            lines.append(
                f"| {r['rung']} | {r['lr']:.3g} | {r['runs']} ({r['starts']}) | {fmt_pp(r['change'])}{ci} | "
                f"{100 * r['collapsed']:.0f}% | {fmt_num(r['kl_early'], '.4f')} | {fmt_num(r['flip'])} | "
                f"{fmt_num(r['router_drift'])} | {fmt_num(r['low_over_high'])} | {fmt_num(r['load_entropy'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def format_contrasts(table: pd.DataFrame, declared: dict[tuple[str, str, str], int]) -> str:
    if table.empty:
        return "No contrast has runs on both sides yet.\n"
    lines = [
        "| contrast | level | claim | pairs (starts) | difference, pp [95%] | p (two-sided) | KL ratio "
        "| p, starts permuted (across models) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, r in table.iterrows():
        ci = f" [{fmt_pp(r['lo'])}, {fmt_pp(r['hi'])}]" if not r["descriptive"] else " (descriptive)"
        claim = declared.get((r["a"], r["b"], r["level"]))
        lines.append(
            f"| {r['a']} - {r['b']} | {r['level']} | {claim if claim else 'exploratory'} | {r['n_seeds']} "
            f"({r['n_starts']}) | {fmt_pp(r['mean_diff'])}{ci} | {fmt_num(r['p_value'])} | {fmt_num(r['kl_ratio'], '.2f')} "
            f"| {fmt_num(r.get('between_p', float('nan')))} |"
        )
    return "\n".join(lines) + "\n"


def plot_arms(table: pd.DataFrame) -> Figure:
    """Each arm's mean accuracy change (pp, with its interval) against its realised early per-update KL, a marker
    per level."""
    fig = Figure(figsize=(7.5, 4.6))
    ax = fig.subplots()
    markers = dict(zip(sorted(table["level"].unique()), "os^v", strict=False))
    colors: dict[str, str] = {}
    for _, r in table.iterrows():
        label = None if r["rung"] in colors else r["rung"]
        color = colors.setdefault(r["rung"], f"C{len(colors) % 10}")
        y, lo, hi = 100 * r["change"], 100 * r["change_lo"], 100 * r["change_hi"]
        err = None if np.isnan(lo) else [[y - lo], [hi - y]]
        ax.errorbar([r["kl_early"]], [y], yerr=err, fmt=markers[r["level"]], color=color, capsize=2, label=label)
    ax.axhline(-5, color="grey", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("realised early per-update KL (kl/update_k3, steps <= 20)", fontsize=8)
    ax.set_ylabel("accuracy change (pp)", fontsize=8)
    ax.set_title("markers: " + ", ".join(f"{m} {lv}" for lv, m in markers.items()), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def write_causal_report(runs_dir: Path, out: Path, presets: Path) -> list[Path]:
    """results/causal: arms.csv, contrasts.csv, runs.csv, starts.csv, causal.png and summary.md."""
    from moe_rl import analysis

    spec = causal.load_spec(presets)
    df = analysis.load_results(runs_dir)  # every key: the expert-activity instrument is one key per expert
    runs = causal.per_run(df, spec)
    runs = runs[runs["level"].notna()].reset_index(drop=True)
    info = df.drop_duplicates("run").set_index("run")
    runs["run_dir"] = runs["run"].map(info["run_dir"])
    runs["cold_seed"] = runs["run"].map(info["cold_seed"]) if "cold_seed" in info else np.nan
    arms = causal.arm_table(runs)
    arms["lr"] = [spec.lr(r, lv) for r, lv in zip(arms["rung"], arms["level"], strict=True)]
    pairs = cc.contrasts(runs, PAIRS)
    declared = {v: k for k, v in spec.claims.items()}
    decided = cc.decide(spec, runs)  # the declared claims on these runs (the claims page reads <root>/causal/runs)
    text = ["# causal", "", (causal.__doc__ or "").split("\n\n", 1)[1].replace("\n", " ").strip(), ""]
    text += ["## Arms, by level", "", format_arms(arms, spec), "## Contrasts", "", format_contrasts(pairs, declared)]
    if decided:
        text += [
            "",
            "Declared claims: "
            + "; ".join(f"{i}: **{r['verdict']}** ({r['reason']})" for i, r in sorted(decided.items())),
            "",
        ]
    text += ["![causal](causal.png)", ""]
    starts = runs.set_index("run")["start"]
    scaled = runs.set_index("run")["rung"].astype(str).str.contains("load_aware")  # the step scaled by load
    text += [expert_activity.section(df[df["run"].isin(starts.index)], starts, scaled)]
    text += ["## The starts (the unit of replication)", "", format_starts(start_covariates(runs))]
    write_atomic(out / "summary.md", "\n".join(text).encode())
    written = [out / "summary.md", write_csv(out / "arms.csv", arms), write_csv(out / "contrasts.csv", pairs)]
    written += [write_png(out / "causal.png", plot_arms(arms))]
    written += [
        write_csv(out / "runs.csv", runs.drop(columns=["run_dir"])),
        write_csv(out / "starts.csv", start_covariates(runs)),
    ]
    return written


README_BLOCK = ("<!-- causal table: python -m moe_rl.report --readme -->", "<!-- end of causal table -->")
ROWS = (  # README's rows: (arm, against, what the arm changes), in the order of the claims, then the controls
    ("anchored", "moe", "anchored routing: no route drift from the start (claim 14)"),
    ("load_aware", "moe", "load-aware expert step (claim 15)"),
    ("anchored_load_aware", "moe", "both"),
    ("r2", "moe", "R2 (old-policy routes replayed)"),
    ("expert_lr_quarter", "moe", "expert lr x 0.25"),
    ("expert_lr_quarter", "lr_matched", "expert lr x 0.25 vs a global lr cut to its early KL"),
    ("nonexpert_lr_quarter", "moe", "non-expert lr x 0.25"),
    ("soft_narrow", "moe", "soft routing at the dense control's active width"),
    ("dense_total_mup", "moe", "dense of the MoE's total width, muP lr (claim 7)"),
    ("dense", "moe", "dense of the MoE's active width"),
    ("dense_mlp_lr_quarter", "dense", "dense MLP lr x 0.25"),
    ("dense_total", "dense_total_mup", "dense of total width: fixed vs muP lr"),
    ("dense_w256", "dense_w256_mup", "dense of width 256: fixed vs muP lr"),
)


def read_contrasts(root: Path) -> pd.DataFrame | None:
    csv = Path(root) / cc.FOLDER / "contrasts.csv"
    if not csv.is_file():
        return None
    table = pd.read_csv(csv, keep_default_na=False, na_values=[""])
    table["descriptive"] = table["descriptive"].fillna("")
    return table


def readme_table(root: Path) -> str | None:
    """README.md's causal table: per row of `ROWS` with runs on both sides, the paired difference in accuracy change
    at each level with its interval over starts, and the realised early-KL ratio; None without shipped contrasts."""
    table = read_contrasts(root)
    if table is None:
        return None
    levels = [lv for lv in ("past", "stable") if lv in set(table["level"])]
    head = " | ".join(f"{lv}: Δ pp [95%] (KL ratio)" for lv in levels)
    lines = [f"| arm - against | what changes | {head} |", "|:---|:---|" + "---:|" * len(levels)]
    for a, b, what in ROWS:
        cells = []
        for lv in levels:
            r = table[(table["a"] == a) & (table["b"] == b) & (table["level"] == lv)]
            if r.empty:
                cells.append("not run")
                continue
            x = r.iloc[0]
            ci = f" [{fmt_pp(x['lo'])}, {fmt_pp(x['hi'])}]" if not x["descriptive"] else f" ({x['n_starts']} starts)"
            bold = not x["descriptive"] and (x["lo"] > 0 or x["hi"] < 0)
            d = f"**{fmt_pp(x['mean_diff'])}**" if bold else fmt_pp(x["mean_diff"])
            cells.append(f"{d}{ci} ({fmt_num(x['kl_ratio'], '.2f')})")
        if any(c != "not run" for c in cells):
            lines.append(f"| {a} - {b} | {what} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"
