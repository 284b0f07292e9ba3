"""Statistics that respect the cold start: runs nest in starts, and the start is the unit of replication.

Runs that share a cold start share its weights, its accuracy and its entropy, and their outcomes
correlate (intraclass correlations of 0.5-0.97 were measured on the shipped ladders). An interval
that resamples runs as if they were independent is too narrow by about sqrt(1 + (m - 1) ICC) for m
runs per start, and with two starts no test can pass p = 0.5 at the level of the start. So every
comparison that spans starts goes through the one routine here:

- `hierarchical_bootstrap`: resample starts with replacement, then runs (seeds) within each drawn
  start with replacement; the statistic is the mean over the drawn starts of their drawn runs'
  mean (each start weighs the same, as in a balanced design); a percentile interval.
- `cluster_sign_flip_pvalue`: paired differences, one sign per start (every run of a start flips
  together): the exact permutation test at the level of the start.
- `cluster_permutation_pvalue`: two groups of starts (e.g. two models, each with its own pool),
  the starts' means permuted between the groups.
- `start_draws` and `bootstrap`: the same two-stage scheme for any statistic of a table of runs (a crossing, a
  fitted exponent, a ratio of two rows), the draws shared by every row that has the same starts and seeds.
- `clustered_compare`: arm a vs arm b paired within (start, seed), all of the above in one row,
  with the number of starts and seeds behind it and, below `MIN_UNITS` starts, no interval or p at
  all: the row is descriptive and says why.

One seed (`SEED`) and one resample count (`N_RESAMPLES`) serve every page, so one quantity prints
one interval wherever it appears.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pandas as pd

MIN_UNITS = 5  # fewer independent starts than this: a number is descriptive, never an interval or a verdict
SEED = 0
N_RESAMPLES = 9999
EXACT_UP_TO = 14  # 2^14 sign patterns or label splits are enumerated; beyond, a seeded Monte Carlo sample
DESCRIPTIVE = "descriptive: {n} independent start{s} (an interval needs {m})"


def descriptive_reason(n_starts: int, min_units: int = MIN_UNITS) -> str | None:
    """None where `n_starts` independent starts can carry an interval; else the reason a table prints."""
    if n_starts >= min_units:
        return None
    return DESCRIPTIVE.format(n=n_starts, s="" if n_starts == 1 else "s", m=min_units)


def _groups(values: Sequence[float] | np.ndarray, clusters: Sequence[object] | np.ndarray) -> list[np.ndarray]:
    """The finite values of each cluster, clusters in order of first appearance; empty clusters dropped."""
    v = np.asarray(values, dtype=float)
    c = pd.Series(np.asarray(clusters, dtype=object))
    if len(v) != len(c):
        raise ValueError(f"values and clusters differ in length: {len(v)} vs {len(c)}")
    out = []
    for _, index in c.groupby(c, sort=False).groups.items():
        g = v[np.asarray(index)]
        g = g[np.isfinite(g)]
        if len(g):
            out.append(g)
    return out


def cluster_means(values: Sequence[float] | np.ndarray, clusters: Sequence[object] | np.ndarray) -> np.ndarray:
    """The mean of each cluster's finite values: the unit a cluster-level statistic works on."""
    return np.array([g.mean() for g in _groups(values, clusters)])


def hierarchical_bootstrap(
    values: Sequence[float] | np.ndarray,
    clusters: Sequence[object] | np.ndarray,
    *,
    confidence: float = 0.95,
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float, float]:
    """(estimate, low, high): the mean of cluster means, with a two-stage percentile bootstrap interval.

    Stage 1 draws C clusters with replacement from the C observed; stage 2 draws, within each drawn
    cluster, as many runs as it has, with replacement. NaN bounds below 2 clusters.
    """
    groups = _groups(values, clusters)
    if not groups:
        return math.nan, math.nan, math.nan
    estimate = float(np.mean([g.mean() for g in groups]))
    if len(groups) < 2:
        return estimate, math.nan, math.nan
    rng = np.random.default_rng(seed)
    C = len(groups)
    picks = rng.integers(0, C, (n_resamples, C))  # stage 1: (R, C) cluster draws
    # stage 2: a resampled mean of every cluster for every replicate, then the drawn clusters' average
    inner = np.empty((n_resamples, C))
    for j, g in enumerate(groups):
        inner[:, j] = g[rng.integers(0, len(g), (n_resamples, len(g)))].mean(1)
    boot = np.take_along_axis(inner, picks, axis=1).mean(1)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(boot, [alpha, 1 - alpha])
    return estimate, float(lo), float(hi)


def _sign_patterns(C: int, n_resamples: int, seed: int) -> np.ndarray:
    """(P, C) signs: all 2^C patterns when C <= EXACT_UP_TO, else the identity and a seeded sample."""
    if C <= EXACT_UP_TO:
        return np.array(list(itertools.product((1.0, -1.0), repeat=C)))
    rng = np.random.default_rng(seed)
    return np.vstack([np.ones(C), rng.choice((1.0, -1.0), (n_resamples, C))])


