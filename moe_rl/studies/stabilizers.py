"""The stabilizer leaderboard: every arm against one reference arm, paired by cell and seed.

One row per arm, pooled over the cells it ran in. Primary columns (declared in
`experiments/conf/preset/stabilizers.yaml`): late accuracy (mean of the last evaluations, as the
claims use it), reward AUC and survival (the share of runs the loop did not label collapsed), each as
the arm's mean and its paired difference to the reference. The cold start, not the seed, is the unit of
replication (`moe_rl.analysis.clustered`): a difference is the mean over cold starts of each start's mean
paired difference, its 95% interval a hierarchical bootstrap (starts, then pairs within) and its p a sign
flip per start, Holm over the arms of each column; below 5 independent starts a difference is descriptive,
with no interval and no p. Descriptive columns: the off-policy token log-ratio variance, the routing part's
share of it and the clip fraction, per-run means over the run, then means over runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.claims import runs_folder
from moe_rl.analysis.claims.cells import starts_of
from moe_rl.analysis.clustered import paired_by_start
from moe_rl.analysis.configs import run_starts
from moe_rl.analysis.folder_report import after_title, write_csv, write_report
from moe_rl.analysis.load import INCOMPLETE_STATUSES, load_results
from moe_rl.analysis.phase import run_outcomes
from moe_rl.analysis.stats import holm
from moe_rl.analysis.tables import per_run_mean, variant_per_run
from moe_rl.metrics.names import (
    RATIO_CLIPFRAC_HIGH,
    RATIO_CLIPFRAC_LOW,
    RATIO_SPLIT_ROUTING_SHARE,
    RATIO_TOKEN_VAR,
)

REFERENCE = "grpo+none"
PAIR_ON = ("lr", "N", "seed")
PRIMARY = ("late_accuracy", "reward_auc", "survived")
DESCRIPTIVE = ("token_ratio_var", "routing_share", "clip_frac")


def per_run(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: its keys, its cold start (`start`, `configs.run_starts`), the primary outcomes and the
    descriptive means."""
    out = run_outcomes(df).set_index("run", drop=False).rename_axis(None)
    out["start"] = run_starts(df)
    out["survived"] = (~out["collapsed_in_loop"].astype(bool)).astype(float)
    out["token_ratio_var"] = variant_per_run(df, RATIO_TOKEN_VAR)
    out["routing_share"] = variant_per_run(df, RATIO_SPLIT_ROUTING_SHARE)
    low, high = per_run_mean(df, RATIO_CLIPFRAC_LOW), per_run_mean(df, RATIO_CLIPFRAC_HIGH)
    out["clip_frac"] = low.add(high, fill_value=0.0) if len(low) or len(high) else np.nan
    return out.reset_index(drop=True)


def same_computations(runs: pd.DataFrame, pair_on: Sequence[str] = PAIR_ON, keep: str = REFERENCE) -> dict[str, str]:
    """Arm -> the arm it duplicates: the same (lr, N, seed) runs with bitwise equal outcomes in every primary and
    descriptive column (e.g. thresholded R3 without an inference engine replays what thresholded R2 does). The
    reference `keep` is always kept, otherwise the first arm in name order."""
    arms, out = sorted(runs["arm"].unique(), key=lambda a: (a != keep, a)), {}
    cols = [c for c in (*PRIMARY, *DESCRIPTIVE) if c in runs]
    outcomes = {a: g.set_index(list(pair_on))[cols].sort_index() for a, g in runs.groupby("arm")}
    for i, a in enumerate(arms):
        for b in arms[i + 1 :]:
            if a not in out and b not in out and len(outcomes[a]) and outcomes[a].equals(outcomes[b]):
                out[b] = a
    return out


def paired_starts(
    runs: pd.DataFrame, *, a: str, b: str, value: str, pair_on: Sequence[str] = PAIR_ON
) -> tuple[np.ndarray, np.ndarray]:
    """Arm a - arm b in `value`, paired on `pair_on`, each pair labelled by its cold start (`claims.cells.starts_of`:
    the family's start; the two runs' starts joined where the arms began apart): (differences, start labels)."""
    on = list(pair_on)
    labelled = runs.assign(_start=starts_of(runs))
    left = labelled.loc[labelled["arm"] == a, [*on, "_start", value]]
    right = labelled.loc[labelled["arm"] == b, [*on, "_start", value]]
    for arm, side in ((a, left), (b, right)):
        if side.duplicated(on).any():
            raise ValueError(f"arm {arm!r} has several runs per {on}; pair on more keys")
    pairs = left.merge(right, on=on, how="inner", suffixes=("_a", "_b"))
    same = pairs["_start_a"] == pairs["_start_b"]
    starts = pairs["_start_a"].where(same, pairs["_start_a"] + " | " + pairs["_start_b"])
    return (pairs[f"{value}_a"] - pairs[f"{value}_b"]).to_numpy(float), starts.to_numpy(object)


