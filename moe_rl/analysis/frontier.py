"""The stability frontier: where each arm stops being stable along learning rate and staleness.

Declared in `experiments/conf/preset/frontier.yaml` before its runs. A point (an arm at one value of an axis,
the other axis fixed) is stable when the mean accuracy change over its seeds (late accuracy minus step 0) is
>= -5 pp and at most a quarter of its runs collapsed. Points are probed by bisection over the axis' grid
(`next_jobs`, which `experiments/frontier.py` runs round by round); the edge is the last stable point, bracketed
by the first unstable one, and its interval a bootstrap over seeds (`edge_draws`). Pure pandas and numpy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from moe_rl.analysis.load import INCOMPLETE_STATUSES
from moe_rl.analysis.phase import run_outcomes
from moe_rl.analysis.tables import variant_per_run
from moe_rl.metrics.names import RATIO_TOKEN_VAR

PRESET = Path(__file__).resolve().parents[2] / "experiments" / "conf" / "preset" / "frontier.yaml"
# folders whose runs of the same configs (but the experiment name) the frontier reads rather than reruns
SOURCES = ("frontier", "phase", "phase_edge", "phase_band", "stabilizers", "dense_control")
THRESHOLD = -0.05  # mean accuracy change at or above which a point is stable
MAX_COLLAPSED = 0.25  # share of a point's runs that may collapse at a stable point
DRAWS = 2000
REFERENCE = ("qwen3_moe", "grpo_none")


@dataclass(frozen=True)
class Axis:
    name: str  # the run key that varies: "lr" or "N"
    fixed: dict[str, float]  # the other run key, held
    grid: tuple[float, ...]
    start: float  # the first probe of a row with no point yet
    rows_first: tuple[str, ...] = ()  # arms probed before the others (claims' arms)


@dataclass(frozen=True)
class Frontier:
    rows: tuple[tuple[str, str], ...]  # (model family, arm file)
    axes: tuple[Axis, ...]
    seeds: tuple[int, ...]
    edge_seeds: tuple[int, ...]

    def axis(self, name: str) -> Axis:
        return next(a for a in self.axes if a.name == name)


def load_frontier(path: Path = PRESET) -> Frontier:
    """The frontier declared in the preset's `analysis.frontier`."""
    spec = yaml.safe_load(Path(path).read_text())["analysis"]["frontier"]
    axes = tuple(
        Axis(
            name=name,
            fixed=dict(a["fixed"]),
            grid=tuple(float(v) for v in a["grid"]),
            start=float(a["start"]),
            rows_first=tuple(a.get("rows_first", ())),
        )
        for name, a in spec["axes"].items()
    )
    for a in axes:
        if a.start not in a.grid:
            raise ValueError(f"axis {a.name}: start {a.start:g} is not a grid point {list(a.grid)}")
    return Frontier(
        rows=tuple((str(f), str(a)) for f, a in spec["rows"]),
        axes=axes,
        seeds=tuple(spec["seeds"]),
        edge_seeds=tuple(spec["edge_seeds"]),
    )


def arm_file(run: str) -> str:
    """The arm file a run was launched with, read off its folder name (`arm=grpo_r2,cell=...`)."""
    for part in run.split(","):
        if part.startswith("arm="):
            return part[len("arm=") :]
    raise ValueError(f"run {run!r} names no arm= override: the frontier cannot tell its arm")


def per_run(df: pd.DataFrame) -> pd.DataFrame:
    """One row per finished run: family, arm file, lr, N, seed, accuracy change, collapse, reward AUC and the
    off-policy token log-ratio variance."""
    out = run_outcomes(df)
    out = out[~out["status"].isin(INCOMPLETE_STATUSES)].copy()
    out["arm_file"] = [arm_file(r) for r in out["run"]]
    out["change"] = out["late_accuracy"] - out["start_accuracy"]
    out["collapsed"] = out["collapsed_in_loop"].astype(bool)
    var = variant_per_run(df, RATIO_TOKEN_VAR, "offpolicy")
    out["token_ratio_var"] = out["run"].map(var)
    keep = ["run", "experiment", "family", "arm_file", "arm", "lr", "N", "seed", "status", "start_accuracy"]
    return out[[*keep, "late_accuracy", "change", "collapsed", "reward_auc", "token_ratio_var"]].reset_index(drop=True)


