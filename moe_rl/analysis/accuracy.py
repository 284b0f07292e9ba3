"""A run's accuracy as one number: the one definition of each name, used by every report.

- `start_accuracy`: the first evaluation (step 0, the cold start's accuracy);
- `final_accuracy`: the last evaluation;
- `late_accuracy`: the mean of the last LATE_EVALS (3) evaluations: final accuracy as a measurement
  (one evaluation has ~4 pp of sampling noise). Every claim and table of CLAIMS.md reads this one as
  "final accuracy" (`moe_rl.analysis.claims.rules.ACCURACY`).

Each takes a `load_results` frame and returns a Series indexed by run.
"""

from __future__ import annotations

import pandas as pd
from pandas.core.groupby import SeriesGroupBy

from moe_rl.metrics.names import TASK_ACCURACY

LATE_EVALS = 3


def evaluations(df: pd.DataFrame) -> SeriesGroupBy:
    """Each run's `task/accuracy` evaluations in step order, grouped by run."""
    acc = df.loc[df["key"] == TASK_ACCURACY, ["run", "step", "value"]].dropna().sort_values("step")
    return acc.groupby("run")["value"]


def start_accuracy(df: pd.DataFrame) -> pd.Series:
    """The first evaluation per run (step 0: the cold start's accuracy)."""
    return evaluations(df).first()


def final_accuracy(df: pd.DataFrame) -> pd.Series:
    """The last evaluation per run."""
    return evaluations(df).last()


def late_accuracy(df: pd.DataFrame, evals: int = LATE_EVALS) -> pd.Series:
    """The mean of the last `evals` evaluations per run (fewer where a run has fewer)."""
    return evaluations(df).apply(lambda v: v.iloc[-evals:].mean())
