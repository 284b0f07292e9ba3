"""Statistics for comparisons across seeds and arms (docs/design.md §7). Pure functions over arrays.

- collapse counts "k of n": `wilson_interval`; two arms: `collapse_test` (Boschloo's exact test
  by default, Fisher's on request); many strata (cells of a sweep): `cmh_exact`;
- continuous per-run metrics: `bootstrap_mean_ci` (one arm), `paired_compare` (two arms paired by
  seed: bootstrap interval of the mean difference, sign-flip permutation p-value, probability of
  improvement);
- many tests in one report: `holm`;
- time series: `lagged_xcorr` and `event_aligned`.

Why Boschloo rather than Fisher for two arms: seeds per arm are fixed by the design (two independent
binomial samples), not the total number of collapses, so the conditional Fisher test is needlessly
conservative; Boschloo's unconditional test uses Fisher's p-value as its statistic and is uniformly
more powerful (6 of 8 vs 0 of 8: one-sided p = 0.0011 vs Fisher's 0.0035). Pooled over cells we
use the exact conditional (stratified Fisher) test, because an unconditional test over many
nuisance parameters is not practical.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats

ALTERNATIVES = ("two-sided", "greater", "less")


def _check_alternative(alternative: str) -> None:
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative={alternative!r} is not valid; valid: {list(ALTERNATIVES)}")


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion k/n; (nan, nan) when n == 0.

    (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n): unlike the Wald interval it stays inside
    [0, 1] and is not degenerate at 0 of n, which is the common case for collapse counts.
    """
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return math.nan, math.nan
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at 0 of n and n of n one bound is exactly p; rounding must not put it on the wrong side of p
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


def collapse_test(k1: int, n1: int, k2: int, n2: int, *, alternative: str = "two-sided",
                  method: str = "boschloo") -> float:
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


def cmh_exact(tables: Sequence[tuple[int, int, int, int]], *, alternative: str = "two-sided") -> dict[str, float]:
    """Exact stratified test of a common odds ratio of 1 over 2x2 tables (k1, n1, k2, n2), one per stratum.

    Conditional on every margin, the number of arm-1 collapses in a stratum is hypergeometric, and
    their sum over strata has the convolution of those distributions: the exact Cochran-Mantel-
    Haenszel test (R's `mantelhaen.test(exact=TRUE)`; one stratum gives Fisher's exact test). Two-
    sided p sums the outcomes no more likely than the observed one. Also returns the
    Mantel-Haenszel common odds ratio sum(a d / n) / sum(b c / n) and the observed and expected
    total of arm-1 collapses. Strata without both outcomes carry no information and are skipped.
    """
    _check_alternative(alternative)
    support_lo, pmf = 0, np.array([1.0])
    observed = expected = num = den = 0.0
    used = 0
    for k1, n1, k2, n2 in tables:
        total, hits = n1 + n2, k1 + k2
        if n1 == 0 or n2 == 0 or hits in (0, total):
            continue
        used += 1
        dist = stats.hypergeom(total, hits, n1)  # arm-1 collapses given both margins
        lo, hi = max(0, hits - n2), min(hits, n1)
        pmf = np.convolve(pmf, dist.pmf(np.arange(lo, hi + 1)))
        support_lo += lo
        observed += k1
        expected += float(dist.mean())
        a, b, c, d = k1, n1 - k1, k2, n2 - k2
        num += a * d / total
        den += b * c / total
    out = {"observed": observed, "expected": expected, "strata": float(used),
           "odds_ratio": (num / den) if den > 0 else (math.inf if num > 0 else math.nan)}
    if not used:
        return {**out, "p_value": math.nan}
    x = round(observed) - support_lo
    if alternative == "greater":
        p = pmf[x:].sum()
    elif alternative == "less":
        p = pmf[: x + 1].sum()
    else:
        p = pmf[pmf <= pmf[x] * (1 + 1e-7)].sum()
    return {**out, "p_value": float(min(1.0, p))}


