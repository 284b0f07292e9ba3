"""The length study's report (`results/length/`): per level, length and arm the accuracy change with its
start-clustered interval, collapse, the realised KL, the route flips, the ratio variances and their split, the clip
fractions and the step's wall time; the paired contrasts per length; claims 2, 3, 12 and 13 as decided; one figure per
metric against length (an arm per line, intervals over starts: pool indices, twins warmed on two machines one);
replay's cost against length."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from moe_rl.analysis.claims.rules import fmt_num, fmt_pp
from moe_rl.analysis.clustered import descriptive_reason, hierarchical_bootstrap
from moe_rl.analysis.configs import format_starts, start_covariates
from moe_rl.analysis.folder_report import write_csv, write_png
from moe_rl.run.atomic import write_atomic
from moe_rl.studies import length as ln
from moe_rl.studies import length_claims as lc

PAIRS = (
    (lc.R2, lc.GRPO),
    (lc.GSPO, lc.GRPO),
    (lc.R2, lc.GSPO),
    ("gspo_r2", lc.GSPO),
    ("gspo_token_none", lc.GSPO),
    ("vespo_none", lc.GRPO),
)
# the figures: (column, axis label, log scale)
FIGURES = (
    ("change", "accuracy change (pp)", False),
    ("token_var", "token ratio variance", True),
    ("seq_var", "sequence ratio variance", True),
    ("routing_share", "routing share of the token log-ratio variance", False),
    ("flip", "route flips, old pass vs updated policy", False),
    ("clip_high", "clip fraction, high", False),
    ("kl_early", "realised early per-update KL", True),
)


def format_arms(table: pd.DataFrame, spec: ln.Spec) -> str:
    lines = []
    for level in spec.levels.values():
        own = table[table["level"] == level.name]
        if own.empty:
            continue
        lrs = ", ".join(f"L {k}: {v:g}" for k, v in level.lr.items())
        lines += [
            f"### {level.name}: grpo+none's early per-update KL {level.kl:g} (lr {lrs})",
            "",
            "| L | arm | runs (starts) | accuracy change, pp [95%] | collapsed | early KL | response len | flips old-new "
            "| flips rollout-old | token ratio var | seq ratio var | routing share | clip low / high | step s |",
            "|---:|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for _, r in own.iterrows():
            ci = f" [{fmt_pp(r['change_lo'])}, {fmt_pp(r['change_hi'])}]" if _decided(r) else " (descriptive)"
            lines.append(
                f"| {r['L']} | {r['arm']} | {r['runs']} ({r['starts']}) | {fmt_pp(r['change'])}{ci} | "
                f"{100 * r['collapsed']:.0f}% | {fmt_num(r['kl_early'], '.4f')} | {fmt_num(r['response_len'], '.1f')} | "
                f"{fmt_num(r['flip'])} | {fmt_num(r['flip_rollout'])} | {fmt_num(r['token_var'])} | {fmt_num(r['seq_var'])} | "
                f"{fmt_num(r['routing_share'], '.2f')} | {fmt_num(r['clip_low'], '.3f')} / {fmt_num(r['clip_high'], '.3f')} | "
                f"{fmt_num(r['step_s'], '.2f')} |"
            )
        lines.append("")
    return "\n".join(lines)


def contrasts(spec: ln.Spec, runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for level in spec.levels:
        for length in spec.lengths:
            at = runs[(runs["level"] == level) & (runs["L"] == length)]
            have = set(at["arm_file"])
            rows += [ln.contrast(runs, a, b, level, length) for a, b in PAIRS if {a, b} <= have]
    return pd.DataFrame(rows)


def _decided(row: pd.Series) -> bool:
    """Whether a row carries an interval: its `descriptive` reason is absent ("", None, or NaN once a table mixes
    rows with and without one)."""
    return not (isinstance(row["descriptive"], str) and row["descriptive"])


def format_contrasts(table: pd.DataFrame) -> str:
    if table.empty:
        return "No contrast has runs on both sides yet.\n"
    lines = [
        "| contrast | level | L | pairs (starts) | difference, pp [95%] | p (two-sided) | KL ratio |",
        "|---|---|---:|---|---|---|---|",
    ]
    for _, r in table.iterrows():
        ci = f" [{fmt_pp(r['lo'])}, {fmt_pp(r['hi'])}]" if _decided(r) else " (descriptive)"
        lines.append(
            f"| {r['a']} - {r['b']} | {r['level']} | {r['L']} | {r['n_seeds']} ({r['n_starts']}) | "
            f"{fmt_pp(r['mean_diff'])}{ci} | {_p(r)} | {fmt_num(r['kl_ratio'], '.2f')} |"
        )
    return "\n".join(lines) + "\n" + P_FLOOR_NOTE


P_FLOOR_NOTE = (
    "\nThe sign flip's smallest two-sided p over C starts is 2 / 2^C: 0.0625 at 5, so a p marked * cannot fall below"
    " 0.05 whatever the data (the claims read the one-sided p, 1 / 2^C).\n"
)


def _p(r: pd.Series) -> str:
    """The two-sided p, marked * where its floor 2 / 2^C over C starts is above 0.05."""
    if pd.isna(r["p_value"]):
        return fmt_num(r["p_value"])
    return fmt_num(r["p_value"]) + ("*" if 2.0 / 2.0 ** int(r["n_starts"]) > 0.05 else "")


PROMPT_CHARS = len("Calculate  + .")  # basic_arithmetic's question is this plus the two L-digit addends
SEQUENCES = 16 * 8  # a step's rollout: rollout.prompts_per_step x group_size at their defaults, which the preset keeps


def route_kib(runs: pd.DataFrame) -> pd.Series:
    """The routes R2 caches per step, KiB: every position of the step's sequences (the question's 2 L + 14 characters
    and the completion) x MoE layers x top-k expert indices of one byte (uint8 up to 256 experts), masks aside."""
    positions = 2 * runs["L"] + PROMPT_CHARS + runs["response_len"]
    return SEQUENCES * positions * runs["num_moe_layers"] * runs["top_k"] / 1024


def replay_cost(runs: pd.DataFrame) -> pd.DataFrame:
    """Per level and length: the step's wall seconds of grpo+r2 over grpo+none, paired on (member, seed), median of the
    pairs, with each arm's median step time and the routes R2 caches per step (`route_kib`, median over its runs)."""
    rows = []
    for (level, length), g in runs.groupby(["level", "L"], sort=True):
        a = g[g["arm_file"] == lc.R2].set_index(["member", "seed"])["step_s"]
        b = g[g["arm_file"] == lc.GRPO].set_index(["member", "seed"])["step_s"]
        both = a.to_frame("r2").join(b.to_frame("none"), how="inner").dropna()
        if both.empty:
            continue
        rows.append(
            {
                "level": level,
                "L": int(length),
                "pairs": len(both),
                "none_step_s": float(both["none"].median()),
                "r2_step_s": float(both["r2"].median()),
                "r2_over_none": float((both["r2"] / both["none"]).median()),
                "route_kib_per_step": float(route_kib(g[g["arm_file"] == lc.R2]).median()),
            }
        )
    return pd.DataFrame(rows)