def cluster_sign_flip_pvalue(
    d: Sequence[float] | np.ndarray,
    clusters: Sequence[object] | np.ndarray,
    *,
    alternative: str = "two-sided",
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
) -> float:
    """p of "mean paired difference = 0" with one sign per cluster: all of a start's pairs flip together.

    The statistic is the mean of cluster means. With C clusters the smallest two-sided p is 2 / 2^C
    (C = 2: 0.5; C = 5: 0.0625; C = 6: 0.03125), which is why an interval needs `MIN_UNITS` starts.
    """
    if alternative not in ("two-sided", "greater", "less"):
        raise ValueError(f"alternative must be two-sided, greater or less, got {alternative!r}")
    m = cluster_means(d, clusters)
    if not len(m):
        return math.nan
    if np.all(m == 0):
        return 1.0
    signs = _sign_patterns(len(m), n_resamples, seed)
    null = (signs * m).mean(1)
    obs = m.mean()
    tol = 1e-12 * max(1.0, abs(obs))  # equal statistics from re-ordered sums count as ties
    if alternative == "greater":
        return float(np.mean(null >= obs - tol))
    if alternative == "less":
        return float(np.mean(null <= obs + tol))
    return float(np.mean(np.abs(null) >= abs(obs) - tol))


def cluster_permutation_pvalue(
    a: Sequence[float] | np.ndarray,
    clusters_a: Sequence[object] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    clusters_b: Sequence[object] | np.ndarray,
    *,
    n_resamples: int = N_RESAMPLES,
    seed: int = SEED,
) -> float:
    """Two-sided p of "group a's starts and group b's starts have the same mean": the difference of the
    groups' means of start means, the start means permuted between the groups (every split enumerated
    when C(n_a + n_b, n_a) <= 2^EXACT_UP_TO, else a seeded sample)."""
    ma, mb = cluster_means(a, clusters_a), cluster_means(b, clusters_b)
    if not len(ma) or not len(mb):
        return math.nan
    pooled = np.concatenate([ma, mb])
    n, k = len(pooled), len(ma)
    obs = ma.mean() - mb.mean()
    if math.comb(n, k) <= 2**EXACT_UP_TO:
        splits = np.zeros((math.comb(n, k), n), dtype=bool)
        for i, chosen in enumerate(itertools.combinations(range(n), k)):
            splits[i, list(chosen)] = True
    else:
        rng = np.random.default_rng(seed)
        splits = np.zeros((n_resamples + 1, n), dtype=bool)
        splits[0, :k] = True
        for i in range(1, n_resamples + 1):
            splits[i, rng.permutation(n)[:k]] = True
    sums = splits @ pooled
    null = sums / k - (pooled.sum() - sums) / (n - k)
    return float(np.mean(np.abs(null) >= abs(obs) - 1e-12 * max(1.0, abs(obs))))


def clustered_compare(
    frame: pd.DataFrame,
    *,
    arm_col: str,
    a: str,
    b: str,
    value: str,
    start_col: str = "start",
    seed_col: str = "seed",
    cluster_col: str | None = None,
    confidence: float = 0.95,
    min_units: int = MIN_UNITS,
) -> dict[str, object]:
    """Arm a vs arm b, paired within (start, seed): the mean of start means of the differences a - b. With
    `cluster_col` the pairs' cluster is that column (starts that are not independent of each other, e.g. one warm-up
    seed on two machines), not the start.

    Returns n_starts, n_seeds (pairs in all), mean_diff, lo, hi (hierarchical bootstrap), p_value
    (cluster sign flip), prob_improvement (share of start means above 0, a tie one half) and
    `descriptive`: None, or the reason there is no interval or p (fewer than `min_units` starts).
    """
    keys = [start_col, seed_col]
    cluster = cluster_col or start_col
    cols = list(dict.fromkeys([*keys, cluster]))
    left = frame.loc[frame[arm_col] == a, [*cols, value]].rename(columns={value: "a"})
    right = frame.loc[frame[arm_col] == b, [*keys, value]].rename(columns={value: "b"})
    for arm, side in ((a, left), (b, right)):
        if side.duplicated(keys).any():
            raise ValueError(f"arm {arm!r} has several runs per ({start_col}, {seed_col})")
    pairs = left.merge(right, on=keys, how="inner")
    out = paired_by_start(pairs["a"] - pairs["b"], pairs[cluster], confidence=confidence, min_units=min_units)
    out["n_seeds"] = out.pop("n_pairs")
    return out


