"""The runs a claim reads (an experiment's folder, its per-run outcomes) and the cells it compares."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from moe_rl.analysis.claims.rules import ACCURACY
from moe_rl.analysis.collapse_definitions import COLLAPSE_DEFINITIONS, HISTORY_KEYS, MAIN_DEFINITION, definition_grid
from moe_rl.analysis.configs import run_starts
from moe_rl.analysis.load import load_results
from moe_rl.analysis.phase import cell_label, run_outcomes
from moe_rl.metrics.names import REWARD_MEAN

START_STEPS = COLLAPSE_DEFINITIONS[MAIN_DEFINITION]["baseline_window"]  # a run's start reward: its first steps


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
    """One row per run (`run_outcomes`); with `grid`, collapse under every definition of the declared grid too.
    `start_reward` is a run's mean reward over its first START_STEPS steps: a claim that compares models with
    cold starts of their own measures reward from there. `start` is the cold start a run began from
    (`configs.run_starts`): a claim counts those, not its runs."""
    df = load_experiment(root, experiment, list(HISTORY_KEYS))
    if df is None:
        return None
    out = run_outcomes(df, {**COLLAPSE_DEFINITIONS, **definition_grid()} if grid else None)
    rewards = df.loc[df["key"] == REWARD_MEAN, ["run", "step", "value"]].sort_values("step")
    start = rewards.groupby("run")["value"].apply(lambda v: v.iloc[:START_STEPS].mean())
    return out.assign(start_reward=out["run"].map(start).to_numpy(float), start=out["run"].map(run_starts(df)))


def grid_definitions(outcomes: pd.DataFrame) -> list[str]:
    """The grid points present in `outcomes` (columns collapsed_<name> of `definition_grid`)."""
    return [d for d in definition_grid() if f"collapsed_{d}" in outcomes]


def all_runs(outcomes: pd.DataFrame) -> pd.DataFrame:
    """Every run counts."""
    return outcomes


def offpolicy_runs(outcomes: pd.DataFrame) -> pd.DataFrame:
    """The off-policy runs: N >= 2 updates per rollout."""
    return outcomes[outcomes["N"] >= 2] if "N" in outcomes else outcomes.iloc[0:0]


def low_precision_large_n(outcomes: pd.DataFrame) -> pd.DataFrame:
    """Runs whose rollouts were sampled in a lower precision than training (`rollout_dtype` other than float32)
    at the largest N: N >= 4 where such runs exist, else the largest N there is."""
    sub = outcomes
    if "rollout_dtype" in sub:
        sub = sub[sub["rollout_dtype"] != "float32"]
    if "N" in sub and len(sub):
        big = sub["N"] >= 4
        sub = sub[big] if big.any() else sub[sub["N"] == sub["N"].max()]
    return sub


def degrading_cells(outcomes: pd.DataFrame, arms: list[str], cells: list[str]) -> pd.DataFrame:
    """Runs of `arms` in the cells where those arms' mean final accuracy (ACCURACY, the mean of a run's last
    evaluations) ends below their mean accuracy at step 0: a measured selection of where instability shows,
    no label needed."""
    sub = outcomes[outcomes["arm"].isin(arms)]
    return sub.groupby(cells).filter(lambda g: g[ACCURACY].mean() < g["start_accuracy"].mean())


def runs_in_cells(outcomes: pd.DataFrame, arms: list[str], cells: list[str]) -> pd.DataFrame:
    """Every run of `outcomes` (all arms, in their order) in the cells `degrading_cells` selects for `arms`."""
    keep = degrading_cells(outcomes, arms, cells)[cells].drop_duplicates()
    if keep.empty:
        return outcomes.iloc[0:0]
    return outcomes[pd.MultiIndex.from_frame(outcomes[cells]).isin(pd.MultiIndex.from_frame(keep))]


def cell_list(frame: pd.DataFrame, cells: list[str]) -> str:
    """The cells of `frame`, sorted, as "lr=0.0003, N=8; ..."."""
    keys = frame[cells].drop_duplicates().sort_values(cells)
    return "; ".join(cell_label(cells, tuple(r)) for r in keys.itertuples(index=False)) or "none"


def phase_cells(outcomes: pd.DataFrame) -> list[str]:
    """The keys a phase-map cell is made of: lr and N, and the model family where runs of several are pooled
    (pairs never cross families: each has its own cold start)."""
    several = "family" in outcomes and outcomes["family"].nunique() > 1
    return [x for x in ("lr", "N") if x in outcomes] + (["family"] if several else [])


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


def independent_starts(runs: pd.DataFrame, arms: tuple[str, ...]) -> int:
    """The independent cold starts behind a comparison of `arms` (in `arm`) on `runs`, the unit of replication
    (`moe_rl.analysis.clustered`): the fewest distinct starts the runs of any one arm began from. Arms with
    starts of their own pair start with start, so their pairs rest on no more starts than either arm has."""
    starts = starts_of(runs)
    return min(int(starts[runs["arm"] == arm].nunique()) for arm in arms)


LADDER_SEED_STRIDE = 1000  # a ladder run's pairing seed: cold-start seed x stride + seed


def ladder_pairs(outcomes: pd.DataFrame, rungs: tuple[str, ...] = ()) -> pd.DataFrame:
    """A mechanism ladder's runs (those with a `rung`; of `rungs` where given), paired by cold-start seed and
    seed: the two fold into the pairing `seed` (each rung trains its own cold start per cold-start seed).
    Runs without a rung (another experiment's) pass unchanged."""
    if "rung" not in outcomes or outcomes["rung"].isna().all():
        return outcomes
    out = outcomes[outcomes["rung"].isin(rungs)] if rungs else outcomes[outcomes["rung"].notna()]
    return out.assign(seed=out["cold_seed"].astype(int) * LADDER_SEED_STRIDE + out["seed"].astype(int))
