"""The runs a claim reads (an experiment's folder, its per-run outcomes) and the cells it compares."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from moe_rl.analysis.collapse_definitions import COLLAPSE_DEFINITIONS, HISTORY_KEYS, definition_grid
from moe_rl.analysis.load import load_results
from moe_rl.analysis.phase import cell_label, run_outcomes


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


def phase_outcomes(root: Path, experiment: str, grid: bool = False) -> pd.DataFrame | None:
    """One row per run (`run_outcomes`); with `grid`, collapse under every definition of the declared grid too."""
    df = load_experiment(root, experiment, list(HISTORY_KEYS))
    if df is None:
        return None
    return run_outcomes(df, {**COLLAPSE_DEFINITIONS, **definition_grid()} if grid else None)


def cells_text(strata: list[tuple], cells: list[str]) -> str:
    names = [cell_label(cells, vals if isinstance(vals, tuple) else (vals,)) for vals, *_ in strata]
    return f"{len(names)} cell(s): " + "; ".join(names) if names else "no cells"


def grid_definitions(outcomes: pd.DataFrame) -> list[str]:
    """The grid points present in `outcomes` (columns collapsed_<name> of `definition_grid`)."""
    return [d for d in definition_grid() if f"collapsed_{d}" in outcomes]


def offpolicy_runs(outcomes: pd.DataFrame) -> pd.DataFrame:
    return outcomes[outcomes["N"] >= 2] if "N" in outcomes else outcomes.iloc[0:0]


def degrading_cells(outcomes: pd.DataFrame, arms: list[str], cells: list[str]) -> pd.DataFrame:
    """Runs of `arms` in the cells where those arms' mean `late_accuracy` (the mean of a run's last 3
    evaluations, `moe_rl.analysis.accuracy`) ends below their mean accuracy at step 0: a measured
    selection of where instability shows, no label needed."""
    sub = outcomes[outcomes["arm"].isin(arms)]
    return sub.groupby(cells).filter(lambda g: g["late_accuracy"].mean() < g["start_accuracy"].mean())


def cell_list(frame: pd.DataFrame, cells: list[str]) -> str:
    keys = frame[cells].drop_duplicates().sort_values(cells)
    return "; ".join(cell_label(cells, tuple(r)) for r in keys.itertuples(index=False)) or "none"


def phase_cells(outcomes: pd.DataFrame) -> list[str]:
    """The keys a phase-map cell is made of: lr and N, and the model family where runs of several are pooled
    (pairs never cross families: each has its own cold start)."""
    several = "family" in outcomes and outcomes["family"].nunique() > 1
    return [x for x in ("lr", "N") if x in outcomes] + (["family"] if several else [])
