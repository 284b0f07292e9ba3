"""The mechanism ladder: which difference between the MoE model and its dense control closes the gap.

At the edge cell the MoE model (`moe`) loses accuracy where its dense control (`dense`) holds. Each rung
of the ladder (experiments/conf/rung/) changes one thing about `moe` (or about `dense`). Paired by
(cold-start seed, seed), with accuracy change = late accuracy (mean of the last 3 evaluations) minus the
step-0 accuracy, each measured from the run's own start:

    share(rung) = mean(change_rung - change_moe) / mean(change_dense - change_moe)

0 is the MoE model's outcome, 1 the dense model's. The cold start, not the seed, is the unit of replication
(`moe_rl.analysis.clustered`): each rung trains its own cold start per cold-start seed, so a rung's accuracy change
is the mean of its starts' means, and a paired difference (to `moe`, or the share) is clustered by cold-start seed
(rungs of other models pair on it, as the causal study's pool members do); intervals are hierarchical bootstraps
(starts, then seeds within), p a sign flip per start, Holm over the rungs. Below 5 independent starts a number is
descriptive: no interval, no p, and the rung is not read. A ratio whose denominator is itself noisy has wide,
skewed intervals, so the table also gives each rung's paired difference to `moe` in accuracy change. A rung
"closes the gap" when its share's interval lies above 0.5, "opens it" when below 0; where the dense - moe
difference's own interval spans 0 there is no gap to share, and no rung is read. The table also gives each rung's
start: step-0 held-out accuracy, and the first rollout's mean reward and entropy (what GRPO sees first), so a rung
that starts elsewhere shows it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moe_rl.analysis import expert_activity
from moe_rl.analysis.accuracy import late_accuracy, start_accuracy
from moe_rl.analysis.clustered import (
    bootstrap,
    descriptive_reason,
    hierarchical_bootstrap,
    paired_by_start,
    start_draws,
)
from moe_rl.analysis.configs import run_starts
from moe_rl.analysis.folder_report import after_title, with_provenance, write_csv, write_png, write_report
from moe_rl.analysis.load import INCOMPLETE_STATUSES, load_results
from moe_rl.analysis.stats import holm
from moe_rl.metrics.names import (
    OPTIM_EXPERT_STEP_LOW_OVER_HIGH,
    OPTIM_EXPERT_STEP_RMS,
    OPTIM_ROUTER_DRIFT,
    POLICY_ENTROPY,
    REWARD_MEAN,
    ROUTE_LOAD_DEAD_FRAC,
    ROUTE_LOAD_ENTROPY,
    ROUTE_LOAD_MAX_SHARE,
    ROUTE_ROUTER_Z,
)

REFERENCE, TARGET = "moe", "dense"
COLD = "cold_seed"
PAIR = [COLD, "seed"]
# What each rung does to the routers and experts (moe_rl.routing.expert_load), as the report shows it: the mean over a
# run's logged steps, but the router's drift from the cold start, read at the run's last logged step.
INSTRUMENTS = {
    ROUTE_LOAD_ENTROPY: "load entropy",
    ROUTE_LOAD_MAX_SHARE: "max expert share",
    ROUTE_LOAD_DEAD_FRAC: "dead experts",
    ROUTE_ROUTER_Z: "router z",
    OPTIM_ROUTER_DRIFT: "router drift (end)",
    OPTIM_EXPERT_STEP_RMS: "expert step RMS",
    OPTIM_EXPERT_STEP_LOW_OVER_HIGH: "step, few / many tokens",
}
LAST = (OPTIM_ROUTER_DRIFT,)


def ladder_runs(df: pd.DataFrame, starts: pd.Series | None = None) -> pd.DataFrame:
    """One row per run of a `load_results` frame with a `rung` column: its pairing keys, its cold start (`start`:
    `starts`, per run, as `configs.run_starts` gives it; else, and where it has none, `cold_seed=<n>`, as each
    rung trains its own start per cold-start seed), start and late accuracy, accuracy change, and the first step's
    reward and entropy."""
    keys = df.groupby("run")[["rung", *PAIR]].first()
    first = df[df["step"] == df.loc[df["key"] == REWARD_MEAN, "step"].min()]
    at_start = first[first["key"].isin([REWARD_MEAN, POLICY_ENTROPY])].pivot_table(
        index="run", columns="key", values="value"
    )
    out = keys.assign(start_accuracy=start_accuracy(df), late_accuracy=late_accuracy(df))
    own = "cold_seed=" + out["cold_seed"].astype(int).astype(str)
    out["start"] = own if starts is None else starts.reindex(out.index).fillna(own).astype(str)
    out["change"] = out["late_accuracy"] - out["start_accuracy"]
    out["start_reward"] = at_start.get(REWARD_MEAN)
    out["start_entropy"] = at_start.get(POLICY_ENTROPY)
    return out.reset_index()


def share_interval(pairs: pd.DataFrame) -> tuple[float, float]:
    """95% interval of the share mean(d) / mean(gap) over `pairs` (columns cold_seed, seed, d, gap): the
    hierarchical bootstrap of `clustered.bootstrap`, cold-start seeds then seeds within."""
    units = pairs.rename(columns={COLD: "start"})
    draws = start_draws(units[["start", "seed"]])
    _, lo, hi, _ = bootstrap(units, lambda r: float(r["d"].mean() / r["gap"].mean()), draws)
    return lo, hi


def ladder_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per rung: runs and cold starts, mean start (accuracy, reward, entropy), accuracy change (the mean of its
    starts' means, `clustered.hierarchical_bootstrap`), the paired difference to moe (`clustered.paired_by_start`
    over cold-start seeds, `pairs` and `pair_starts` behind it) and the share of the dense - moe gap it closes
    (NaN for the two ends' own rows), with intervals and p only from 5 starts on (`descriptive` says why not)."""
    change = runs.pivot_table(index=PAIR, columns="rung", values="change")
    rows = []
    for rung, g in runs.groupby("rung", sort=False):
        n_starts = int(g["start"].nunique())
        mean, lo, hi = hierarchical_bootstrap(g["change"].to_numpy(), g["start"].to_numpy())
        own = descriptive_reason(n_starts)
        row = {
            "rung": rung,
            "runs": len(g),
            "n_starts": n_starts,
            "start_accuracy": g["start_accuracy"].mean(),
            "start_reward": g["start_reward"].mean(),
            "start_entropy": g["start_entropy"].mean(),
            "change": mean,
            "change_lo": math.nan if own else lo,
            "change_hi": math.nan if own else hi,
            "pairs": 0,
            "pair_starts": 0,
            "vs_moe": math.nan,
            "vs_moe_lo": math.nan,
            "vs_moe_hi": math.nan,
            "vs_moe_p": math.nan,
            "share": math.nan,
            "share_lo": math.nan,
            "share_hi": math.nan,
            "descriptive": own or "",
        }
        if {REFERENCE, TARGET, rung} <= set(change.columns):
            both = change[list(dict.fromkeys([rung, REFERENCE, TARGET]))].dropna()
            pairs = pd.DataFrame(
                {
                    COLD: both.index.get_level_values(COLD),
                    "seed": both.index.get_level_values("seed"),
                    "d": (both[rung] - both[REFERENCE]).to_numpy(),
                    "gap": (both[TARGET] - both[REFERENCE]).to_numpy(),
                }
            )
            row["pairs"], row["pair_starts"] = len(pairs), int(pairs[COLD].nunique())
            paired = descriptive_reason(row["pair_starts"])
            row["descriptive"] = descriptive_reason(min(n_starts, row["pair_starts"])) or ""
            if rung != REFERENCE:
                test = paired_by_start(pairs["d"], pairs[COLD])
                row["vs_moe"], row["vs_moe_lo"], row["vs_moe_hi"] = test["mean_diff"], test["lo"], test["hi"]
                row["vs_moe_p"] = test["p_value"]
            if len(pairs) and pairs["gap"].mean() != 0:
                row["share"] = float(pairs["d"].mean() / pairs["gap"].mean())
                if rung not in (REFERENCE, TARGET) and not paired:  # the ends are 0 and 1 by construction
                    row["share_lo"], row["share_hi"] = share_interval(pairs)
        rows.append(row)
    table = pd.DataFrame(rows)
    tested = table["vs_moe_p"].notna()
    table["vs_moe_holm"] = math.nan
    table.loc[tested, "vs_moe_holm"] = holm(table.loc[tested, "vs_moe_p"].to_numpy())  # over the rungs
    return table.set_index("rung").loc[_in_ladder_order(table["rung"])].reset_index()


