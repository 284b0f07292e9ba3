"""Statistics for comparisons across seeds and arms (docs/design.md §7). Pure functions over arrays.

- collapse counts "k of n": `wilson_interval`; two arms: `collapse_test` (Boschloo's exact test
  by default, Fisher's on request); many strata (cells of a sweep): `cmh_exact`;
- continuous per-run metrics: `bootstrap_mean_ci` (one arm), `paired_compare` (two arms paired by
  seed: bootstrap interval of the mean difference, sign-flip permutation p-value, probability of
  improvement), `compare_pairs` (the same pairs with the cold start as the unit from `clustered.MIN_UNITS`
  starts up);
- many tests in one report: `holm`;
- time series: `lagged_xcorr` and `event_aligned`.

Where a well-kept library has the same test, it computes it: statsmodels for the Wilson interval
(`proportion_confint`), the exact two-sided McNemar test (`mcnemar`) and Cohen's kappa
(`cohens_kappa`); scipy for Fisher, Boschloo, the permutation test and the binomial test. Every
bootstrap interval is `clustered.hierarchical_bootstrap`'s (over pairs: each pair its own unit), one
routine and seed for every page. What stays hand-written (Holm, exact CMH, Kaplan-Meier, log-rank, the Granger lead) says why
in its docstring, and the tests check it against a library where one has the same numbers.

Why Boschloo rather than Fisher for two arms: seeds per arm are fixed by the design (two independent
binomial samples), not the total number of collapses, so the conditional Fisher test is needlessly
conservative; Boschloo's unconditional test uses Fisher's p-value as its statistic and is uniformly
more powerful (6 of 8 vs 0 of 8: one-sided p = 0.0011 vs Fisher's 0.0035). Pooled over cells we
use the exact conditional (stratified Fisher) test, because an unconditional test over many
nuisance parameters is not practical.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.inter_rater import cohens_kappa
from statsmodels.stats.proportion import proportion_confint

from moe_rl.analysis.clustered import (
    MIN_UNITS,
    N_RESAMPLES,
    cluster_sign_flip_pvalue,
    hierarchical_bootstrap,
    paired_by_start,
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


def cmh_exact(tables: Sequence[tuple[int, int, int, int]], *, alternative: str = "two-sided") -> dict[str, float]:
    """Exact stratified test of a common odds ratio of 1 over 2x2 tables (k1, n1, k2, n2), one per stratum.

    Conditional on every margin, the number of arm-1 collapses in a stratum is hypergeometric, and
    their sum over strata has the convolution of those distributions: the exact Cochran-Mantel-
    Haenszel test (R's `mantelhaen.test(exact=TRUE)`; one stratum gives Fisher's exact test). Two-
    sided p sums the outcomes no more likely than the observed one. Also returns the
    Mantel-Haenszel common odds ratio sum(a d / n) / sum(b c / n) and the observed and expected
    total of arm-1 collapses. Strata without both outcomes carry no information and are skipped.
    Hand-written because neither scipy nor statsmodels has the exact test (statsmodels'
    `StratifiedTable.test_null_odds` is the asymptotic one, poor with a few runs per cell).
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
    out = {
        "observed": observed,
        "expected": expected,
        "strata": float(used),
        "odds_ratio": (num / den) if den > 0 else (math.inf if num > 0 else math.nan),
    }
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


def _finite(x: Sequence[float] | np.ndarray) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    return a[np.isfinite(a)]


def bootstrap_ci(x: np.ndarray, *, confidence: float, n_resamples: int, seed: int) -> tuple[float, float]:
    """The percentile interval of the mean of `x`, each value its own unit: `clustered.hierarchical_bootstrap` with
    one run per cluster, so one routine and seed serve every page (the value itself where `x` is constant, NaN for
    fewer than 2 values)."""
    _, lo, hi = hierarchical_bootstrap(x, np.arange(len(x)), confidence=confidence, n_resamples=n_resamples, seed=seed)
    return lo, hi