def leaderboard(runs: pd.DataFrame, *, reference: str = REFERENCE, pair_on: Sequence[str] = PAIR_ON) -> pd.DataFrame:
    """One row per arm of `runs` (from `per_run`; a frame without `start` or `cold_seed` is one cold start), the
    reference first, then by paired late accuracy. Each primary column's difference to the reference is the
    clustered comparison over cold starts (`clustered.paired_by_start`): `pairs`, `n_starts` and `descriptive`
    (why there is no interval or p: fewer than 5 starts; "" where there is one). An arm that is the same computation
    as another (`same_computations`) is listed once, under the kept arm's `same_as` column, and counted once in
    Holm's correction."""
    dupes = same_computations(runs, pair_on, reference)
    runs = runs[~runs["arm"].isin(dupes)]
    if reference not in set(runs["arm"]):
        raise KeyError(f"reference arm {reference!r} has no runs; arms: {sorted(runs['arm'].unique())}")
    rows = []
    for arm, g in runs.groupby("arm", sort=True):
        row: dict = {"arm": arm, "runs": len(g), "cells": g[["lr", "N"]].drop_duplicates().shape[0]}
        row["same_as"] = ", ".join(d for d, kept in dupes.items() if kept == arm)
        row.update({f"{c}_mean": float(g[c].mean()) for c in (*PRIMARY, *DESCRIPTIVE)})
        if arm != reference:
            for col in PRIMARY:
                d, starts = paired_starts(runs, a=arm, b=reference, value=col, pair_on=pair_on)
                test = paired_by_start(d, starts)
                if col == PRIMARY[0]:  # the row's pairs and starts: those of its late accuracy
                    row["pairs"], row["n_starts"] = test["n_pairs"], test["n_starts"]
                    row["descriptive"] = test["descriptive"] or ""
                row[f"{col}_diff"], row[f"{col}_lo"], row[f"{col}_hi"] = test["mean_diff"], test["lo"], test["hi"]
                row[f"{col}_p"] = test["p_value"]
        rows.append(row)
    table = pd.DataFrame(rows)
    for col in PRIMARY:
        p = table.get(f"{col}_p")
        if p is None:
            continue
        tested = p.notna()
        table[f"{col}_holm"] = np.nan
        table.loc[tested, f"{col}_holm"] = holm(p[tested].to_numpy())
    order = table["late_accuracy_diff"].fillna(np.inf) if "late_accuracy_diff" in table else table["arm"]
    return table.assign(_o=order).sort_values("_o", ascending=False).drop(columns="_o").reset_index(drop=True)


def _descriptive(row: pd.Series) -> bool:
    return isinstance(row.get("descriptive"), str) and bool(row["descriptive"])  # read back from a csv, "" is NaN


def _diff(row: pd.Series, col: str, scale: float, spec: str) -> str:
    if pd.isna(row.get(f"{col}_diff")):
        return "ref"
    d, lo, hi = (row[f"{col}_{k}"] * scale for k in ("diff", "lo", "hi"))
    if _descriptive(row) or pd.isna(lo):
        return f"{d:+{spec}}"
    return f"{d:+{spec}} [{lo:+{spec}}, {hi:+{spec}}]"


def _p(row: pd.Series, col: str) -> str:
    if pd.isna(row.get(f"{col}_p")):
        return "—"
    return f"{row[f'{col}_p']:.3f} ({row[f'{col}_holm']:.3f})"


def _num(value: float, spec: str) -> str:
    return "—" if pd.isna(value) else format(value, spec)


def _pairs(row: pd.Series) -> str:
    if pd.isna(row.get("pairs")):
        return "—"
    return f"{int(row['pairs'])} ({int(row['n_starts'])})"


def format_leaderboard_markdown(table: pd.DataFrame, *, reference: str = REFERENCE) -> str:
    """The leaderboard as a markdown table (differences against `reference`, p with Holm in parentheses), then the
    reason, where any row has one, why its differences are descriptive (no interval, no p)."""
    head = (
        "| arm | runs | pairs (starts) | late acc (%) | Δ late acc (pp) [95%] | p (Holm) | reward AUC | Δ AUC [95%] | "
        "p (Holm) | survival (%) | Δ survival (pp) [95%] | p (Holm) | token ratio var | "
        "routing share (%) | clip frac (%) |"
    )
    lines = [head, "|:---|" + "---:|" * 14]
    for _, r in table.iterrows():
        name = f"**{r['arm']}** (ref)" if r["arm"] == reference else str(r["arm"])
        if isinstance(r.get("same_as"), str) and r["same_as"]:  # read back from a csv, "no duplicate" is NaN
            name += f" (= {r['same_as']}: the same computation, counted once)"
        lines.append(
            f"| {name} | {r['runs']} | {_pairs(r)} | {r['late_accuracy_mean'] * 100:.1f} | "
            f"{_diff(r, 'late_accuracy', 100, '.1f')} | {_p(r, 'late_accuracy')} | {r['reward_auc_mean']:.3f} | "
            f"{_diff(r, 'reward_auc', 1, '.3f')} | {_p(r, 'reward_auc')} | {r['survived_mean'] * 100:.0f} | "
            f"{_diff(r, 'survived', 100, '.0f')} | {_p(r, 'survived')} | {_num(r['token_ratio_var_mean'], '.3g')} | "
            f"{_num(r['routing_share_mean'] * 100, '.1f')} | {_num(r['clip_frac_mean'] * 100, '.2f')} |"
        )
    reasons = sorted({r["descriptive"] for _, r in table.iterrows() if _descriptive(r)})
    if reasons:
        lines += ["", f"A Δ without an interval or p is {' or '.join(reasons)}."]
    return "\n".join(lines) + "\n"


