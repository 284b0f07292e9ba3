"""Statistics for comparisons across seeds and arms (docs/design.md §7). Pure functions over arrays.

- collapse counts "k of n": `wilson_interval`; two arms: `collapse_test` (Boschloo's exact test
  by default, Fisher's on request);
- many tests in one report: `holm`; paired values: `pair_by`, `prob_improvement`;
- survival: `kaplan_meier`; time series: `lagged_xcorr`, `event_aligned` and the Granger lead
  (`granger_surrogate_test`).

Where a well-kept library has the same test, it computes it: statsmodels for the Wilson interval
(`proportion_confint`); scipy for Fisher and Boschloo. What stays hand-written (Holm, Kaplan-Meier, the Granger
lead) says why in its docstring, and the tests check it against a library where one has the same numbers.

Why Boschloo rather than Fisher for two arms: seeds per arm are fixed by the design (two independent
binomial samples), not the total number of collapses, so the conditional Fisher test is needlessly
conservative; Boschloo's unconditional test uses Fisher's p-value as its statistic and is uniformly
more powerful (6 of 8 vs 0 of 8: one-sided p = 0.0011 vs Fisher's 0.0035).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats
from statsmodels.stats.proportion import proportion_confint

from moe_rl.analysis.clustered import (
    hierarchical_bootstrap,
)

ALTERNATIVES = ("two-sided", "greater", "less")


def _check_alternative(alternative: str) -> None:
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative={alternative!r} is not valid; valid: {list(ALTERNATIVES)}")


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion k/n (statsmodels' `proportion_confint(method="wilson")`);
    (nan, nan) when n == 0.

    Unlike the Wald interval it stays inside [0, 1] and is not degenerate at 0 of n, which is the
    common case for collapse counts. At 0 of n and n of n one bound is exactly p, set here so that
    rounding never puts it on the wrong side of p.
    """
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return math.nan, math.nan
    lo, hi = proportion_confint(k, n, alpha=1 - confidence, method="wilson")
    return (0.0 if k == 0 else float(lo)), (1.0 if k == n else float(hi))


def collapse_test(
    k1: int, n1: int, k2: int, n2: int, *, alternative: str = "two-sided", method: str = "boschloo"
) -> float:
    """p-value for "arm 1 collapses at another rate than arm 2" from k1 of n1 vs k2 of n2.

    `alternative="greater"`: arm 1 collapses more often. `method`: "boschloo" (default, see the
    module docstring) or "fisher". NaN when either arm has no runs.
    """
    _check_alternative(alternative)
    if n1 == 0 or n2 == 0:
        return math.nan
    if not (0 <= k1 <= n1 and 0 <= k2 <= n2):
        raise ValueError(f"need 0 <= k <= n, got {k1} of {n1} and {k2} of {n2}")
    if method == "fisher":
        return float(stats.fisher_exact([[k1, n1 - k1], [k2, n2 - k2]], alternative=alternative).pvalue)
    if method == "boschloo":
        if k1 + k2 in (0, n1 + n2):  # no information: every run the same
            return 1.0
        # columns are the two binomial samples (scipy's convention)
        return float(stats.boschloo_exact([[k1, k2], [n1 - k1, n2 - k2]], alternative=alternative).pvalue)
    raise ValueError(f"method={method!r} is not valid; valid: ['boschloo', 'fisher']")


