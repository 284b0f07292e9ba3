"""The mission's comparison on each rung of the routing-dominance ladder: GRPO + R2, GRPO without replay and GSPO on
collapse events, route flips on the routes each arm acts with and the token importance-ratio variance, beside the
accuracy verdicts of claims 2 (R2) and 3 (GSPO). Each rung is read from the declared study that decides claims 2 and
3 on it (`RUNGS`), at the look that study read, on its admitted runs; a rung without one says why.

Per rung, the row of GRPO without replay gives its cell: the mean over starts of each outcome with its 95% t interval
over starts (the collapse events as the share of runs that collapsed, k of n; the ratio variance as the geometric mean
over starts). The rows of GRPO + R2 and GSPO give their contrast against it, paired over starts as the study pairs
its primary outcome: the accuracy verdict with its repeated interval, and the study's secondary outcomes
(`moe_rl.studies.secondary`: differences in pp, ratios for the variances)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.power import interval_text, t_interval
from moe_rl.studies.design import declaration, load_study
from moe_rl.studies.secondary import LOG_SCALE, SECONDARY, cell_text
from moe_rl.studies.study_rule import StudyResult, analyse, routing_share_text


@dataclass(frozen=True)
class Rung:
    name: str
    study: str | None  # the declared study deciding claims 2 and 3 on it; None: none does
    why_not: str = ""  # where `study` is None: why


RUNGS = (
    Rung("default (8 experts of width 64, top-2, 2 layers)", "offpolicy_edge"),
    Rung("64 experts of width 64, top-2, 4 layers", "routing_dominant"),
    Rung(
        "fine (64 experts of width 16, top-8, 4 layers)",
        None,
        "no study: routing carries about a tenth of the ratio variance there (the ladder's pilot: 9-12% over the run), "
        "less than on the default model (12-17%), so the claims run on the rung where it carries most",
    ),
)
REFERENCE = "grpo_none"
METHODS = (  # (label, contrast against the reference)
    ("GRPO + R2", "r2_minus_none"),
    ("GSPO", "gspo_minus_grpo_none"),
)
OUTCOMES = ("collapsed", "flip_acting", "ratio_var_early", "ratio_var")
HEAD = ["rung", "method", "starts", "accuracy change (pp)", *(SECONDARY[o] for o in OUTCOMES)]


def _cell_row(result: StudyResult, cell: str) -> list[str]:
    """The reference cell's outcomes: starts, then each outcome's mean over starts [95% t interval over starts]."""
    runs = result.runs[(result.runs["cell"] == cell) & result.runs["admitted"]]
    by = runs.groupby("start")
    cells = [str(runs["start"].nunique()), interval_text(by["change"].mean())]
    for o in OUTCOMES:
        if o == "collapsed":
            share = interval_text(by[o].mean())
            cells.append(f"{share} pp ({int(runs[o].sum())} of {len(runs)})")
        elif o in LOG_SCALE:
            logs = np.log(by[o].mean().where(lambda v: v > 0).dropna().to_numpy(float))
            if len(logs) >= 2 and np.ptp(logs) > 0:
                mean, lo, hi, _, _ = t_interval(logs)
                cells.append(f"{math.exp(float(mean)):.3f} [{math.exp(float(lo)):.3f}, {math.exp(float(hi)):.3f}]")
            else:
                cells.append(f"{math.exp(float(logs.mean())):.3f}" if len(logs) else "—")
        else:
            cells.append(f"{interval_text(by[o].mean())} pp")
    return cells


def _contrast_row(result: StudyResult, contrast: str) -> list[str]:
    """A method's contrast against the reference: starts, the accuracy verdict with its repeated interval, and each
    secondary outcome's paired estimate [95% t interval over starts]."""
    v = result.verdicts.set_index("contrast").loc[contrast]
    accuracy = (
        f"{100 * v['estimate']:+.1f} [{100 * v['lo']:+.1f}, {100 * v['hi']:+.1f}], {v['verdict']} (claim {v['claim']})"
    )
    sec = result.secondary[result.secondary["contrast"] == contrast].set_index("outcome")
    cells = [str(int(v["starts"])), accuracy]
    for o in OUTCOMES:
        if o not in sec.index or math.isnan(float(sec.loc[o, "estimate"])):
            cells.append("—")
            continue
        r = sec.loc[o]
        text = cell_text(pd.Series({**r, "outcome": o}))
        if o == "collapsed" and isinstance(r.get("first"), str):
            text += f" ({int(r['k_first'])} vs {int(r['k_second'])} of {int(r['runs'])})"
        cells.append(text)
    return cells


def mission_rows(root: Path, presets: Path) -> list[list[str]]:
    """The table's rows: per rung, GRPO without replay's cell, then GRPO + R2 and GSPO against it; a rung without
    a study, or whose study has no runs under `root`, one row saying so."""
    rows: list[list[str]] = []
    for rung in RUNGS:
        if rung.study is None:
            rows.append([rung.name, "—", "—", rung.why_not, *(["—"] * len(OUTCOMES))])
            continue
        study = load_study(declaration(rung.study, presets))
        try:
            result = analyse(study, Path(root) / rung.study / "runs")
        except FileNotFoundError:
            rows.append([rung.name, "—", "—", f"`{rung.study}` has no runs here", *(["—"] * len(OUTCOMES))])
            continue
        r2 = next(c for c in study.contrasts if c.name == METHODS[0][1])
        level = next(iter(r2.weights))[1]
        cell = f"{REFERENCE}@{level}"
        share = routing_share_text(result.runs[result.runs["admitted"]], [cell])
        rows.append([f"{rung.name}; `{rung.study}`, {share}", "GRPO without replay", *_cell_row(result, cell)])
        for label, contrast in METHODS:
            rows.append(["", f"{label} minus GRPO without replay", *_contrast_row(result, contrast)])
    return rows


def mission_section(root: Path, presets: Path) -> list[str]:
    """The section's lines (markdown): a heading, what the columns are, the table."""
    lines = [
        "## The mission's comparison per rung",
        "",
        "GRPO + R2, GRPO without replay and GSPO on each rung, from the declared study that decides claims 2 and 3 "
        "there, at the look it was read, on its admitted runs (`moe_rl.studies.ladder_mission`). GRPO without replay: "
        "its cell, each outcome's mean over starts with the 95% t interval over starts (the ratio variance a geometric "
        "mean). The others: paired over starts against it, the accuracy verdict with its repeated interval, each "
        "other outcome's difference (pp) or ratio (x) with its 95% t interval over starts. Collapse events: the share "
        "of runs that collapsed (the main definition); route flips: on the routes the arm acts with, per off-policy "
        "update (0 where replay holds them); ratio variance: the token importance ratio's, over steps 1..20 (early) "
        "and over the run.",
        "",
        "| " + " | ".join(HEAD) + " |",
        "|" + "|".join([":---", ":---", "---:", *([":---"] * (len(HEAD) - 3))]) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in mission_rows(root, presets)]
    return [*lines, ""]
