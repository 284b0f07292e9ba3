"""The verdict labels and margins, the Claim row, and the rules and wording every claim shares."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from moe_rl.analysis.accuracy import LATE_EVALS
from moe_rl.analysis.clustered import MIN_UNITS, descriptive_reason
from moe_rl.analysis.collapse_definitions import GRID_DROP_FRACS, GRID_ENTROPY_FLOORS, GRID_PATIENCES

# verdicts
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
FRAGILE = "fragile"  # a collapse verdict that changes within the declared grid of collapse definitions
UNTESTABLE_HERE = "untestable here"  # the runs hold no case the claim speaks of (none yet, or nothing degrades)

# significance and the margins too small to matter
ALPHA = 0.05
COLLAPSE_MARGIN = 0.10  # collapse probability difference too small to matter
ACCURACY_MARGIN = 0.05
DRIFT_MARGIN = 0.10  # relative to the shallow model's drift
REWARD_MARGIN = 0.05  # reward AUC (a mean reward in [0, 1]) difference too small to matter
LEAD_MARGIN = 0.01  # share of the clip fraction's next-step variance too small to matter
N_BOOT = 4999

# A run's final accuracy, in every claim and table of CLAIMS.md: `late_accuracy`, the mean of its last LATE_EVALS
# evaluations (`moe_rl.analysis.accuracy`; one evaluation alone carries ~4 points of sampling noise). The one
# definition the claims read, and its words on the page.
ACCURACY = "late_accuracy"
ACCURACY_DEFINITION = f"the mean of a run's last {LATE_EVALS} evaluations"

# the margin of each outcome a paired claim compares (`paired.PairedClaim.margins`)
MARGINS = {ACCURACY: ACCURACY_MARGIN, "reward_auc": REWARD_MARGIN, "collapse": COLLAPSE_MARGIN}

# the measured outcomes and their names on the page
CONTINUOUS = {ACCURACY: "final accuracy", "reward_auc": "reward AUC"}
PRIMARY = [*CONTINUOUS, "time_to_collapse"]  # what an experiment file's `analysis.primary` should declare


NO_DATA = "no data"  # the reason of a claim no runs have read: its statement alone


@dataclass
class Claim:
    """One row of CLAIMS.md."""

    id: int
    claim: str
    source: str
    rule: str
    experiment: str = ""
    cells: str = ""
    statistic: str = ""
    test: str = ""
    p_value: float = math.nan
    verdict: str = INCONCLUSIVE
    reason: str = NO_DATA
    notes: list[str] = field(default_factory=list)
    plain: str = ""  # a paragraph for a person: what was tested, found, how sure, what would change it
    robustness: dict[str, str] = field(default_factory=dict)  # collapse definition -> verdict, where it applies
    repeated_p: bool = False  # p_value is a declared study's repeated p-value: it joins Holm across the claims
    read_on: str = ""  # the model the verdict was read on and routing's share of the ratio variance there
    divergence: str = ""  # the realised divergence ratio of the cells it compares, with its interval
    secondary: str = ""  # the mission's outcomes of the same contrast, paired over starts


def pct(x: float) -> str:
    return "—" if not np.isfinite(x) else f"{100 * x:.1f}%"


def fmt_p(p: float) -> str:
    return "—" if not np.isfinite(p) else f"{p:.3g}"


def fmt_pp(x: float) -> str:
    """A difference of shares in signed percentage points (0.052 -> "+5.2"); "—" where not finite."""
    return "—" if not np.isfinite(x) else f"{100 * x:+.1f}"


def fmt_num(x: float, spec: str = ".3g") -> str:
    """A number in `spec`; "—" where not finite."""
    return "—" if not np.isfinite(x) else format(x, spec)


def direction_verdict(p_pred: float, p_opp: float, ci: tuple[float, float], margin: float) -> tuple[str, str]:
    if np.isfinite(p_pred) and p_pred < ALPHA:
        return REPRODUCED, f"predicted direction significant (p = {fmt_p(p_pred)})"
    if np.isfinite(p_opp) and p_opp < ALPHA:
        return NOT_REPRODUCED, f"opposite direction significant (p = {fmt_p(p_opp)})"
    lo, hi = ci
    if np.isfinite(lo) and np.isfinite(hi) and -margin < lo and hi < margin:
        return NOT_REPRODUCED, f"effect interval [{lo:.3g}, {hi:.3g}] inside ±{margin:g}"
    return INCONCLUSIVE, (
        f"neither direction significant (p = {fmt_p(p_pred)}, reverse {fmt_p(p_opp)}) and the effect "
        f"interval [{lo:.3g}, {hi:.3g}] is not inside ±{margin:g}"
    )


def descriptive(verdict: str, reason: str, starts: int) -> tuple[str, str]:
    """(verdict, reason) where `starts` independent cold starts stand behind the runs compared (MIN_UNITS or
    more); else inconclusive, the reason saying why and what the seed-level reading would have been: runs that
    share a start share its weights, so seeds from one or two starts cannot carry a verdict."""
    why = descriptive_reason(starts)
    if why is None:
        return verdict, reason
    return INCONCLUSIVE, f"{why}; by seed pairs it reads: {verdict} ({reason})"


# a bracketed interval of a statistic's text, e.g. " [+0.9, +15.6]" or " [-1.2%, 2.5%]"
INTERVAL = re.compile(r" \[[-+]?[0-9.]+%?, [-+]?[0-9.]+%?\]")


def drop_intervals(c: Claim, starts: int) -> None:
    """Below MIN_UNITS starts a claim describes: its statistic and notes lose their bracketed intervals and its
    paragraph ends saying why (`descriptive_plain`). Nothing changes from MIN_UNITS starts up."""
    if descriptive_reason(starts) is None:
        return
    c.statistic = INTERVAL.sub("", c.statistic)
    c.notes = [INTERVAL.sub("", n) for n in c.notes]
    if c.plain:
        c.plain += " " + descriptive_plain(starts)


def descriptive_plain(starts: int) -> str:
    """The sentence a paragraph for a person ends with where its numbers rest on too few starts to decide."""
    return (
        f"Descriptive: {starts} independent start{'' if starts == 1 else 's'}; a verdict needs {MIN_UNITS} "
        "(runs from new cold starts, not more seeds)."
    )


def shares(verdicts: list[str]) -> str:
    counts = pd.Series(verdicts).value_counts()
    return ", ".join(f"{v} {100 * k / len(verdicts):.0f}%" for v, k in counts.items())


def set_robustness(c: Claim, verdicts: dict[str, str], counts: dict[str, str]) -> None:
    """Set the claim's verdict from its main-definition verdict and the grid: **fragile** where the grid disagrees."""
    c.robustness = verdicts
    kinds = sorted(set(verdicts.values()))
    size = len(verdicts)
    c.notes.insert(
        0,
        f"robustness over {size} collapse definitions (both definitions, drop fractions "
        f"{GRID_DROP_FRACS[0]}-{GRID_DROP_FRACS[-1]}, patience {GRID_PATIENCES[0]}-{GRID_PATIENCES[-1]}, "
        f"entropy floors {GRID_ENTROPY_FLOORS[0]}-{GRID_ENTROPY_FLOORS[-1]}): "
        f"{shares(list(verdicts.values()))}; the collapse counts alone (exact McNemar) would give "
        f"{shares(list(counts.values()))}",
    )
    if len(kinds) > 1:
        c.reason = f"{c.verdict} under the main definition, but the grid gives {' to '.join(kinds)}; main: {c.reason}"
        c.verdict = FRAGILE


def would_change(verdict: str) -> str:
    return {
        REPRODUCED: "a replication with new seeds in which the effect vanishes",
        NOT_REPRODUCED: "a replication that finds the claimed effect at p < 0.05 (for a measured size, an interval "
        "that reaches the claimed value), with every look at the data counted",
        FRAGILE: "a collapse definition agreed before the runs, or measured outcomes that decide without the label",
        INCONCLUSIVE: "more runs, until an interval excludes 0 or fits inside its margin",
        UNTESTABLE_HERE: "runs that hold the case the claim speaks of: for a stability claim, cells where the "
        "baseline degrades, found by a pilot scan (e.g. `engine_phase` for the engine model)",
    }.get(verdict, "more data")


def accuracy_points(d: float) -> str:
    return f"{abs(100 * d):.1f} accuracy points {'above' if d > 0 else 'below'}"