def holm(p_values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm step-down adjusted p-values (family-wise error control); NaN entries stay NaN and do not count.

    Sorted ascending, p_(i) becomes max_{j <= i} min(1, (m - j + 1) p_(j)): the values of statsmodels'
    `multipletests(method="holm")` (the tests check it), computed here because `multipletests` runs
    `gc.collect()` on every call, a quarter of a second in a report process that holds the run
    frames, and the claims page adjusts thousands of small families.
    """
    p = np.asarray(p_values, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    m = len(ok)
    if not m:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    scaled = (m - np.arange(m)) * p[order]
    out[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
    return out


def prob_improvement(d: Sequence[float] | np.ndarray) -> float:
    """P(a > b) from the paired differences d = a - b: the share of pairs where a is higher, a tie counting
    one half (the A statistic, or common-language effect size, of paired data); 0.5 is no effect."""
    x = np.asarray(d, dtype=float)
    return float(np.mean((x > 0) + 0.5 * (x == 0))) if len(x) else math.nan


def pair_by(
    frame: pd.DataFrame, *, arm_col: str, a: str, b: str, value: str, on: Sequence[str] = ("seed",)
) -> pd.DataFrame:
    """Rows of arms `a` and `b` joined on the pairing keys `on`: columns [*on, "a", "b"].

    Keys present in only one arm are dropped (an unpaired run says nothing about the difference).
    """
    on = list(on)
    left = frame.loc[frame[arm_col] == a, [*on, value]].rename(columns={value: "a"})
    right = frame.loc[frame[arm_col] == b, [*on, value]].rename(columns={value: "b"})
    for name, side in (("a", left), ("b", right)):
        if side.duplicated(on).any():
            raise ValueError(f"arm {a if name == 'a' else b!r} has several runs per {on}; pair on more keys")
    return left.merge(right, on=on, how="inner").sort_values(on, ignore_index=True)


def lagged_xcorr(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray, max_lag: int) -> pd.DataFrame:
    """Pearson correlation of x[t] with y[t + lag] for lag in -max_lag..max_lag (positive lag: x leads y).

    Pairs with a NaN in either series are dropped; r is NaN with fewer than 3 pairs or a constant side.
    Columns: lag, r, n.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-d of one length, got {x.shape} and {y.shape}")
    if max_lag < 0:
        raise ValueError(f"max_lag={max_lag} must be >= 0")
    rows = []
    T = len(x)
    for lag in range(-max_lag, max_lag + 1):
        if lag >= 0:
            xs, ys = x[: max(T - lag, 0)], y[lag:]
        else:
            xs, ys = x[-lag:], y[: T + lag]
        keep = np.isfinite(xs) & np.isfinite(ys)
        xs, ys = xs[keep], ys[keep]
        r = math.nan
        if len(xs) >= 3 and np.ptp(xs) > 0 and np.ptp(ys) > 0:
            r = float(np.corrcoef(xs, ys)[0, 1])
        rows.append({"lag": lag, "r": r, "n": len(xs)})
    return pd.DataFrame(rows)


def event_aligned(values: pd.DataFrame, events: pd.DataFrame, *, before: int, after: int) -> pd.DataFrame:
    """Metric values around events: one row per (event, offset) with offset = step - event step.

    `values`: columns run, step, value (one metric). `events`: columns run, step. Offsets run from
    -before to +after; steps a run did not log are absent. Returns columns event, run, offset,
    value; average with `event_aligned_mean`.
    """
    rows = []
    by_run = {r: g.set_index("step")["value"] for r, g in values.groupby("run")}
    for i, (run, step) in enumerate(events[["run", "step"]].itertuples(index=False)):
        series = by_run.get(run)
        if series is None or pd.isna(step):
            continue
        window = series.loc[(series.index >= step - before) & (series.index <= step + after)]
        rows += [{"event": i, "run": run, "offset": int(s - step), "value": float(v)} for s, v in window.items()]
    return pd.DataFrame(rows, columns=["event", "run", "offset", "value"])


def event_aligned_mean(values: pd.DataFrame, events: pd.DataFrame, *, before: int, after: int) -> pd.DataFrame:
    """Mean over events of the metric at each offset from the event: columns offset, mean, sem, n."""
    aligned = event_aligned(values, events, before=before, after=after)
    g = aligned.groupby("offset")["value"]
    out = pd.DataFrame({"mean": g.mean(), "sem": g.sem(), "n": g.count()}).reindex(range(-before, after + 1))
    out["n"] = out["n"].fillna(0).astype(int)
    return out.rename_axis("offset").reset_index()


# --- survival, paired counts, agreement --------------------------------------------------------------


def kaplan_meier(time: Sequence[float] | np.ndarray, event: Sequence[bool] | np.ndarray) -> pd.DataFrame:
    """Kaplan-Meier survival S(t) = prod over event times s <= t of (1 - d_s / n_s).

    `time`: step of the event, or of the last observation for a censored run; `event`: True where
    the run collapsed at `time`. Returns one row per distinct event time: time, at_risk (n_s),
    events (d_s), survival (S just after that time). A run censored at t counts as at risk at t.
    Hand-written for that table (scipy's `ecdf` gives S(t) but not the counts); tested against `ecdf`.
    """
    t, e = np.asarray(time, dtype=float), np.asarray(event, dtype=bool)
    if t.shape != e.shape or t.ndim != 1:
        raise ValueError(f"time and event must be 1-d of one length, got {t.shape} and {e.shape}")
    rows, s = [], 1.0
    for u in np.unique(t[e]):
        n, d = int((t >= u).sum()), int(((t == u) & e).sum())
        s *= 1 - d / n
        rows.append({"time": float(u), "at_risk": n, "events": d, "survival": s})
    return pd.DataFrame(rows, columns=["time", "at_risk", "events", "survival"])


def _lag_index(T: int, lags: int, offsets: np.ndarray) -> np.ndarray:
    """(len(offsets), T - lags, lags) indices into a series of length T: entry [m, i, j - 1] is the index of
    x[t - j] at target t = i + lags after rotating x by offsets[m] (x_rot[t] = x[(t - offset) mod T])."""
    t = np.arange(lags, T)[None, :, None] - np.arange(1, lags + 1)[None, None, :]
    return (t - np.asarray(offsets)[:, None, None]) % T


def _restricted(y: np.ndarray, lags: int) -> tuple[np.ndarray, np.ndarray]:
    """Target y[t] (t >= lags) and an orthonormal basis Q of the restricted design [1, trend, y[t-1..t-lags]]."""
    T = len(y)
    target = y[lags:]
    trend = np.arange(T - lags, dtype=float) / (T - lags)
    design = np.column_stack([np.ones(T - lags), trend, y[_lag_index(T, lags, np.zeros(1, int))[0]]])
    q, r = np.linalg.qr(design)
    keep = np.abs(np.diag(r)) > 1e-10 * max(np.abs(np.diag(r)).max(), 1e-300)  # drop collinear columns
    return target, q[:, keep]


def _increments(target: np.ndarray, q: np.ndarray, xlags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Partial R² of the x-lag columns beyond the restricted design (basis q), and their coefficients,
    for a batch xlags (M, T', lags), by Frisch-Waugh: regress the residual of y on the residuals of x."""
    ry = target - q @ (q.T @ target)
    rss_r = float(ry @ ry)
    rx = xlags - q @ (q.T @ xlags)  # (M, T', lags)
    gram = np.swapaxes(rx, 1, 2) @ rx  # (M, lags, lags)
    rhs = np.swapaxes(rx, 1, 2) @ ry  # (M, lags)
    coef = (np.linalg.pinv(gram) @ rhs[..., None])[..., 0]
    explained = (coef * rhs).sum(-1)
    if rss_r <= 1e-12 * max(float(target @ target), 1e-300):
        return np.full(len(xlags), np.nan), coef
    return explained / rss_r, coef


def granger_increment(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray, lags: int) -> dict[str, float]:
    """How much the past of x predicts y beyond y's own past (Granger, 1969).

    Fits y[t] = a + b t + sum_j c_j y[t-j] + sum_j d_j x[t-j] (j = 1..lags) by least squares and
    returns `increment`: the share of y's residual variance under the restricted model (no x) that
    the x lags remove, (RSS_r - RSS_f) / RSS_r, a partial R² in [0, 1); and `direction`: the sum of
    the d_j in units of sd(y) / sd(x) (positive: more x, more y later). A correlation of x and y at
    the same step adds nothing: y[t] is explained only by values before t. NaN where y's own past
    explains it exactly. Hand-written (least squares by QR and Frisch-Waugh) so that the surrogate
    test can refit thousands of rotated series in one batch; statsmodels' `grangercausalitytests`
    fits one series at a time, without a trend, and gives F tests, not this partial R².
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-d of one length, got {x.shape} and {y.shape}")
    if lags < 1 or len(x) < 3 * lags + 5:
        raise ValueError(f"need lags >= 1 and at least {3 * lags + 5} steps, got lags={lags}, {len(x)} steps")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("x and y must be finite")
    target, q = _restricted(y, lags)
    inc, coef = _increments(target, q, x[_lag_index(len(x), lags, np.zeros(1, int))])
    sx, sy = x.std(), y.std()
    return {"increment": float(inc[0]), "direction": float(coef[0].sum() * sx / sy) if sx > 0 and sy > 0 else math.nan}


def granger_surrogate_test(
    series: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    lags: int,
    n_surrogates: int = 199,
    min_offset: int | None = None,
    seed: int = 0,
    n_boot: int = 4999,
    power: float = 0.8,
    alpha: float = 0.05,
    clusters: Sequence[object] | None = None,
) -> dict[str, float]:
    """Does x lead y across runs? Mean over runs of `granger_increment(x, y)` against surrogates in
    which each run's x is rotated in time by its own random offset (a circular shift keeps each
    series' autocorrelation and trend but breaks its alignment with y).

    `series`: one (x, y) pair of equal-length arrays per run (runs whose y its own past explains
    exactly are left out). Returns n_runs, statistic (mean increment), chance (its mean over
    surrogates), excess = statistic - chance with a 95% bootstrap interval [lo, hi] over runs, or, with
    `clusters` (one label per run, e.g. its cold start), the two-stage one of `clustered.hierarchical_bootstrap`
    (starts, then runs within each) and n_clusters,
    p_value = (1 + #surrogates >= statistic) / (1 + n_surrogates), direction (mean over runs), and
    detectable: the smallest excess this test finds with probability `power` at level `alpha`,
    (z_(1-alpha) + z_power) times the standard deviation of the surrogates' mean.
    """
    if not series:
        raise ValueError("no runs")
    rng = np.random.default_rng(seed)
    if clusters is not None and len(clusters) != len(series):
        raise ValueError(f"{len(clusters)} cluster labels for {len(series)} runs")
    obs, direction, null, kept = [], [], [], []
    for i, (x, y) in enumerate(series):
        x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
        g = granger_increment(x, y, lags)
        T, lo = len(x), (min_offset if min_offset is not None else 2 * lags + 1)
        if T - 2 * lo < 1:
            raise ValueError(f"run {i}: {T} steps leave no circular shift at least {lo} steps from the original")
        offsets = rng.integers(lo, T - lo + 1, n_surrogates)
        if not np.isfinite(g["increment"]):
            continue
        target, q = _restricted(y, lags)
        inc, _ = _increments(target, q, x[_lag_index(T, lags, offsets)])
        obs.append(g["increment"])
        direction.append(g["direction"])
        null.append(inc)
        kept.append(i)
    if not obs:
        raise ValueError("no run with a residual variance to explain")
    obs_a, null_a = np.asarray(obs), np.stack(null, axis=1)  # (runs,), (M, runs)
    stat, pooled_null = float(obs_a.mean()), null_a.mean(1)
    chance = float(pooled_null.mean())
    per_run_excess = obs_a - null_a.mean(0)
    labels = [clusters[i] for i in kept] if clusters is not None else kept  # without clusters, each run its own
    _, low, high = hierarchical_bootstrap(per_run_excess, labels, n_resamples=n_boot, seed=seed)
    z = stats.norm.ppf(1 - alpha) + stats.norm.ppf(power)
    return {
        "n_runs": len(obs_a),
        "n_clusters": len(set(labels)),
        "statistic": stat,
        "chance": chance,
        "excess": stat - chance,
        "lo": low,
        "hi": high,
        "p_value": float((1 + (pooled_null >= stat).sum()) / (1 + n_surrogates)),
        "direction": float(np.nanmean(direction)),
        "detectable": float(z * pooled_null.std(ddof=1)),
    }