def draw_metric(ax: Axes, runs: pd.DataFrame, level: str, column: str, label: str, log: bool) -> None:
    """One metric against L at one level on `ax`: an arm per line (side by side), each point the mean of pool-member
    means with its hierarchical-bootstrap interval (starts, then runs), drawn from 5 starts up."""
    at = runs[runs["level"] == level]
    scale = 100.0 if column == "change" else 1.0
    for i, (arm, g) in enumerate(at.groupby("arm_file", sort=True)):
        xs, ys, lo, hi = [], [], [], []
        for length, h in g.groupby("L", sort=True):
            est, a, b = hierarchical_bootstrap(h[column], h["unit"])
            if not math.isfinite(est):
                continue
            if descriptive_reason(h["unit"].nunique()):  # below 5 units: the mean alone, no interval
                a = b = math.nan
            xs.append(float(length) * (1 + 0.04 * (i - 1)))  # arms side by side
            ys.append(scale * est)
            lo.append(scale * (est - a) if math.isfinite(a) else 0.0)
            hi.append(scale * (b - est) if math.isfinite(b) else 0.0)
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, color=f"C{i % 10}", label=arm)
    if column == "change":
        ax.axhline(-5, color="grey", ls="--", lw=0.8)
    ticks = sorted(int(x) for x in at["L"].dropna().unique())
    ax.set_xscale("log")
    if log:
        ax.set_yscale("log")
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("response length L (digits of each addend)", fontsize=8)
    ax.set_ylabel(label, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_metric(runs: pd.DataFrame, level: str, column: str, label: str, log: bool) -> Figure:
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    draw_metric(ax, runs, level, column, label, log)
    ax.set_title(f"{label} against length, level {level}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_headline(runs: pd.DataFrame, level: str) -> Figure:
    """README's figure: accuracy change and token ratio variance against L, side by side."""
    fig = Figure(figsize=(10, 4))
    for k, (column, label, log) in enumerate(FIGURES[:2]):
        draw_metric(fig.add_subplot(1, 2, k + 1), runs, level, column, label, log)
    fig.suptitle(f"length study, level {level}: intervals over starts (pool indices)", fontsize=9)
    fig.tight_layout()
    return fig


def format_claims(found: dict[str, Any]) -> str:
    lines = []
    for cid in ("12", "13"):
        r = found[cid]
        lines.append(f"- claim {cid}: **{r['verdict']}** ({r['reason']})")
    for cid in ("2", "3"):
        for length, (verdict, why, _) in found[cid].items():
            lines.append(f"- claim {cid} at L = {length}: **{verdict}** ({why})")
        lines.append(f"- claim {cid}'s trend over log L: {lc.trend_text(found[cid + '_trend'])}")
    return "\n".join(lines) + "\n"


def write_length_report(runs_dir: Path, out: Path, presets: Path) -> list[Path]:
    """results/length: arms.csv, contrasts.csv, replay_cost.csv, runs.csv, starts.csv, a figure per metric,
    length.png (the README's) and summary.md."""
    from moe_rl import analysis

    spec = ln.load_spec(presets)
    df = analysis.load_results(runs_dir, keys=ln.KEYS)
    every = ln.per_run(df, spec)
    info = df.drop_duplicates("run").set_index("run")
    every["run_dir"] = every["run"].map(info["run_dir"])
    every["cold_seed"] = every["run"].map(info["cold_seed"]) if "cold_seed" in info else np.nan
    every = every[every["level"].notna()].reset_index(drop=True)
    runs = ln.analysed(every)
    arms = ln.arm_table(runs)
    pairs = contrasts(spec, runs)
    cost = replay_cost(runs)
    found = lc.decide(spec, runs)
    text = ["# length", "", (ln.__doc__ or "").split("\n\n", 1)[1].replace("\n", " ").strip(), ""]
    text += ["## Arms, by level and length", "", format_arms(arms, spec), "## Contrasts", "", format_contrasts(pairs)]
    text += ["## Claims (declared in experiments/conf/preset/length.yaml)", "", format_claims(found)]
    if not cost.empty:
        text += ["## Replay's cost against length (step wall time, grpo+r2 / grpo+none, median of pairs)", ""]
        text += [cost.to_markdown(index=False, floatfmt=".3g"), ""]
    written = []
    for level in sorted(runs["level"].unique()):
        text += [f"![length, {level}](length_{level}.png)", ""]
        written.append(write_png(out / f"length_{level}.png", plot_headline(runs, level)))
        for column, label, log in FIGURES:
            written.append(write_png(out / f"{column}_{level}.png", plot_metric(runs, level, column, label, log)))
    text += ["## The starts (the unit of replication), per length", ""]
    for size, own in every.groupby("L", sort=True):
        text += [f"### L = {int(size)}", "", format_starts(start_covariates(own))]
    out_of_band = every[~every["in_band"]]
    if len(out_of_band):
        text += [
            f"{len(out_of_band)} runs from {out_of_band.groupby(['L', 'member']).ngroups} pool members whose warm-up "
            "ended outside the band (greedy accuracy below 0.2 after cold_start.max_steps SFT steps) are reported in "
            "runs.csv and left out of every table, contrast and claim above: "
            + ", ".join(f"L = {int(k[0])} member {k[1]}" for k in out_of_band.groupby(["L", "member"]).groups),
            "",
        ]
    write_atomic(out / "summary.md", "\n".join(text).encode())
    written += [out / "summary.md", write_csv(out / "arms.csv", arms), write_csv(out / "contrasts.csv", pairs)]
    written += [write_csv(out / "replay_cost.csv", cost), write_csv(out / "runs.csv", every.drop(columns=["run_dir"]))]
    written.append(write_csv(out / "starts.csv", start_covariates(every)))
    return written


README_BLOCK = ("<!-- length table: python -m moe_rl.report --readme -->", "<!-- end of length table -->")


def readme_table(root: Path) -> str | None:
    """README.md's length table, from results/length/arms.csv and contrasts.csv: per level and length, grpo+none's
    accuracy change and collapse share, R2 - GRPO and GSPO - GRPO (pp, paired, with intervals from 5 starts up), and
    the token ratio variance and routing share of grpo+none; None without shipped tables."""
    folder = Path(root) / lc.FOLDER
    if not (folder / "arms.csv").is_file() or not (folder / "contrasts.csv").is_file():
        return None
    arms = pd.read_csv(folder / "arms.csv", keep_default_na=False, na_values=[""])
    pairs = pd.read_csv(folder / "contrasts.csv", keep_default_na=False, na_values=[""])
    head = "| level | L | starts | grpo+none Δ pp (collapsed) | R2 - GRPO, pp | GSPO - GRPO, pp | token ratio var | routing share |"
    lines = [head, "|:---|---:|---:|---:|---:|---:|---:|---:|"]
    for _, g in arms[arms["arm"] == lc.GRPO].iterrows():
        cells = []
        for a in (lc.R2, lc.GSPO):
            r = pairs[
                (pairs["a"] == a) & (pairs["b"] == lc.GRPO) & (pairs["level"] == g["level"]) & (pairs["L"] == g["L"])
            ]
            if r.empty:
                cells.append("not run")
                continue
            x = r.iloc[0]
            ci = f" [{fmt_pp(x['lo'])}, {fmt_pp(x['hi'])}]" if _decided(x) else ""
            cells.append(f"{fmt_pp(x['mean_diff'])}{ci}")
        lines.append(
            f"| {g['level']} | {g['L']} | {g['starts']} | {fmt_pp(g['change'])} ({100 * g['collapsed']:.0f}%) | "
            f"{' | '.join(cells)} | {fmt_num(g['token_var'])} | {fmt_num(g['routing_share'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"
