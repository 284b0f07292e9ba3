"""The length study's own computation (`experiments/conf/study/length.yaml`, named in its `sections`): trends over
log L, descriptive beside the contrasts the one rule decides.

A length L is a task whose response length the run holds fixed (reasoning-gym's `basic_arithmetic`, two L-digit
addends: the answer's L or L + 1 digits each hang on a carry, so per-token difficulty does not fall with L), with a
pool of cold starts of its own; each declared axis is a KL level, its levels the lengths in order. The unit a trend is
fitted on is the pool member (the declaration's `unit.start: member`: a member's warm-ups at every length, and its
twins warmed on another machine, share its initial weights and data order):

1. per (member, length), the mean over its admitted runs of the quantity (an arm's outcome, or the paired
   difference of two arms on the run seed within the length);
2. per member, the least-squares slope of those means against log L over the lengths it has (2 or more);
3. the mean of the members' slopes with its 95% t interval over members (the interval every declared contrast
   reads) and the lengths it spans; below 3 members no interval.

A slope is in units per e-fold of L: over L = 4 -> 32 (log 8 = 2.08) a slope of -0.02 in accuracy change is about
4 points. Where most runs of a cell end at accuracy 0 its mean is read on a floor, and the table says so.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.power import t_interval
from moe_rl.studies.design import Study, member_start
from moe_rl.studies.study_rule import BOUND_SHARE, StudyResult

# (label, outcome column, arm a, arm b or None, log scale): the trends each axis reports, where its arms ran
TRENDS = (
    ("grpo+none's accuracy change (claim 12)", "change", "grpo_none", None, False),
    ("gspo+none - grpo+none (claims 3 and 12)", "change", "gspo_none", "grpo_none", False),
    ("grpo+r2 - grpo+none (claim 2)", "change", "grpo_r2", "grpo_none", False),
    ("grpo+none's routing share (claim 13)", "routing_share", "grpo_none", None, False),
    ("grpo+none's log token ratio variance", "token_var", "grpo_none", None, True),
    ("grpo+none's log sequence ratio variance", "seq_var", "grpo_none", None, True),
    ("gspo+none's log token ratio variance", "token_var", "gspo_none", None, True),
    ("gspo+none's log sequence ratio variance", "seq_var", "gspo_none", None, True),
)


def length_of(study: Study, level: str) -> int:
    """The response length a level pins (its `task.gym.kwargs.max_digits` override)."""
    for o in study.levels[level].overrides:
        if m := re.fullmatch(r"task\.gym\.kwargs\.max_digits=(\d+)", o):
            return int(m.group(1))
    raise ValueError(f"study {study.name}: level {level} pins no length (task.gym.kwargs.max_digits)")


def member_values(
    study: Study, runs: pd.DataFrame, levels: tuple[str, ...], value: str, a: str, b: str | None = None
) -> pd.DataFrame:
    """Per (pool member, L) over `levels`: arm a's mean of `value` over its runs (the member's seeds, twins
    included), or with `b` the mean of the paired difference a - b on the run seed within the length; columns
    member, L, y."""
    rows = []
    for level in levels:
        at = runs[runs["level"] == level]
        y = at[at["arm"] == a].set_index("seed")[value]
        if b is not None:
            y = y - at[at["arm"] == b].set_index("seed")[value]
        y = y.dropna()
        members = [member_start(s, study.member_pool) for s in y.index]  # run seed m + r * pool: member m
        for member, v in y.groupby(members):
            rows.append({"member": member, "L": length_of(study, level), "y": float(v.mean())})
    return pd.DataFrame(rows, columns=["member", "L", "y"])


def slopes(values: pd.DataFrame, log_y: bool = False) -> pd.Series:
    """Each member's least-squares slope of y (or log y) against log L, over the lengths it has (2 or more)."""
    out = {}
    for member, g in values.groupby("member"):
        y = np.log(g["y"].to_numpy(float)) if log_y else g["y"].to_numpy(float)
        x = np.log(g["L"].to_numpy(float))
        keep = np.isfinite(y)
        if keep.sum() >= 2 and len(set(x[keep])) >= 2:
            out[member] = float(np.polyfit(x[keep], y[keep], 1)[0])
    return pd.Series(out, dtype=float, name="slope")


def trend(
    study: Study, runs: pd.DataFrame, levels: tuple[str, ...], value: str, a: str, b: str | None, log_y: bool
) -> dict[str, object]:
    """The mean of the members' slopes with its 95% t interval over members (`slopes`; NaN below 3 members)."""
    s = slopes(member_values(study, runs, levels, value, a, b), log_y)
    if len(s) < 3:
        return {"members": len(s), "slope": float(s.mean()) if len(s) else math.nan, "lo": math.nan, "hi": math.nan}
    mean, lo, hi, _, _ = (float(v) for v in t_interval(s.to_numpy()))
    return {"members": len(s), "slope": mean, "lo": lo, "hi": hi}


def trend_table(study: Study, result: StudyResult) -> pd.DataFrame:
    """Every declared axis's trends (`TRENDS`, where its arms ran), with the levels whose cells sit on a floor."""
    runs = result.runs[result.runs["admitted"]]
    floor = result.cells.set_index("cell")["floor_share"] > BOUND_SHARE  # the cells' table, on the admitted runs
    rows = []
    for axis, levels in study.axes.items():
        ran = set(runs.loc[runs["level"].isin(levels), "arm"])
        for label, value, a, b, log_y in TRENDS:
            if not {a, b or a} <= ran or value not in runs:
                continue
            cells = [f"{arm}@{lv}" for lv in levels for arm in (a, b) if arm]
            on_floor = sorted({length_of(study, c.split("@")[1]) for c in cells if floor.get(c, False)})
            row = {"axis": axis, "trend": label, **trend(study, runs, levels, value, a, b, log_y)}
            row["lengths"] = ", ".join(str(length_of(study, lv)) for lv in levels)
            row["floor at L"] = ", ".join(map(str, on_floor))
            rows.append(row)
    return pd.DataFrame(rows)


def trend_section(study: Study, result: StudyResult, out: Path) -> tuple[list[str], list[Path]]:
    """trends.csv in `out` and its markdown: each axis's trends over log L (module docstring)."""
    from moe_rl.analysis.folder_report import write_csv

    table = trend_table(study, result)
    shown = table.assign(
        **{
            "slope [95%]": [
                f"{r.slope:+.4f}" + ("" if math.isnan(r.lo) else f" [{r.lo:+.4f}, {r.hi:+.4f}]")
                for r in table.itertuples()
            ]
        }
    )[["axis", "trend", "slope [95%]", "members", "lengths", "floor at L"]]
    text = [
        "## Trends over log L",
        "",
        "Per pool member (its twins one), the mean over its admitted runs at each length of the quantity (an arm's "
        "outcome, or two arms' paired difference on the run seed), then the member's least-squares slope against "
        "log L, then the mean of the members' slopes with its 95% t interval over members. A slope is per e-fold of "
        "L: over L = 4 -> 32 a slope of -0.02 in accuracy change is about 4 points. `floor at L`: the lengths where "
        "most runs of a cell read end at accuracy 0. Descriptive: the claims are decided by the contrasts above.",
        "",
        shown.to_markdown(index=False),
        "",
    ]
    return text, [write_csv(out / "trends.csv", table)]