def load_runs(roots: Iterable[Path]) -> pd.DataFrame:
    """`per_run` over every source folder found under the given roots (each holds `<source>/runs` or `<source>`).
    A run present in two folders (the same config under two names) is counted once, the first found."""
    from moe_rl import analysis

    frames = []
    for root in roots:
        for source in SOURCES:
            for folder in (Path(root) / source / "runs", Path(root) / source):
                if folder.is_dir() and any(folder.rglob("metrics.parquet")):
                    frames.append(per_run(analysis.load_results(folder)))
                    break
    if not frames:
        raise FileNotFoundError(f"no frontier runs under {[str(r) for r in roots]} (folders {SOURCES})")
    runs = pd.concat(frames, ignore_index=True)
    return runs.drop_duplicates(["family", "arm_file", "lr", "N", "seed"], keep="first").reset_index(drop=True)


def on_axis(runs: pd.DataFrame, axis: Axis, row: tuple[str, str]) -> pd.DataFrame:
    """The runs of one row on one axis (the other key at its fixed value, the varying one on the grid)."""
    family, arm = row
    sel = (runs["family"] == family) & (runs["arm_file"] == arm)
    for key, value in axis.fixed.items():
        sel &= np.isclose(runs[key].astype(float), float(value))
    sel &= runs[axis.name].astype(float).apply(lambda v: any(np.isclose(v, g) for g in axis.grid))
    out = runs[sel].copy()
    out["index"] = [int(np.argmin([abs(v - g) for g in axis.grid])) for v in out[axis.name].astype(float)]
    return out


def is_stable(change: np.ndarray, collapsed: np.ndarray) -> bool:
    """The declared rule at one point: mean accuracy change >= -5 pp and at most a quarter collapsed."""
    return bool(np.mean(change) >= THRESHOLD and np.mean(collapsed) <= MAX_COLLAPSED)


def points(axis_runs: pd.DataFrame) -> pd.DataFrame:
    """Per probed grid index: n, seeds, mean change, collapsed share, stable."""
    rows = []
    for index, g in axis_runs.groupby("index", sort=True):
        change, collapsed = g["change"].to_numpy(), g["collapsed"].to_numpy()
        rows.append(
            {
                "index": int(index),
                "n": len(g),
                "seeds": frozenset(int(s) for s in g["seed"]),
                "change": float(change.mean()),
                "collapsed": float(collapsed.mean()),
                "stable": is_stable(change, collapsed),
                "token_ratio_var": float(g["token_ratio_var"].mean()),
                "reward_auc": float(g["reward_auc"].mean()),
            }
        )
    return pd.DataFrame(
        rows, columns=["index", "n", "seeds", "change", "collapsed", "stable", "token_ratio_var", "reward_auc"]
    )


def bracket(stable: dict[int, bool], size: int) -> tuple[int, int]:
    """(lo, hi): hi the lowest unstable probed index (`size` if none), lo the highest stable one below it (-1)."""
    hi = min((i for i, s in stable.items() if not s), default=size)
    lo = max((i for i, s in stable.items() if s and i < hi), default=-1)
    return lo, hi


def next_probe(axis: Axis, pts: pd.DataFrame, fr: Frontier) -> tuple[int, tuple[int, ...]] | None:
    """The next (grid index, seeds to add) of one row on one axis, None when its edge is located: a bracket of
    adjacent points (or the grid's end) with every edge seed at both. A point with fewer than the probe seeds
    (an interrupted probe) is completed first; a row with no point starts at `axis.start`."""
    size = len(axis.grid)
    have = {int(r["index"]): r["seeds"] for _, r in pts.iterrows()}
    partial = [i for i, s in sorted(have.items()) if not set(fr.seeds) <= s]
    if partial or not have:
        index = partial[0] if partial else axis.grid.index(axis.start)
        return index, tuple(s for s in fr.seeds if s not in have.get(index, frozenset()))
    lo, hi = bracket({int(r["index"]): bool(r["stable"]) for _, r in pts.iterrows()}, size)
    if hi - lo > 1:
        index = (lo + hi) // 2  # strictly between: -1 and `size` stand for the grid's two open ends
        return index, tuple(fr.seeds)
    for index in (lo, hi):
        if 0 <= index < size:
            missing = tuple(s for s in fr.edge_seeds if s not in have.get(index, frozenset()))
            if missing:
                return index, missing
    return None


