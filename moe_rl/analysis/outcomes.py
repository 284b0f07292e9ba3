"""A finished run's outcome, defined once for every study: the run table (`load.runs`) of the runs that finished
(running, failed and missing ones left out), with their accuracy at step 0 and late in the run, the change between
them (the claims' outcome `change`), the loop's collapse label and the cold start each run replicates (`start`)."""

from __future__ import annotations

import pandas as pd

from moe_rl.analysis.accuracy import late_accuracy, start_accuracy
from moe_rl.analysis.configs import run_starts
from moe_rl.analysis.load import COLLAPSED_STATUSES, INCOMPLETE_STATUSES, runs


def finished_runs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per finished run of a `load_results` frame, indexed by run (column `run` kept): the run table plus
    `start_accuracy` (step 0), `late_accuracy` (the mean of the last 3 evaluations), `change` (late minus start),
    `collapsed` (a collapse event, or a collapsed status) and `start` (`configs.run_starts`: twins count once)."""
    out = runs(df).set_index("run", drop=False).rename_axis(None)
    out = out[~out["status"].isin(INCOMPLETE_STATUSES)].copy()
    out["start_accuracy"] = start_accuracy(df)
    out["late_accuracy"] = late_accuracy(df)
    out["change"] = out["late_accuracy"] - out["start_accuracy"]
    out["collapsed"] = (out["n_collapse_events"] > 0) | out["status"].isin(COLLAPSED_STATUSES)
    out["start"] = run_starts(df[df["run"].isin(out.index)])
    return out