def holm(p_values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm step-down adjusted p-values (family-wise error control); NaN entries stay NaN and do not count.

    Sorted ascending, p_(i) becomes max_{j <= i} min(1, (m - j + 1) p_(j)).
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


def _finite(x: Sequence[float] | np.ndarray) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    return a[np.isfinite(a)]


def _bootstrap_ci(data: tuple[np.ndarray, ...], statistic, *, paired: bool, confidence: float, n_resamples: int,
                  seed: int) -> tuple[float, float]:
    """scipy's BCa interval; percentile where BCa is undefined (e.g. a constant sample)."""
    if len(data[0]) < 2:
        return math.nan, math.nan
    if all(np.ptp(d) == 0 for d in data):
        value = float(statistic(*data))
        return value, value
    for method in ("BCa", "percentile"):
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy warns where BCa is undefined; the fallback handles it
            res = stats.bootstrap(data, statistic, paired=paired, vectorized=True, confidence_level=confidence,
                                  n_resamples=n_resamples, method=method, rng=np.random.default_rng(seed))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if np.isfinite(lo) and np.isfinite(hi):
            return lo, hi
    return math.nan, math.nan


def bootstrap_mean_ci(x: Sequence[float] | np.ndarray, *, confidence: float = 0.95, n_resamples: int = 9999,
                      seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): bootstrap (BCa) interval of the mean of the finite values; NaN bounds for n < 2."""
    a = _finite(x)
    if not len(a):
        return math.nan, math.nan, math.nan
    lo, hi = _bootstrap_ci((a,), lambda v, axis=-1: np.mean(v, axis=axis), paired=False, confidence=confidence,
                           n_resamples=n_resamples, seed=seed)
    return float(a.mean()), lo, hi


def sign_flip_pvalue(d: Sequence[float] | np.ndarray, *, alternative: str = "two-sided") -> float:
    """Paired permutation p-value of mean(d) = 0: every sign pattern of the differences (exact up to 2^14).

    With n pairs all of one sign the two-sided p is 2 / 2^n, so 3 seeds can never give p < 0.25:
    the reason this harness asks for >= 8 seeds per cell.
    """
    _check_alternative(alternative)
    a = _finite(d)
    if not len(a):
        return math.nan
    if np.all(a == 0):
        return 1.0
    if len(a) == 1:  # two sign patterns
        return {"two-sided": 1.0, "greater": 0.5 if a[0] > 0 else 1.0, "less": 0.5 if a[0] < 0 else 1.0}[alternative]
    res = stats.permutation_test((a,), lambda v, axis=-1: np.mean(v, axis=axis), permutation_type="samples",
                                 vectorized=True, alternative=alternative, n_resamples=2**14,
                                 rng=np.random.default_rng(0))
    return float(res.pvalue)


def paired_compare(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, *, confidence: float = 0.95,
                   n_resamples: int = 9999, seed: int = 0, alternative: str = "two-sided") -> dict[str, float]:
    """Arm a vs arm b, element i of each from the same seed (same cold start and prompts).

    Returns n (complete pairs), mean_diff = mean(a - b) with a bootstrap (BCa) interval [lo, hi]
    over pairs, p_value of a sign-flip permutation test on the differences, and
    prob_improvement = P(a_i > b_i) over pairs (ties count one half), the paired version of
    rliable's probability of improvement.
    """
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"paired arrays differ in shape: {x.shape} vs {y.shape}")
    keep = np.isfinite(x) & np.isfinite(y)
    d = x[keep] - y[keep]
    n = len(d)
    if not n:
        return {"n": 0, "mean_diff": math.nan, "lo": math.nan, "hi": math.nan, "p_value": math.nan,
                "prob_improvement": math.nan}
    lo, hi = _bootstrap_ci((d,), lambda v, axis=-1: np.mean(v, axis=axis), paired=False, confidence=confidence,
                           n_resamples=n_resamples, seed=seed)
    return {
        "n": n,
        "mean_diff": float(d.mean()),
        "lo": lo,
        "hi": hi,
        "p_value": sign_flip_pvalue(d, alternative=alternative),
        "prob_improvement": float(np.mean((d > 0) + 0.5 * (d == 0))),
    }


def pair_by(frame: pd.DataFrame, *, arm_col: str, a: str, b: str, value: str,
            on: Sequence[str] = ("seed",)) -> pd.DataFrame:
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
