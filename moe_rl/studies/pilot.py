"""A pilot across starts, declared like a study (`pilot:` in its declaration, no contrasts): where its reference
arm reaches the declared loss, and what a study there needs.

A pilot runs its cells (typically one arm at a bracket of lrs, each a level) over its members like any study and
decides nothing. Per cell: the accuracy change over starts with its 95% t interval, the runs at the floor (late
accuracy 0), routing's share of the ratio variance and the early acting KL. The **edge** is the reference arm's
level whose mean loss (minus the change) lies in `pilot.loss` with at most `pilot.floor` of its runs at the floor,
the one nearest the band's middle where several do; where none does, the lr at which the mean loss, interpolated
linearly in log lr between the two bracketing levels, reaches the band's middle is suggested, or the way to move.
At the edge, the starts a paired study needs for the study's MDE at its power and one-sided alpha, from the SD of
the reference's change over starts (two arms of that SD, uncorrelated: the paired SD is sqrt(2) times it)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from moe_rl.analysis.load import run_lr
from moe_rl.analysis.power import interval_text
from moe_rl.run.atomic import write_atomic
from moe_rl.studies.design import Study


def pilot_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per cell (arm, level, lr): starts, the change (pp), runs at the floor, the routing share (pp) and the early
    acting KL (geometric mean over starts), with the mean loss and the SD of the change over starts (fractions)."""
    rows = []
    for (arm, level), g in runs.groupby(["arm", "level"], sort=False):
        kl = g["kl_acting"].dropna()
        rows.append(
            {
                "arm": arm,
                "level": level,
                "lr": float(g["lr"].median()),
                "starts": int(g["start"].nunique()),
                "change (pp)": interval_text(g["change"]),
                "at the floor": f"{int((g['late_accuracy'] <= 0).sum())} of {len(g)}",
                "routing share (pp)": interval_text(g["routing_share"]),
                "early acting KL": f"{math.exp(np.log(kl[kl > 0]).mean()):.3g}" if (kl > 0).any() else "—",
                "loss": float(-g["change"].mean()),
                "floor_share": float((g["late_accuracy"] <= 0).mean()),
                "sd": float(g["change"].std(ddof=1)) if len(g) > 1 else math.nan,
            }
        )
    return pd.DataFrame(rows).sort_values(["arm", "lr"], kind="stable").reset_index(drop=True)


def starts_needed(sd: float, mde: float, power: float, alpha: float) -> int:
    """Starts for a paired difference of two arms of this SD (uncorrelated), at the MDE, power and one-sided alpha
    (the normal approximation, one look)."""
    z = float(stats.norm.isf(alpha) + stats.norm.isf(1 - power))
    return math.ceil((z * math.sqrt(2) * sd / mde) ** 2)


def edge(study: Study, table: pd.DataFrame) -> str:
    """Where the reference reaches the declared loss, in one paragraph (see the module docstring)."""
    assert study.pilot is not None
    p, d = study.pilot, study.design
    lo, hi = p.loss
    ref = table[table["arm"] == p.reference].sort_values("lr")
    band = f"a loss of {100 * lo:g}-{100 * hi:g} points with at most {p.floor:.0%} of runs at the floor"
    inside = ref[(ref["loss"] >= lo) & (ref["loss"] <= hi) & (ref["floor_share"] <= p.floor)]
    if len(inside):
        row = inside.iloc[int(np.argmin(np.abs(inside["loss"].to_numpy() - (lo + hi) / 2)))]
        n = starts_needed(row["sd"], d.mde, d.power, d.alpha) if row["sd"] == row["sd"] else None
        size = (
            f" There the reference's change has an SD of {100 * row['sd']:.1f} pp over {row['starts']} starts: a paired "
            f"study of two such arms needs about {n} starts for {100 * d.mde:g} pp at {d.power:.0%} power (one-sided "
            f"alpha {d.alpha:g}, one look; looks cost a few more)."
            if n is not None
            else ""
        )
        return (
            f"**Edge: {row['level']} (lr {row['lr']:.3g})**, where {p.reference} loses {100 * row['loss']:.1f} points "
            f"with {row['at the floor']} runs at the floor ({band})." + size
        )
    target = (lo + hi) / 2
    loss, lr = ref["loss"].to_numpy(), ref["lr"].to_numpy()
    for i in range(len(ref) - 1):
        if (loss[i] - target) * (loss[i + 1] - target) < 0:
            t = (target - loss[i]) / (loss[i + 1] - loss[i])
            guess = math.exp(math.log(lr[i]) + t * (math.log(lr[i + 1]) - math.log(lr[i])))
            return (
                f"**No level reaches {band}.** Interpolated in log lr, {p.reference} would lose {100 * target:g} points "
                f"at lr {guess:.3g}, between {ref['level'].iloc[i]} and {ref['level'].iloc[i + 1]}: pilot there."
            )
    way = "raise the lr" if len(loss) and np.nanmax(loss) < lo else "lower the lr"
    return f"**No level reaches {band}**, nor brackets it: {way} and pilot again."


def write_pilot_report(study: Study, runs: pd.DataFrame, out: Path) -> list[Path]:
    """<out>/summary.md and cells.csv of a pilot (its runs as `study_rule.per_run` reads them)."""
    runs = runs.assign(lr=[run_lr(Path(str(r))) for r in runs["run_dir"]])
    table = pilot_table(runs)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "cells.csv", table.to_csv(index=False).encode())
    shown = table.drop(columns=["loss", "floor_share", "sd"])
    lines = [
        f"# {study.name}: a pilot",
        "",
        study.question,
        "",
        f"A pilot across {runs['start'].nunique()} starts (`pilot:` in its declaration, {study.file.name}): it "
        "decides nothing. Each cell: the accuracy change over starts (mean [95% t interval], pp), the runs at the "
        "floor, routing's share of the ratio variance and the early per-update KL on the routes each arm acts with "
        "(`moe_rl.studies.pilot`).",
        "",
        shown.to_markdown(index=False),
        "",
        edge(study, table),
        "",
    ]
    write_atomic(out / "summary.md", "\n".join(lines).encode())
    return [out / "summary.md", out / "cells.csv"]
