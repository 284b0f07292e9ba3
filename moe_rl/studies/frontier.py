"""The stability frontier: where each arm stops being stable along learning rate and staleness.

Declared in `experiments/conf/preset/frontier.yaml` before its runs. A point (an arm at one value of an axis,
the other axis fixed) is stable when the mean accuracy change over its seeds (late accuracy, the mean of the last
3 evaluations, minus step 0) is >= -5 pp and at most a quarter of its runs collapsed. Points are probed by
bisection over the axis' grid (`python experiments/frontier.py`), 4 seeds each and 8 at the two points that
bracket an edge; the edge is the last stable point, bracketed by the first unstable one, and its 95% interval a
bootstrap over seeds (each probed point resampled and re-decided). Headroom is an arm's edge over grpo+none's on
the same axis, with the same bootstrap. An edge whose bisection has not finished reads "open", with what the
probed points bracket so far; a row's figure marks each probed point stable (green) or not (red).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.clustered import bootstrap, descriptive_reason, start_draws
from moe_rl.analysis.dose import crossing
from moe_rl.analysis.outcomes import finished_runs
from moe_rl.analysis.phase import reward_auc
from moe_rl.analysis.tables import variant_per_run
from moe_rl.metrics.names import OFFPOLICY_SUFFIX, RATIO_TOKEN_VAR, REWARD_MEAN, TASK_ACCURACY
from moe_rl.studies.declaration_keys import read_declaration
from moe_rl.studies.design import declaration

# folders whose runs of the same configs (but the experiment name) the frontier reads rather than reruns
SOURCES = ("frontier", "phase", "phase_edge", "phase_band", "stabilizers", "dense_control")
THRESHOLD = -0.05  # mean accuracy change at or above which a point is stable
MAX_COLLAPSED = 0.25  # share of a point's runs that may collapse at a stable point
DRAWS = 2000
REFERENCE = ("qwen3_moe", "grpo_none")
PRICE_POINT = {"lr": 1e-4, "N": 8}  # where grpo+none gains +10 pp in the phase map (the preset's `price`)


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


def load_frontier(presets: Path) -> Frontier:
    """The frontier's bisection, declared under `frontier` in its declaration beside the presets folder `presets`
    (experiments/conf/study/frontier.yaml)."""
    spec = read_declaration(declaration("frontier", presets))["frontier"]
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


def arm_file(run: str, default: str | None = None) -> str:
    """The arm file a run was launched with, read off its folder name (`arm=grpo_r2,cell=...`); `default` (the
    preset's own arm) for a run that names none, where given."""
    for part in run.split(","):
        if part.startswith("arm="):
            return part[len("arm=") :]
    if default is not None:
        return default
    raise ValueError(f"run {run!r} names no arm= override: the frontier cannot tell its arm")


def per_run(df: pd.DataFrame, default_arm: str | None = None) -> pd.DataFrame:
    """One row per finished run: family, arm file, lr, N, seed, cold start (`start`), accuracy change (late accuracy, the mean of the
    last 3 evaluations, minus step 0), collapse (the loop's own label), reward AUC and the off-policy token
    log-ratio variance."""
    out = finished_runs(df)
    out["arm_file"] = [arm_file(r, default_arm) for r in out["run"]]
    rew = df.loc[df["key"] == REWARD_MEAN, ["run", "step", "value"]]
    out["reward_auc"] = pd.Series(
        {r: reward_auc(x["step"].to_numpy(), x["value"].to_numpy()) for r, x in rew.groupby("run")}
    )
    out["token_ratio_var"] = variant_per_run(df, RATIO_TOKEN_VAR, "offpolicy")
    keep = ["run", "experiment", "family", "arm_file", "arm", "lr", "N", "seed", "start", "status", "start_accuracy"]
    return out[[*keep, "late_accuracy", "change", "collapsed", "reward_auc", "token_ratio_var"]].reset_index(drop=True)


# the metric keys `per_run` reads (loading only these keeps a few hundred runs quick)
KEYS = (TASK_ACCURACY, REWARD_MEAN, RATIO_TOKEN_VAR, RATIO_TOKEN_VAR + OFFPOLICY_SUFFIX)


def load_runs(roots: Iterable[Path]) -> pd.DataFrame:
    """`per_run` over every source folder found under the given roots (each holds `<source>/runs` or `<source>`).
    A run present in two folders (the same config under two names) is counted once, the first found."""
    from moe_rl import analysis

    frames = []
    for root in roots:
        for source in SOURCES:
            for folder in (Path(root) / source / "runs", Path(root) / source):
                if folder.is_dir() and any(folder.rglob("metrics.parquet")):
                    frames.append(per_run(analysis.load_results(folder, keys=KEYS)))
                    break
    if not frames:
        raise FileNotFoundError(f"no frontier runs under {[str(r) for r in roots]} (folders {SOURCES})")
    return combine(frames)


def combine(frames: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """`per_run` frames as one: a run present twice (the same config and cold start under two experiment names)
    counted once, the first found; runs of the same config from different cold starts are two runs."""
    runs = pd.concat(list(frames), ignore_index=True)
    return runs.drop_duplicates(["family", "arm_file", "lr", "N", "seed", "start"], keep="first").reset_index(drop=True)


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


def at_point(runs: pd.DataFrame, row: tuple[str, str], point: dict[str, float]) -> pd.DataFrame:
    """The runs of one row at one point ({"lr": ..., "N": ...})."""
    sel = (runs["family"] == row[0]) & (runs["arm_file"] == row[1])
    for key, value in point.items():
        sel &= np.isclose(runs[key].astype(float), float(value))
    return runs[sel]


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
            }
        )
    return pd.DataFrame(rows, columns=["index", "n", "seeds", "change", "collapsed", "stable"])


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