def paired_by_start(
    d: Sequence[float] | np.ndarray | pd.Series,
    starts: Sequence[object] | np.ndarray | pd.Series,
    *,
    confidence: float = 0.95,
    min_units: int = MIN_UNITS,
) -> dict[str, object]:
    """Paired differences d = a - b, each labelled by its cold start: n_pairs and n_starts (finite d only),
    mean_diff (the mean of the starts' means), prob_improvement (share of start means above 0, a tie one
    half), `descriptive` (None, or why there is no interval or p: fewer than `min_units` starts), and where
    decided lo, hi (hierarchical bootstrap) and p_value (one sign per start); NaN where descriptive."""
    x, units = np.asarray(d, dtype=float), np.asarray(starts, dtype=object)
    keep = np.isfinite(x)
    x, units = x[keep], units[keep]
    means = cluster_means(x, units)
    reason = descriptive_reason(len(means), min_units)
    out: dict[str, object] = {"n_pairs": len(x), "n_starts": len(means), "descriptive": reason}
    out["mean_diff"] = float(means.mean()) if len(means) else math.nan
    out["prob_improvement"] = float(np.mean((means > 0) + 0.5 * (means == 0))) if len(means) else math.nan
    out["lo"] = out["hi"] = out["p_value"] = math.nan
    if reason is None:
        _, out["lo"], out["hi"] = hierarchical_bootstrap(x, units, confidence=confidence)
        out["p_value"] = cluster_sign_flip_pvalue(x, units)
    return out


def pair_keys(sides: Iterable[pd.DataFrame], on: Sequence[str], start_col: str = "start") -> list[str]:
    """The keys two arms' runs pair on: `on`, plus the cold start where a side has several runs per `on` (seeds
    repeated across starts), so that no pair joins the runs of two starts. Arms whose starts differ by design (a
    dense model against an MoE one) keep pairing on `on` alone, each pair labelled by both starts."""
    on = list(on)
    if any(start_col in side and side.duplicated(on).any() for side in sides):
        return [*on, start_col]
    return on


def starts_or_own(runs: pd.DataFrame, start_col: str = "start") -> pd.Series:
    """Each run's cold start as text: `start_col` where the table has it, else the run itself (each run its own
    start), indexed 0..n-1."""
    if start_col in runs:
        return runs[start_col].astype(str).reset_index(drop=True)
    return pd.Series(range(len(runs)), dtype=object).astype(str)


def intraclass_correlation(values: Sequence[float] | np.ndarray, clusters: Sequence[object] | np.ndarray) -> float:
    """ICC(1) from a one-way ANOVA: (MSB - MSW) / (MSB + (m0 - 1) MSW), m0 the size-adjusted mean cluster
    size; the share of the run-to-run variance that the start explains (0: starts do not matter)."""
    groups = _groups(values, clusters)
    C, N = len(groups), sum(len(g) for g in groups)
    if C < 2 or N <= C:
        return math.nan
    grand = np.concatenate(groups).mean()
    ssb = sum(len(g) * (g.mean() - grand) ** 2 for g in groups)
    ssw = sum(((g - g.mean()) ** 2).sum() for g in groups)
    msb, msw = ssb / (C - 1), ssw / (N - C)
    m0 = (N - sum(len(g) ** 2 for g in groups) / N) / (C - 1)
    denom = msb + (m0 - 1) * msw
    return float((msb - msw) / denom) if denom > 0 else math.nan


def start_draws(
    units: pd.DataFrame, n_resamples: int = N_RESAMPLES, seed: int = SEED
) -> list[list[tuple[object, object]]]:
    """Hierarchical resamples of (start, seed) units (`units`: columns start, seed): per replicate, starts drawn with
    replacement, then within each drawn start as many of its seeds as it has, with replacement. The same draws serve
    every row that shares the starts and seeds (a paired bootstrap)."""
    seeds = {s: sorted(set(g["seed"])) for s, g in units.groupby("start", sort=True)}
    starts = list(seeds)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_resamples):
        replicate = []
        for s in rng.choice(len(starts), len(starts)):
            own = seeds[starts[s]]
            replicate += [(starts[s], own[k]) for k in rng.integers(0, len(own), len(own))]
        draws.append(replicate)
    return draws


def replicate_values(
    runs: pd.DataFrame, statistic: Callable[[pd.DataFrame], float], draws: list[list[tuple[object, object]]]
) -> np.ndarray:
    """`statistic` on every drawn replicate: the runs (columns start, seed) of its drawn (start, seed) units,
    repeated as drawn; NaN for a replicate that holds none of them."""
    by_unit = {k: np.asarray(i) for k, i in runs.reset_index(drop=True).groupby(["start", "seed"]).indices.items()}
    values = []
    for replicate in draws:
        parts = [by_unit[u] for u in replicate if u in by_unit]
        values.append(float(statistic(runs.iloc[np.concatenate(parts)])) if parts else math.nan)
    return np.array(values, dtype=float)


def bootstrap(
    runs: pd.DataFrame,
    statistic: Callable[[pd.DataFrame], float],
    draws: list[list[tuple[object, object]]],
    confidence: float = 0.95,
) -> tuple[float, float, float, float]:
    """(estimate, low, high, share_nan): `statistic` of `runs` (columns start, seed) and its percentile interval over
    the drawn replicates (each the runs of its drawn (start, seed) units, repeated as drawn); infinite values
    (censored crossings) take part in the quantiles, NaN ones are dropped and their share returned."""
    estimate = float(statistic(runs))
    arr = replicate_values(runs, statistic, draws)
    finite = arr[~np.isnan(arr)]
    if len(finite) == 0:
        return estimate, math.nan, math.nan, 1.0
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(finite, [alpha, 1 - alpha], method="inverted_cdf")
    return estimate, float(lo), float(hi), float(1 - len(finite) / len(arr))