def _in_ladder_order(rungs: Iterable[str]) -> list[str]:
    """The distinct `rungs`, moe first, dense last, the others sorted between."""
    present = set(rungs)
    return [r for r in (REFERENCE, *sorted(present - {REFERENCE, TARGET}), TARGET) if r in present]


def _rung_of(df: pd.DataFrame) -> pd.Series:
    """Each run's rung, for the runs of a `load_results` frame that have one."""
    return df.groupby("run")["rung"].first().dropna()


def gap_established(table: pd.DataFrame) -> bool:
    """Whether the ladder has a gap to share: the dense - moe paired interval excludes 0 (a share of a gap
    that may be 0 is a ratio over noise, whatever its interval says)."""
    dense = table.loc[table["rung"] == TARGET]
    return bool(len(dense)) and bool((dense["vs_moe_lo"] > 0).iloc[0] or (dense["vs_moe_hi"] < 0).iloc[0])


def verdict(row: pd.Series, gap: bool = True) -> str:
    """What a rung does to the gap, by its share's interval; nothing where it is descriptive (fewer than 5 starts)
    or where there is no gap (`gap_established`)."""
    if row["rung"] in (REFERENCE, TARGET):
        return "reference (0)" if row["rung"] == REFERENCE else "target (1)"
    if _descriptive(row):
        return "descriptive"
    if not gap:
        return "no gap to share"
    if not np.isfinite(row["share_lo"]):
        return "too few pairs"
    if row["share_lo"] > 0.5:
        return "closes the gap"
    if row["share_hi"] < 0:
        return "opens the gap"
    if row["share_lo"] > 0:
        return "closes part of it"
    return "no clear effect"