def first_rows(axis: Axis) -> list[tuple[str, str]]:
    """The rows an axis probes first, in its order (`arm` for the MoE model, `family:arm` for another)."""
    return [tuple(r.split(":", 1)) if ":" in r else (REFERENCE[0], r) for r in axis.rows_first]  # type: ignore[misc]


def _priority(fr: Frontier, a: int, row: tuple[str, str]) -> tuple[int, int, int]:
    """Rows an axis names first (axis by axis, in its order), then every row of an axis that names none, then the
    other rows (axis by axis, in declaration order)."""
    first = first_rows(fr.axes[a])
    if row in first:
        return 0, a, first.index(row)
    return (1 if not first else 2), a, fr.rows.index(row)


def next_jobs(runs: pd.DataFrame, fr: Frontier) -> list[dict]:
    """Every row's next probe on every axis, as jobs {family, arm, lr, N, seeds, axis}: the rows an axis names
    first, then every row of the axes that name none, then the rest (declaration order within each)."""
    pairs = sorted(((a, r) for a in range(len(fr.axes)) for r in fr.rows), key=lambda p: _priority(fr, *p))
    jobs = []
    for a, row in pairs:
        axis = fr.axes[a]
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
    return _unique(jobs + price_jobs(runs, fr))


def price_jobs(runs: pd.DataFrame, fr: Frontier) -> list[dict]:
    """Every row's missing probe seeds at the price point (lr 1e-4, N = 8, where every arm should learn): last in
    the queue, so they fill the slots the edges leave idle while they wait on running probes."""
    jobs = []
    for family, arm in fr.rows:
        have = set(at_point(runs, (family, arm), PRICE_POINT)["seed"].astype(int))
        missing = tuple(s for s in fr.seeds if s not in have)
        if missing:
            jobs.append({"family": family, "arm": arm, **PRICE_POINT, "seeds": missing, "axis": "price"})
    return jobs


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


def edge_index(axis_runs: pd.DataFrame, size: int) -> int:
    """The edge's grid index (-1: below the grid) from the probed points: the highest stable point below the
    lowest unstable one."""
    stable = {
        int(i): is_stable(g["change"].to_numpy(), g["collapsed"].to_numpy()) for i, g in axis_runs.groupby("index")
    }
    return bracket(stable, size)[0]


def edge_draws(axis_runs: pd.DataFrame, size: int, *, draws: int = DRAWS, seed: int = 0) -> np.ndarray:
    """`draws` bootstrap edges (grid indices): each probed point's seeds resampled with replacement, every point
    re-decided by the declared rule, the edge re-located as in `edge_index`."""
    rng = np.random.default_rng(seed)
    groups = list(axis_runs.groupby("index", sort=True))
    index = np.array([int(i) for i, _ in groups])
    stable = np.empty((draws, len(groups)), dtype=bool)
    for k, (_, g) in enumerate(groups):
        change, collapsed = g["change"].to_numpy(float), g["collapsed"].to_numpy(float)
        take = rng.integers(0, len(g), (draws, len(g)))
        stable[:, k] = (change[take].mean(axis=1) >= THRESHOLD) & (collapsed[take].mean(axis=1) <= MAX_COLLAPSED)
    hi = np.where(stable, size, index).min(axis=1, initial=size)
    return np.where(stable & (index < hi[:, None]), index, -1).max(axis=1, initial=-1)


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


