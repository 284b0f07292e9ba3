"""Where an experiment's runs are (its folder, its metrics) and the cold start each run began from."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from moe_rl.analysis.load import load_results


def runs_folder(root: Path, experiment: str) -> Path:
    """Where an experiment's runs live: root/experiment/runs (shipped layout), else root/experiment
    (a Hydra sweep written straight into results_dir)."""
    shipped = root / experiment / "runs"
    return shipped if shipped.is_dir() else root / experiment


def load_experiment(root: Path, experiment: str, keys: list[str] | None) -> pd.DataFrame | None:
    folder = runs_folder(root, experiment)
    if not folder.is_dir() or not any(folder.rglob("metrics.parquet")):
        return None
    try:
        return load_results(folder, keys=keys)
    except FileNotFoundError:
        return None


def starts_of(outcomes: pd.DataFrame) -> pd.Series:
    """Per run of `outcomes`, the cold start it began from, within its model family (one family's start is never
    another's): `start` (`phase_outcomes`) where known, else its cold-start seed as `configs.run_starts` words it
    (`cold_seed=<n>`: a frame built by hand, or the mechanism ladder's, whose cold-start seed names the start of
    each model), else `cold_seed=0` for every run: nothing says they began apart."""
    seed = outcomes["cold_seed"] if "cold_seed" in outcomes else pd.Series(0, index=outcomes.index)
    start = "cold_seed=" + seed.fillna(0).astype(int).astype(str)
    if "start" in outcomes:
        start = outcomes["start"].fillna(start).astype(str)
    family = outcomes["family"].astype(str) + "/" if "family" in outcomes else ""
    return family + start