def bootstrap_mean_ci(
    x: Sequence[float] | np.ndarray, *, confidence: float = 0.95, n_resamples: int = 9999, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap interval of the mean of the finite values (`bootstrap_ci`); NaN bounds
    for n < 2."""
    a = _finite(x)
    if not len(a):
        return math.nan, math.nan, math.nan
    lo, hi = bootstrap_ci(a, confidence=confidence, n_resamples=n_resamples, seed=seed)
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
    res = stats.permutation_test(
        (a,),
        lambda v, axis=-1: np.mean(v, axis=axis),
        permutation_type="samples",
        vectorized=True,
        alternative=alternative,
        n_resamples=2**14,
        rng=np.random.default_rng(0),
    )
    return float(res.pvalue)


def prob_improvement(d: Sequence[float] | np.ndarray) -> float:
    """P(a > b) from the paired differences d = a - b: the share of pairs where a is higher, a tie counting
    one half (the A statistic, or common-language effect size, of paired data); 0.5 is no effect."""
    x = np.asarray(d, dtype=float)
    return float(np.mean((x > 0) + 0.5 * (x == 0))) if len(x) else math.nan


def paired_compare(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    *,
    confidence: float = 0.95,
    n_resamples: int = 9999,
    seed: int = 0,
    alternative: str = "two-sided",
) -> dict[str, float]:
    """Arm a vs arm b, element i of each from the same seed (same cold start and prompts).

    Returns n (complete pairs), mean_diff = mean(a - b) with a percentile bootstrap interval [lo, hi]
    over pairs (`bootstrap_ci`), p_value of a sign-flip permutation test on the differences, and
    prob_improvement = P(a_i > b_i) over pairs, a tie counting one half (`prob_improvement`), the paired
    version of rliable's probability of improvement.
    """
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"paired arrays differ in shape: {x.shape} vs {y.shape}")
    keep = np.isfinite(x) & np.isfinite(y)
    d = x[keep] - y[keep]
    n = len(d)
    if not n:
        return {
            "n": 0,
            "mean_diff": math.nan,
            "lo": math.nan,
            "hi": math.nan,
            "p_value": math.nan,
            "prob_improvement": math.nan,
        }
    lo, hi = bootstrap_ci(d, confidence=confidence, n_resamples=n_resamples, seed=seed)
    return {
        "n": n,
        "mean_diff": float(d.mean()),
        "lo": lo,
        "hi": hi,
        "p_value": sign_flip_pvalue(d, alternative=alternative),
        "prob_improvement": prob_improvement(d),
    }


def compare_pairs(
    a: Sequence[float] | np.ndarray | pd.Series,
    b: Sequence[float] | np.ndarray | pd.Series,
    starts: Sequence[object] | np.ndarray | pd.Series | None,
    *,
    alternative: str = "two-sided",
    n_resamples: int = N_RESAMPLES,
) -> dict:
    """a - b over pairs, with the keys of `paired_compare` (mean_diff, lo, hi, p_value, prob_improvement, n).
    From MIN_UNITS independent starts up (`starts`: each pair's cold start, e.g. "start of a | start of b") the
    start is the unit: the mean of the starts' means, the hierarchical interval and a sign flip with one sign per
    start (`clustered.paired_by_start`). Below that, or without `starts`, by seed pairs: the reading a descriptive claim
    quotes beside its reason, never a verdict (`claims.rules.descriptive`)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    d = x - y
    units = None if starts is None else np.asarray(starts, dtype=object)
    if units is None or len(set(units[np.isfinite(d)])) < MIN_UNITS:
        return paired_compare(x, y, alternative=alternative, n_resamples=n_resamples)
    r = paired_by_start(d, units)  # both drop non-finite differences
    r["p_value"] = cluster_sign_flip_pvalue(d, units, alternative=alternative)
    r["n"] = r.pop("n_pairs")
    return r


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


def logrank_test(
    time: Sequence[float] | np.ndarray,
    event: Sequence[bool] | np.ndarray,
    group: Sequence[bool] | np.ndarray,
    strata: Sequence | np.ndarray | None = None,
    *,
    alternative: str = "two-sided",
) -> dict[str, float]:
    """(Stratified) log-rank test of equal hazards between group True (arm a) and group False (arm b).

    Within each stratum, at every event time u: observed events of a, O_u, expected
    E_u = d_u n_a,u / n_u and hypergeometric variance V_u = d_u (n_a,u / n_u)(1 - n_a,u / n_u)
    (n_u - d_u) / (n_u - 1); Z = sum (O - E) / sqrt(sum V) over strata and times. Strata on pairs
    (cell and seed) give the paired test: only pairs where one arm collapsed first carry weight.
    `alternative="greater"`: arm a collapses sooner (more events than expected). Returns z,
    observed and expected events of arm a, and p_value (NaN when no stratum carries information).
    Hand-written because scipy's `logrank` has no strata and statsmodels' `survdiff` gives only the
    two-sided chi-square (no one-sided z); tested against scipy's on one stratum.
    """
    _check_alternative(alternative)
    t, e, g = np.asarray(time, dtype=float), np.asarray(event, dtype=bool), np.asarray(group, dtype=bool)
    s = np.zeros(len(t), dtype=int) if strata is None else pd.factorize(pd.Series(list(strata)))[0]
    if not (t.shape == e.shape == g.shape == s.shape) or t.ndim != 1:
        raise ValueError(
            f"time, event, group and strata must be 1-d of one length, got {t.shape}, {e.shape}, {g.shape}, {s.shape}"
        )
    obs = exp = var = 0.0
    for k in np.unique(s):
        tk, ek, gk = t[s == k], e[s == k], g[s == k]
        for u in np.unique(tk[ek]):
            at_risk = tk >= u
            n, na = int(at_risk.sum()), int((at_risk & gk).sum())
            d = int(((tk == u) & ek).sum())
            obs += int(((tk == u) & ek & gk).sum())
            exp += d * na / n
            if n > 1:
                var += d * (na / n) * (1 - na / n) * (n - d) / (n - 1)
    out = {"observed": float(obs), "expected": float(exp), "variance": float(var)}
    if var <= 0:
        return {**out, "z": math.nan, "p_value": math.nan}
    z = (obs - exp) / math.sqrt(var)
    p = {"greater": stats.norm.sf(z), "less": stats.norm.cdf(z), "two-sided": 2 * stats.norm.sf(abs(z))}[alternative]
    return {**out, "z": float(z), "p_value": float(min(1.0, p))}


def mcnemar_exact(b: int, c: int, *, alternative: str = "two-sided") -> float:
    """Exact McNemar test from the discordant pairs: b pairs where only arm a collapsed, c where only b did.

    Under equal collapse probability within pairs, b ~ Binomial(b + c, 1/2). Pairs from different
    cells can be pooled (each pair is its own stratum), so this is also the stratified test.
    `alternative="greater"`: arm a collapses more. p = 1 without discordant pairs. Two-sided:
    statsmodels' `mcnemar(exact=True)`; one-sided (which statsmodels does not offer): scipy's
    exact binomial test of b out of b + c.
    """
    _check_alternative(alternative)
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    if b + c == 0:
        return 1.0
    if alternative == "two-sided":
        return float(mcnemar([[0, b], [c, 0]], exact=True).pvalue)
    return float(stats.binomtest(b, b + c, 0.5, alternative=alternative).pvalue)


def cohen_kappa(x: Sequence[bool] | np.ndarray, y: Sequence[bool] | np.ndarray) -> float:
    """Cohen's kappa of two labellings of the same runs: (p_o - p_e) / (1 - p_e) (statsmodels' `cohens_kappa`).

    1 is perfect agreement, 0 the agreement two independent labellings with these rates would
    reach by chance; NaN when chance agreement is already perfect (both label every run alike).
    """
    a, b = np.asarray(x, dtype=bool), np.asarray(y, dtype=bool)
    if a.shape != b.shape or a.ndim != 1 or not len(a):
        raise ValueError(f"need two non-empty 1-d labellings of one length, got {a.shape} and {b.shape}")
    pe = float(a.mean() * b.mean() + (1 - a.mean()) * (1 - b.mean()))
    if pe == 1:
        return math.nan
    table = np.array([[np.sum(a & b), np.sum(a & ~b)], [np.sum(~a & b), np.sum(~a & ~b)]], dtype=float)
    return float(cohens_kappa(table, return_results=False))


def looks_adjusted(p: float, looks: int) -> float:
    """p after `looks` analyses of accumulating data (Bonferroni over looks: min(1, looks * p)).

    Valid whatever the dependence between looks, and conservative: adding runs after seeing results
    and testing again would otherwise raise the false-positive rate with every look. (One p times a
    count, not a family of p-values, so no multiple-testing routine applies.)
    """
    if looks < 1:
        raise ValueError(f"looks must be >= 1, got {looks}")
    return p if not np.isfinite(p) else float(min(1.0, looks * p))


# --- Granger-style lead against circular-shift surrogates ----------------------------------------------


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
