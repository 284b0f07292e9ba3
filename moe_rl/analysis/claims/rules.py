"""The verdict labels and margins, the Claim row, and the rules and wording every claim shares."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from moe_rl.analysis.accuracy import LATE_EVALS
from moe_rl.analysis.clustered import MIN_UNITS, descriptive_reason

# verdicts
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
UNTESTABLE_HERE = "untestable here"  # the runs hold no case the claim speaks of (none yet, or nothing degrades)

# significance and the margins too small to matter
ALPHA = 0.05
LEAD_MARGIN = 0.01  # share of the clip fraction's next-step variance too small to matter
N_BOOT = 4999

# A run's final accuracy, in every claim and table of CLAIMS.md: `late_accuracy`, the mean of its last LATE_EVALS
# evaluations (`moe_rl.analysis.accuracy`; one evaluation alone carries ~4 points of sampling noise). The one
# definition the claims read, and its words on the page.
ACCURACY = "late_accuracy"
ACCURACY_DEFINITION = f"the mean of a run's last {LATE_EVALS} evaluations"


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
    repeated_p: bool = False  # p_value is a declared study's repeated p-value: it joins Holm across the claims
    read_on: str = ""  # the model the verdict was read on and routing's share of the ratio variance there
    divergence: str = ""  # the realised divergence ratio of the cells it compares, with its interval
    secondary: str = ""  # the mission's outcomes of the same contrast, paired over starts
    on_rung: str = ""  # its reading on the routing-dominant rung (a study whose CLAIMS.md section names a rung)
    looked: str = "at the level they were read"  # how a later look's notes name this reading


def pct(x: float) -> str:
    return "—" if not np.isfinite(x) else f"{100 * x:.1f}%"


def fmt_p(p: float) -> str:
    return "—" if not np.isfinite(p) else f"{p:.3g}"


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


def would_change(verdict: str) -> str:
    return {
        REPRODUCED: "a replication with new seeds in which the effect vanishes",
        NOT_REPRODUCED: "a replication that finds the claimed effect at p < 0.05 (for a measured size, an interval "
        "that reaches the claimed value), with every look at the data counted",
        INCONCLUSIVE: "more runs, until an interval excludes 0 or fits inside its margin",
        UNTESTABLE_HERE: "runs that hold the case the claim speaks of: for a stability claim, cells where the "
        "baseline degrades, found by a pilot scan (e.g. `engine_phase` for the engine model)",
    }.get(verdict, "more data")