def _descriptive(row: pd.Series) -> bool:
    return isinstance(row.get("descriptive"), str) and bool(row["descriptive"])  # read back from a csv, "" is NaN


def _p(row: pd.Series) -> str:
    return f"{row['vs_moe_p']:.3f} ({row['vs_moe_holm']:.3f})" if np.isfinite(row["vs_moe_p"]) else "—"


def _bounded(x: float, limit: float = 100.0) -> str:
    """A share bound as +x.xx, or beyond ±`limit` as such (a near-zero gap sends a ratio's bounds far out)."""
    return f"{x:+.2f}" if abs(x) <= limit else f"{'>' if x > 0 else '<'}{'+' if x > 0 else '-'}{limit:g}"


def _ci(x: float, lo: float, hi: float) -> str:
    """A difference in pp with its interval; the point alone where it has none (descriptive), — where none."""
    if not np.isfinite(x):
        return "—"
    return f"{100 * x:+.1f}" + (f" [{100 * lo:+.1f}, {100 * hi:+.1f}]" if np.isfinite(lo) else "")


def format_ladder_markdown(table: pd.DataFrame) -> str:
    """The ladder as a markdown table, points as percentages of held-out accuracy; a descriptive number (fewer than
    5 starts behind it) prints without an interval."""
    lines = [
        "| rung | runs (starts) | start acc | first reward | first entropy | accuracy change (pp) [95%] | "
        "vs moe, paired (pp) [95%] | p (Holm) | share of gap [95%] | reads |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|:---|",
    ]
    gap = gap_established(table)
    for _, r in table.iterrows():
        share = (
            f"{r['share']:+.2f} [{_bounded(r['share_lo'])}, {_bounded(r['share_hi'])}]"
            if np.isfinite(r["share_lo"])
            else (f"{r['share']:+.2f}" if np.isfinite(r["share"]) else "—")
        )
        lines.append(
            f"| {r['rung']} | {r['runs']} ({r['n_starts']}) | {100 * r['start_accuracy']:.1f}% | "
            f"{r['start_reward']:.3f} | {r['start_entropy']:.3f} | {_ci(r['change'], r['change_lo'], r['change_hi'])} "
            f"| {_ci(r['vs_moe'], r['vs_moe_lo'], r['vs_moe_hi'])} | {_p(r)} | {share} | {verdict(r, gap)} |"
        )
    reasons = sorted({r["descriptive"] for _, r in table.iterrows() if _descriptive(r)})
    if reasons:
        lines += ["", f"A number without an interval or p is {' or '.join(reasons)}; a descriptive rung is not read."]
    return "\n".join(lines)


def plot_ladder(table: pd.DataFrame) -> Figure:
    """Each rung's share of the dense - moe gap with its interval; 0 (moe) and 1 (dense) marked."""
    fig = Figure(figsize=(7, 0.45 * len(table) + 1.2))
    ax = fig.subplots()
    y = np.arange(len(table))[::-1]
    share = table["share"].to_numpy(float)
    lo = np.where(np.isfinite(table["share_lo"]), table["share_lo"], share)
    hi = np.where(np.isfinite(table["share_hi"]), table["share_hi"], share)
    ax.errorbar(share, y, xerr=[share - lo, hi - share], fmt="o", capsize=3)
    for x, label in ((0, REFERENCE), (1, TARGET)):
        ax.axvline(x, color="grey", lw=0.8, ls="--")
        ax.text(x, y.max() + 0.6, label, ha="center", va="bottom", fontsize=8, color="grey")
    ax.set_yticks(y, table["rung"])
    ax.set_xlabel("share of the dense - moe gap in accuracy change (paired, 95% CI)")
    fig.tight_layout()
    return fig