def bench_section(
    runs: pd.DataFrame, *, own_runs: set[str], runs_dir: object, borrowed_dir: object, keep: dict[str, object]
) -> list[str]:
    """The opening lines of the stabilizer bench's leaderboard section (up to its pooled table): where its
    runs come from, this module's rule, and the shared cold start."""
    arms = ", ".join(f"{a} {n}" for a, n in runs.groupby("arm").size().items())
    borrowed = sorted(set(runs.loc[~runs["run"].isin(own_runs), "arm"]))
    return [
        "## Leaderboard: every arm against grpo+none",
        "",
        f"{len(runs)} finished runs, {runs['run'].isin(own_runs).sum()} of them from `{runs_dir}`; "
        f"{' and '.join(borrowed)} are the {', '.join(f'{k}={v}' for k, v in keep.items())} runs of "
        f"`{borrowed_dir}` (the same configs but the experiment name). Runs per arm: {arms}.",
        "",
        (__doc__ or "").split("\n\n", 1)[1].replace("\n", " ").strip(),
        "",
        f"{_starts_sentence(runs)} ({100 * runs['start_accuracy'].mean():.1f}% held-out accuracy at step 0): a late "
        "accuracy below it is a run that lost what the cold start had.",
        "",
        "Pooled over the cells (pairs by lr, N and seed, clustered by cold start):",
        "",
    ]


def _starts_sentence(runs: pd.DataFrame) -> str:
    n = starts_of(runs).nunique()
    return "Every arm starts from the same cold start" if n == 1 else f"The arms start from {n} cold starts"


# the runs this folder's report reads from another folder: (folder, the run keys it keeps)
BORROWS: tuple[str, dict[str, object]] = ("dense_control", {"family": "qwen3_moe"})


def write_stabilizers_report(runs_dir: Path, out: Path, presets: Path) -> list[Path]:
    """The stabilizer bench: the usual report of its own runs, opened by the leaderboard of every arm against
    grpo+none, whose runs (and gspo+none's) it borrows from `dense_control` beside its folder (the same configs
    but the name); `presets` is not read."""
    written = write_report(runs_dir, out, by=["arm"])
    folder, keep = BORROWS
    own = load_results(runs_dir)
    beside = (runs_dir.parent if runs_dir.name == "runs" else runs_dir).parent  # the results root
    borrowed_dir = runs_folder(beside, folder)
    borrowed = load_results(borrowed_dir)
    for key, value in keep.items():
        borrowed = borrowed[borrowed[key] == value]
    borrowed = borrowed[~borrowed["arm"].isin(set(own["arm"]))]
    runs = per_run(pd.concat([own, borrowed], ignore_index=True))
    runs = runs[~runs["status"].isin(INCOMPLETE_STATUSES)]
    pooled = leaderboard(runs)
    cells = [(cell, leaderboard(g)) for cell, g in runs.groupby(["lr", "N"], sort=True)]
    frames = [pooled.assign(cell="pooled")] + [t.assign(cell=f"lr {lr:g}, N = {n}") for (lr, n), t in cells]
    csv = write_csv(out / "leaderboard.csv", pd.concat(frames, ignore_index=True))
    section = bench_section(runs, own_runs=set(own["run"]), runs_dir=runs_dir, borrowed_dir=borrowed_dir, keep=keep)
    section.append(format_leaderboard_markdown(pooled))
    for (lr, n), table in cells:
        section += [f"lr {lr:g}, N = {n}:", "", format_leaderboard_markdown(table)]
    after_title(out / "summary.md", "\n".join(section))
    return [*written, csv]


def claims_section(root: Path, presets: Path) -> list[str]:
    """The bench's pooled leaderboard (its report's leaderboard.csv), for CLAIMS.md; none without it."""
    csv = root / "stabilizers" / "leaderboard.csv"
    if not csv.is_file():
        return []
    table = pd.read_csv(csv)
    return [
        "## Stabilizer leaderboard",
        "",
        "Every published stabilizer against grpo+none on the default model in the two cells of the phase map "
        "where it degrades (lr 3e-4 with N = 8, lr 1e-3 with N = 2), 8 seeds each, paired by cell and seed and "
        "clustered by cold start; "
        "not a claim of the papers, so no verdict. Per cell and with the rules: `stabilizers/summary.md`.",
        "",
        format_leaderboard_markdown(table[table["cell"] == "pooled"]),
    ]