@dataclass(frozen=True)
class Edge:
    """One row's edge on one axis: the point estimate (a grid index, -1 below the grid), whether the bisection
    has located it (adjacent bracket with every edge seed, or the grid's end), its bootstrap draws and points."""

    row: tuple[str, str]
    axis: Axis
    index: int
    located: bool
    draws: np.ndarray
    points: pd.DataFrame

    @property
    def label(self) -> str:
        """`2e-4 (< 2.5e-4)` once located; while the bisection is open, what the probed points bracket so far."""
        if not len(self.points):
            return "not probed"
        if self.located:
            return edge_label(self.axis, self.index, True)
        g, size = self.axis.grid, len(self.axis.grid)
        lo, hi = bracket({int(r["index"]): bool(r["stable"]) for _, r in self.points.iterrows()}, size)
        if lo < 0 and hi < size:
            return f"open: < {g[hi]:g}"
        if hi >= size:
            return f"open: >= {g[lo]:g}"
        return f"open: {g[lo]:g} to {g[hi]:g}"

    @property
    def interval(self) -> str:
        return interval_label(self.axis, self.draws) if len(self.points) and self.located else "—"


def edges(runs: pd.DataFrame, fr: Frontier, *, draws: int = DRAWS) -> dict[tuple[tuple[str, str], str], Edge]:
    """Every row's edge on every axis, keyed by (row, axis name); bootstrap seeds fixed per key."""
    out = {}
    for a, axis in enumerate(fr.axes):
        for r, row in enumerate(fr.rows):
            axis_runs = on_axis(runs, axis, row)
            size = len(axis.grid)
            pts = points(axis_runs)
            located = len(pts) > 0 and next_probe(axis, pts, fr) is None
            index = edge_index(axis_runs, size) if len(pts) else -1
            boot = edge_draws(axis_runs, size, draws=draws, seed=1000 * a + r) if len(pts) else np.array([])
            out[(row, axis.name)] = Edge(row, axis, index, located, boot, pts)
    return out


def edge_ratio(a: Edge, b: Edge) -> tuple[float, float, float]:
    """Edge of `a` over edge of `b` as axis values (headroom): point estimate and 95% bootstrap interval, the two
    rows' draws paired by draw index (they are independent resamples). An edge below or past the grid counts one
    grid step beyond it, so a ratio involving one is a bound."""
    if not len(a.draws) or not len(b.draws):
        return np.nan, np.nan, np.nan
    ratio = np.array([edge_value(a.axis, i) / edge_value(b.axis, j) for i, j in zip(a.draws, b.draws)])
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return edge_value(a.axis, a.index) / edge_value(b.axis, b.index), float(lo), float(hi)


def share_above(a: Edge, b: Edge, steps: int = 1) -> float:
    """The share of bootstrap draws in which `a`'s edge lies at least `steps` grid points above `b`'s."""
    if not len(a.draws) or not len(b.draws):
        return np.nan
    return float(np.mean(a.draws - b.draws >= steps))


def _crossing_on(runs: pd.DataFrame, key: str) -> float:
    return crossing(runs[key], runs["change"], THRESHOLD)


def interpolated_edges(runs: pd.DataFrame, fr: Frontier, *, draws: int = DRAWS) -> pd.DataFrame:
    """Per axis and row, the edge interpolated rather than read off the grid: where the isotonic (non-increasing) fit
    of accuracy change on the log of the axis value crosses -5 pp, log-linear between the two grid points around it
    (`dose.crossing`; the collapse share is not part of it). Its 95% interval is the hierarchical bootstrap (starts,
    then seeds within each: `clustered.start_draws`), one set of draws for every row of an axis, so rows that share
    starts and seeds are paired. Columns axis, family, arm_file, runs, starts, edge (inf past the last probed value,
    0 below the first), lo, hi (NaN below 5 starts), first and last (the probed values' range) and descriptive (why
    there is no interval)."""
    records = []
    for axis in fr.axes:
        on = [on_axis(runs, axis, row) for row in fr.rows]
        units = pd.concat(on)[["start", "seed"]] if any(len(o) for o in on) else pd.DataFrame()
        drawn = start_draws(units, n_resamples=draws) if len(units) else []
        for row, own in zip(fr.rows, on, strict=True):
            rec: dict[str, object] = {"axis": axis.name, "family": row[0], "arm_file": row[1], "runs": len(own)}
            rec["starts"] = int(own["start"].nunique()) if len(own) else 0
            rec["descriptive"] = descriptive_reason(int(rec["starts"])) or ""  # type: ignore[call-overload]
            rec["edge"] = rec["lo"] = rec["hi"] = np.nan
            rec["first"], rec["last"] = (own[axis.name].min(), own[axis.name].max()) if len(own) else (np.nan,) * 2
            if len(own):
                edge, lo, hi, _ = bootstrap(own, partial(_crossing_on, key=axis.name), drawn)
                rec["edge"] = edge
                if not rec["descriptive"]:
                    rec["lo"], rec["hi"] = lo, hi
            records.append(rec)
    return pd.DataFrame(records)