def instrument_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per rung (rows in the ladder's order), each instrument of `INSTRUMENTS` a run logged: the mean over its
    runs of the run's mean over steps (`LAST`: its value at the last logged step). A rung without routers
    (a dense one) or runs that predate an instrument show NaN."""
    sub = df[df["key"].isin(INSTRUMENTS)]
    if sub.empty:
        return pd.DataFrame()
    rung = _rung_of(df)
    mean = sub.groupby(["run", "key"])["value"].mean()
    last = sub.sort_values("step").groupby(["run", "key"])["value"].last()
    per_run = mean.where(~mean.index.get_level_values("key").isin(LAST), last).unstack("key")
    table = per_run.groupby(rung.reindex(per_run.index)).mean()
    return table.reindex(_in_ladder_order(rung))[[k for k in INSTRUMENTS if k in table]]


def format_instruments_markdown(table: pd.DataFrame) -> str:
    """`instrument_table` as markdown: one row per rung, — where a rung logged nothing."""
    lines = [
        "| rung | " + " | ".join(INSTRUMENTS[k] for k in table.columns) + " |",
        "|:---|" + "---:|" * len(table.columns),
    ]
    for rung, row in table.iterrows():
        cells = [f"{v:.3g}" if np.isfinite(v) else "—" for v in row.to_numpy(float)]
        lines.append(f"| {rung} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_instruments(df: pd.DataFrame, table: pd.DataFrame) -> Figure:
    """One panel per instrument in `table`: its mean over each rung's runs by step."""
    keys = list(table.columns)
    fig = Figure(figsize=(4.2 * min(len(keys), 4), 3.2 * math.ceil(len(keys) / 4)))
    axes = np.atleast_1d(fig.subplots(math.ceil(len(keys) / 4), min(len(keys), 4))).ravel()
    rung = _rung_of(df)
    for ax, key in zip(axes, keys):
        sub = df[df["key"] == key]
        curves = sub.assign(rung=sub["run"].map(rung)).groupby(["rung", "step"])["value"].mean()
        for name in table.index:
            if name in curves.index.get_level_values("rung"):
                ax.plot(curves[name].index, curves[name].to_numpy(), label=name, lw=1)
        ax.set_title(INSTRUMENTS[key], fontsize=9)
        ax.set_xlabel("step")
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    return fig


def ladder_section(df: pd.DataFrame, starts: pd.Series | None = None) -> tuple[dict[str, pd.DataFrame | Figure], str]:
    """The ladder of a `load_results` frame of finished runs (`starts`: each run's cold start, `ladder_runs`): the
    files of its section (the table and figure, and those of the instruments when the runs logged any: {file name:
    table or figure}) and the markdown section opening the report (this module's rule, the table, the
    instruments)."""
    table = ladder_table(ladder_runs(df, starts))
    rule = (__doc__ or "").split("\n\n", 1)[1].replace("\n", " ").strip()
    heading = "## The ladder: which rung closes the dense - moe gap"
    lines = [heading, "", rule, "", format_ladder_markdown(table), "", "![ladder](ladder.png)"]
    files: dict[str, pd.DataFrame | Figure] = {"ladder.csv": table, "ladder.png": plot_ladder(table)}
    instruments = instrument_table(df)
    if not instruments.empty:  # what each rung does to the load, the routers and the expert steps
        lines += [
            "",
            "### Load, routers and expert steps by rung",
            "",
            "Means over each run's logged steps (router drift: at its last one), averaged over the rung's runs.",
            "",
            format_instruments_markdown(instruments),
            "",
            "![instruments](instruments.png)",
        ]
        files |= {"instruments.csv": instruments.reset_index(), "instruments.png": plot_instruments(df, instruments)}
    return files, "\n".join(lines)


def write_mechanism_report(runs_dir: Path, out: Path, presets: Path) -> list[Path]:
    """A mechanism ladder's folder: the usual report of its runs by rung, opened by the ladder (each rung's
    share of the dense - moe gap) as a table, a csv and a figure; `presets` is not read."""
    written = write_report(runs_dir, out, by=["rung"], reference=REFERENCE)
    df = load_results(runs_dir)
    done = df[~df["status"].isin(INCOMPLETE_STATUSES)]
    starts = run_starts(done)
    files, text = ladder_section(done, starts)
    text += expert_activity.section(done, starts)  # the 1/sqrt(p) test, where runs logged its instrument
    written += [
        write_png(out / name, v) if isinstance(v, Figure) else write_csv(out / name, v) for name, v in files.items()
    ]
    after_title(out / "summary.md", text)
    return written


report = with_provenance(
    write_mechanism_report
)  # the report its declaration names: summary.md says where its runs came from