def _priority(axis: Axis, row: tuple[str, str]) -> int:
    """0: a row the axis names first; 1: any row of an axis that names none; 2: the other rows."""
    if not axis.rows_first:
        return 1
    return 0 if row[0] == REFERENCE[0] and row[1] in axis.rows_first else 2


def next_jobs(runs: pd.DataFrame, fr: Frontier) -> list[dict]:
    """Every row's next probe on every axis, as jobs {family, arm, lr, N, seeds, axis}: the rows an axis names
    first, then every row of the axes that name none, then the rest (declaration order within each)."""
    pairs = sorted(((a, r) for a in fr.axes for r in fr.rows), key=lambda p: _priority(*p))
    jobs = []
    for axis, row in pairs:
        probe = next_probe(axis, points(on_axis(runs, axis, row)), fr)
        if probe is None:
            continue
        index, seeds = probe
        point = {**{k: float(v) for k, v in axis.fixed.items()}, axis.name: axis.grid[index]}
        jobs.append(
            {
                "family": row[0],
                "arm": row[1],
                "lr": point["lr"],
                "N": int(point["N"]),
                "seeds": seeds,
                "axis": axis.name,
            }
        )
    return _unique(jobs)


def _unique(jobs: list[dict]) -> list[dict]:
    """One job per (row, point): the shared point (lr 3e-4, N = 8) can be both axes' next probe."""
    seen: dict[tuple, dict] = {}
    for job in jobs:
        key = (job["family"], job["arm"], job["lr"], job["N"])
        if key in seen:
            seen[key]["seeds"] = tuple(sorted(set(seen[key]["seeds"]) | set(job["seeds"])))
        else:
            seen[key] = dict(job)
    return list(seen.values())


def edge_index(axis_runs: pd.DataFrame, size: int, rng: np.random.Generator | None = None) -> int:
    """The edge's grid index (-1: below the grid) from the probed points, each resampled over its seeds when
    `rng` is given: the highest stable point below the lowest unstable one."""
    stable = {}
    for index, g in axis_runs.groupby("index", sort=True):
        take = rng.integers(0, len(g), len(g)) if rng is not None else np.arange(len(g))
        stable[int(index)] = is_stable(g["change"].to_numpy()[take], g["collapsed"].to_numpy()[take])
    return bracket(stable, size)[0]


def edge_draws(axis_runs: pd.DataFrame, size: int, *, draws: int = DRAWS, seed: int = 0) -> np.ndarray:
    """`draws` bootstrap edges (grid indices), each point's seeds resampled with replacement."""
    rng = np.random.default_rng(seed)
    return np.array([edge_index(axis_runs, size, rng) for _ in range(draws)])


def edge_value(axis: Axis, index: float) -> float:
    """A grid index as an axis value; one grid step below the grid for -1, one past it for len(grid)."""
    g = axis.grid
    if index < 0:
        return g[0] * g[0] / g[1]
    if index >= len(g):
        return g[-1] * g[-1] / g[-2]
    return g[int(index)]


def edge_label(axis: Axis, index: int, located: bool) -> str:
    """`3e-4 (< 4e-4)`: the last stable point and the first unstable one."""
    g = axis.grid
    if not located:
        return "not located"
    if index < 0:
        return f"< {g[0]:g}"
    if index >= len(g) - 1:
        return f">= {g[-1]:g}"
    return f"{g[index]:g} (< {g[index + 1]:g})"


def interval_label(axis: Axis, draws: np.ndarray) -> str:
    lo, hi = np.percentile(draws, [2.5, 97.5], method="nearest")
    return f"[{edge_label(axis, int(lo), True).split(' (')[0]}, {edge_label(axis, int(hi), True).split(' (')[0]}]"


def seed_list(seeds: Sequence[int]) -> str:
    return ",".join(str(s) for s in seeds)
