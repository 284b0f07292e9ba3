"""moe_rl.analysis.stats against scipy and hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from moe_rl.analysis import stats


@pytest.mark.parametrize(("k", "n"), [(0, 8), (3, 8), (8, 8), (1, 3), (17, 40)])
def test_wilson_matches_scipy(k: int, n: int) -> None:
    ref = sps.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert stats.wilson_interval(k, n) == pytest.approx((ref.low, ref.high), abs=1e-12)


def test_wilson_by_hand() -> None:
    z2 = 1.959963984540054**2
    assert stats.wilson_interval(0, 8) == pytest.approx((0.0, z2 / (8 + z2)))  # upper bound of 0 of n
    assert all(math.isnan(v) for v in stats.wilson_interval(0, 0))
    with pytest.raises(ValueError):
        stats.wilson_interval(5, 3)
    # the bound at p is exact at 0 of n and n of n, so error bars (p - lo, hi - p) are never negative
    for n in (1, 3, 7, 10, 25, 12_345, 9_876_543):  # 3, 7 (lo) and 10, 25 (hi) missed by rounding before
        assert stats.wilson_interval(0, n)[0] == 0.0 and stats.wilson_interval(n, n)[1] == 1.0


def test_collapse_test_fisher_and_boschloo() -> None:
    # 6 of 8 vs 0 of 8, one-sided Fisher: P(X >= 6), X ~ Hypergeom(16, 6, 8) = C(10,2) / C(16,8) = 45 / 12870
    assert stats.collapse_test(6, 8, 0, 8, alternative="greater", method="fisher") == pytest.approx(45 / 12870)
    assert stats.collapse_test(6, 8, 0, 8, method="fisher") == pytest.approx(2 * 45 / 12870)
    ref = sps.boschloo_exact([[6, 0], [2, 8]], alternative="greater").pvalue  # columns = arms
    bos = stats.collapse_test(6, 8, 0, 8, alternative="greater")
    assert bos == pytest.approx(ref) and bos < 45 / 12870  # more power than Fisher at fixed arm sizes
    assert stats.collapse_test(0, 8, 6, 8, alternative="greater") == pytest.approx(1.0)
    assert stats.collapse_test(0, 8, 0, 8) == 1.0 and math.isnan(stats.collapse_test(0, 0, 1, 8))
    with pytest.raises(ValueError, match="method"):
        stats.collapse_test(1, 8, 0, 8, method="nope")


def _hyper(total: int, hits: int, n1: int, a: int) -> float:
    return math.comb(hits, a) * math.comb(total - hits, n1 - a) / math.comb(total, n1)


def test_cmh_exact_one_stratum_is_fisher() -> None:
    for alt in ("two-sided", "greater", "less"):
        ref = sps.fisher_exact([[5, 3], [1, 7]], alternative=alt).pvalue
        assert stats.cmh_exact([(5, 8, 1, 8)], alternative=alt)["p_value"] == pytest.approx(ref)


def test_cmh_exact_two_strata_by_enumeration() -> None:
    tables = [(3, 5, 1, 5), (4, 6, 0, 6)]
    # brute force: the sum of arm-1 collapses over strata, each hypergeometric given its margins
    dists = []
    for k1, n1, k2, n2 in tables:
        total, hits = n1 + n2, k1 + k2
        dists.append({a: _hyper(total, hits, n1, a) for a in range(max(0, hits - n2), min(hits, n1) + 1)})
    p_ge = sum(p * q for a, p in dists[0].items() for b, q in dists[1].items() if a + b >= 7)
    res = stats.cmh_exact(tables, alternative="greater")
    assert res["p_value"] == pytest.approx(p_ge) and res["observed"] == 7
    assert res["expected"] == pytest.approx(4 * 5 / 10 + 4 * 6 / 12)
    # Mantel-Haenszel odds ratio sum(a d / n) / sum(b c / n) = (3*4/10 + 4*6/12) / (2*1/10 + 2*0/12)
    assert res["odds_ratio"] == pytest.approx((1.2 + 2.0) / 0.2)
    # a stratum where every run ended alike carries no information
    assert stats.cmh_exact([*tables, (0, 8, 0, 8)], alternative="greater")["p_value"] == pytest.approx(p_ge)
    assert math.isnan(stats.cmh_exact([(0, 8, 0, 8)])["p_value"])


def test_holm_by_hand() -> None:
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    out = stats.holm([0.01, 0.04, 0.03, 0.005, np.nan])
    assert out[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02]) and math.isnan(out[4])
    assert stats.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert len(stats.holm([])) == 0


def test_holm_matches_statsmodels() -> None:
    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(8)
    for size in (1, 2, 3, 7, 20):
        p = rng.random(size) ** 3
        p[: size // 3] = p[-1]  # ties
        np.testing.assert_array_equal(stats.holm(p), multipletests(p, method="holm")[1])


def test_mcnemar_two_sided_is_statsmodels_and_one_sided_is_the_binomial_test() -> None:
    from statsmodels.stats.contingency_tables import mcnemar

    for b, c in ((8, 0), (3, 1), (5, 5), (0, 4), (12, 30)):
        assert stats.mcnemar_exact(b, c) == mcnemar([[0, b], [c, 0]], exact=True).pvalue
        assert stats.mcnemar_exact(b, c) == pytest.approx(sps.binomtest(b, b + c, 0.5).pvalue, rel=1e-12)
        assert stats.mcnemar_exact(b, c, alternative="less") == pytest.approx(sps.binom.cdf(b, b + c, 0.5), rel=1e-12)


def test_sign_flip_pvalues_are_exact() -> None:
    assert stats.sign_flip_pvalue([1.0, 2.0, 3.0]) == pytest.approx(2 / 8)  # 3 seeds can never reach 0.05
    assert stats.sign_flip_pvalue(np.ones(8)) == pytest.approx(2 / 256)
    assert stats.sign_flip_pvalue(np.ones(8), alternative="greater") == pytest.approx(1 / 256)
    assert stats.sign_flip_pvalue([0.0, 0.0]) == 1.0


def test_paired_compare_by_hand() -> None:
    a, b = [1.0, 2.0, 3.0, 4.0], [0.5, 1.6, 2.0, 4.2]  # d = 0.5, 0.4, 1.0, -0.2
    r = stats.paired_compare(a, b)
    assert r["n"] == 4 and r["mean_diff"] == pytest.approx(0.425) and r["prob_improvement"] == 0.75
    # |sum of signed d| >= 1.7 for 4 of the 16 sign patterns (+ + + ±, and their negatives)
    assert r["p_value"] == pytest.approx(4 / 16)
    assert r["lo"] < r["mean_diff"] < r["hi"]
    assert stats.paired_compare([1, np.nan], [0, 0])["n"] == 1


def test_prob_improvement_counts_a_tie_as_one_half() -> None:
    """P(a > b) over pairs, by hand: a win counts 1, a tie 1/2, a loss 0 (the A statistic of paired data)."""
    a, b = [3.0, 2.0, 2.0, 1.0, 5.0], [1.0, 2.0, 2.0, 2.0, 4.0]  # d = 2, 0, 0, -1, 1: 2 wins, 2 ties, 1 loss
    assert stats.prob_improvement(np.subtract(a, b)) == pytest.approx((2 + 2 / 2) / 5)  # 0.6, not 0.4 or 0.8
    assert stats.paired_compare(a, b)["prob_improvement"] == pytest.approx(0.6)
    assert stats.paired_compare(b, a)["prob_improvement"] == pytest.approx(0.4)  # the two directions sum to 1
    assert stats.prob_improvement([0.0, 0.0, 0.0]) == 0.5  # all ties: no effect
    assert np.isnan(stats.prob_improvement([]))


def test_pairing_by_seed_removes_between_seed_variance() -> None:
    rng = np.random.default_rng(0)
    seed_level = rng.normal(0, 1.0, 10)  # shared by both arms of a seed (same cold start and prompts)
    a = seed_level + 0.1 + rng.normal(0, 0.01, 10)
    b = seed_level + rng.normal(0, 0.01, 10)
    r = stats.paired_compare(a, b)
    assert 0.08 < r["lo"] < r["hi"] < 0.12 and r["p_value"] == pytest.approx(2 / 1024)
    unpaired = sps.ttest_ind(a, b).pvalue
    assert unpaired > 0.5  # without pairing the effect is invisible


def test_bootstrap_ci_matches_normal_theory_for_large_n() -> None:
    x = np.random.default_rng(1).normal(3.0, 2.0, 400)
    mean, lo, hi = stats.bootstrap_mean_ci(x)
    half = 1.96 * x.std(ddof=1) / math.sqrt(len(x))
    assert mean == pytest.approx(x.mean())
    assert lo == pytest.approx(mean - half, abs=0.03) and hi == pytest.approx(mean + half, abs=0.03)
    assert stats.bootstrap_mean_ci([0.2, 0.2, 0.2])[1:] == pytest.approx((0.2, 0.2))  # constant: degenerate, not NaN
    assert stats.bootstrap_mean_ci([1.0, 2.0, 3.0]) == stats.bootstrap_mean_ci([1.0, 2.0, 3.0])  # seeded


def test_pair_by() -> None:
    frame = pd.DataFrame({"arm": ["a", "a", "b", "b", "b"], "seed": [0, 1, 0, 1, 2], "v": [1.0, 2.0, 0.5, 1.0, 9.0]})
    pairs = stats.pair_by(frame, arm_col="arm", a="a", b="b", value="v")
    assert pairs.to_dict("list") == {"seed": [0, 1], "a": [1.0, 2.0], "b": [0.5, 1.0]}
    with pytest.raises(ValueError, match="several runs"):
        stats.pair_by(pd.concat([frame, frame]), arm_col="arm", a="a", b="b", value="v")


def test_lagged_xcorr_matches_numpy() -> None:
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=50), rng.normal(size=50)
    out = stats.lagged_xcorr(x, y, 3).set_index("lag")
    assert list(out.index) == [-3, -2, -1, 0, 1, 2, 3]
    assert out.loc[2, "r"] == pytest.approx(np.corrcoef(x[:-2], y[2:])[0, 1])  # x[t] with y[t+2]
    assert out.loc[-1, "r"] == pytest.approx(np.corrcoef(x[1:], y[:-1])[0, 1])
    assert out.loc[0, "r"] == pytest.approx(np.corrcoef(x, y)[0, 1]) and out.loc[3, "n"] == 47
    lead = np.roll(x, 3)  # lead[t] = x[t-3]: x leads by 3
    peak = stats.lagged_xcorr(x, lead, 4).set_index("lag")["r"]
    assert peak.idxmax() == 3 and peak[3] == pytest.approx(1.0)
    y_nan = y.copy()
    y_nan[5] = np.nan
    assert stats.lagged_xcorr(x, y_nan, 0)["n"].iloc[0] == 49


def test_event_aligned_mean_by_hand() -> None:
    values = pd.DataFrame(
        {"run": ["a"] * 6 + ["b"] * 6, "step": list(range(6)) * 2, "value": [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15]}
    )
    events = pd.DataFrame({"run": ["a", "b"], "step": [3, 1]})
    out = stats.event_aligned_mean(values, events, before=2, after=1).set_index("offset")
    # offset -2: a at step 1 (1) only (b has no step -1); offset 0: a 3, b 11; offset +1: a 4, b 12
    assert out.loc[-2, "mean"] == 1 and out.loc[-2, "n"] == 1
    assert out.loc[0, "mean"] == 7 and out.loc[1, "mean"] == 8 and out.loc[1, "n"] == 2
    assert out.loc[-1, "mean"] == pytest.approx((2 + 10) / 2)


# --- survival, paired counts, agreement, looks ------------------------------------------------------------


def test_kaplan_meier_matches_scipy() -> None:
    rng = np.random.default_rng(3)
    t = rng.integers(1, 20, 40).astype(float)
    e = rng.random(40) < 0.6
    km = stats.kaplan_meier(t, e)
    ref = sps.ecdf(sps.CensoredData(uncensored=t[e], right=t[~e])).sf
    np.testing.assert_allclose(km["survival"], ref.evaluate(km["time"].to_numpy()), rtol=1e-12)
    # by hand: times 1 (event), 2 (censored), 3 (event), 3 (event): S = 3/4, then 3/4 * (1 - 2/2) = 0
    assert stats.kaplan_meier([1, 2, 3, 3], [True, False, True, True])["survival"].tolist() == [0.75, 0.0]


def test_logrank_one_stratum_matches_scipy() -> None:
    rng = np.random.default_rng(4)
    ta, tb = rng.integers(1, 30, 25).astype(float), rng.integers(5, 40, 30).astype(float)
    ea, eb = rng.random(25) < 0.7, rng.random(30) < 0.5
    t, e, g = np.r_[ta, tb], np.r_[ea, eb], np.r_[np.ones(25, bool), np.zeros(30, bool)]
    a, b = (sps.CensoredData(uncensored=tt[ee], right=tt[~ee]) for tt, ee in ((ta, ea), (tb, eb)))
    ours = stats.logrank_test(t, e, g)
    ref = sps.logrank(a, b)
    assert abs(ours["z"]) == pytest.approx(abs(ref.statistic), rel=1e-10)
    assert ours["p_value"] == pytest.approx(ref.pvalue, rel=1e-10)
    # "greater": arm a has more events than expected, i.e. collapses sooner (scipy's sign convention too)
    assert ours["observed"] > ours["expected"]
    assert stats.logrank_test(t, e, g, alternative="greater")["p_value"] == pytest.approx(
        sps.logrank(a, b, alternative="greater").pvalue, rel=1e-10
    )


def test_logrank_stratified_on_pairs_by_hand() -> None:
    """m pairs, arm a collapses at step 1, arm b is censored at step 2: per pair O - E = 1/2, V = 1/4,
    so Z = (m / 2) / sqrt(m / 4) = sqrt(m); pooled without strata the same data give the same Z."""
    m = 9
    t = np.tile([1.0, 2.0], m)
    e = np.tile([True, False], m)
    g = np.tile([True, False], m)
    r = stats.logrank_test(t, e, g, strata=np.repeat(np.arange(m), 2), alternative="greater")
    assert r["z"] == pytest.approx(3.0) and r["p_value"] == pytest.approx(sps.norm.sf(3.0))
    # strata that hold every run alike carry no weight: all censored is NaN
    assert np.isnan(stats.logrank_test([5.0, 5.0], [False, False], [True, False])["p_value"])
    # duplicating a stratum k times multiplies sum(O - E) by k and the variance by k: Z by sqrt(k)
    base = stats.logrank_test([1, 3, 4, 2, 5, 6], [1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0])
    dup = stats.logrank_test(
        np.tile([1, 3, 4, 2, 5, 6], 4),
        np.tile([1, 1, 0, 1, 1, 0], 4),
        np.tile([1, 1, 1, 0, 0, 0], 4),
        strata=np.repeat(np.arange(4), 6),
    )
    assert dup["z"] == pytest.approx(2 * base["z"])


def test_mcnemar_exact_by_hand() -> None:
    assert stats.mcnemar_exact(8, 0) == pytest.approx(2 / 256)
    assert stats.mcnemar_exact(8, 0, alternative="greater") == pytest.approx(1 / 256)
    assert stats.mcnemar_exact(3, 1, alternative="greater") == pytest.approx(5 / 16)  # P(X >= 3), X ~ Bin(4, 1/2)
    assert stats.mcnemar_exact(0, 0) == 1.0
    with pytest.raises(ValueError, match="discordant"):
        stats.mcnemar_exact(-1, 2)


def test_cohen_kappa_matches_sklearn() -> None:
    from sklearn.metrics import cohen_kappa_score

    rng = np.random.default_rng(5)
    for _ in range(5):
        x, y = rng.random(50) < 0.4, rng.random(50) < 0.6
        assert stats.cohen_kappa(x, y) == pytest.approx(cohen_kappa_score(x, y), abs=1e-12)
    # by hand: 4 runs, agree on 2; rates 1/2 and 1/2 -> p_e = 1/2, kappa = (1/2 - 1/2) / (1/2) = 0
    assert stats.cohen_kappa([1, 1, 0, 0], [1, 0, 1, 0]) == 0.0
    assert stats.cohen_kappa([1, 0, 1], [0, 1, 0]) == pytest.approx(-0.8)  # (0 - 4/9) / (5/9)
    assert np.isnan(stats.cohen_kappa([1, 1], [1, 1]))


def test_looks_adjusted() -> None:
    assert stats.looks_adjusted(0.009, 3) == pytest.approx(0.027)
    assert stats.looks_adjusted(0.5, 3) == 1.0 and stats.looks_adjusted(0.2, 1) == 0.2
    with pytest.raises(ValueError, match="looks"):
        stats.looks_adjusted(0.1, 0)


# --- Granger-style lead ---------------------------------------------------------------------------------


def test_granger_increment_matches_a_loop_of_least_squares() -> None:
    rng = np.random.default_rng(6)
    x = rng.normal(size=60)
    y = np.r_[0.0, 0.6 * x[:-1]] + rng.normal(size=60)
    lags = 2
    rows_r, rows_f, target = [], [], []
    for t in range(lags, 60):
        i = t - lags
        base = [1.0, i / (60 - lags), y[t - 1], y[t - 2]]
        rows_r.append(base)
        rows_f.append(base + [x[t - 1], x[t - 2]])
        target.append(y[t])
    rss = [
        np.sum((np.asarray(target) - np.asarray(a) @ np.linalg.lstsq(np.asarray(a), target, rcond=None)[0]) ** 2)
        for a in (rows_r, rows_f)
    ]
    g = stats.granger_increment(x, y, lags)
    assert g["increment"] == pytest.approx(1 - rss[1] / rss[0], rel=1e-9)
    assert g["direction"] > 0


def test_granger_surrogates_find_a_lead_and_not_a_same_step_correlation() -> None:
    rng = np.random.default_rng(7)
    lead, same = [], []
    for _ in range(12):
        x = rng.normal(size=120)
        lead.append((x, np.r_[0.0, 0.5 * x[:-1]] + rng.normal(size=120)))  # x at t moves y at t + 1
        same.append((x, 2.0 * x + rng.normal(size=120)))  # strongly correlated at the same step only
    r = stats.granger_surrogate_test(lead, lags=2, n_surrogates=99)
    assert r["p_value"] == pytest.approx(1 / 100) and r["lo"] > 0.1 and r["direction"] > 0
    r0 = stats.granger_surrogate_test(same, lags=2, n_surrogates=99)
    assert r0["p_value"] > 0.05 and r0["lo"] < 0 < r0["hi"]
    # the smallest detectable excess is (z_0.95 + z_0.8) sd of the surrogates' mean: of the order of
    # the chance increment's spread over 12 runs of 117 fitted steps, far below the planted lead
    assert 0 < r0["detectable"] < 0.05 < r["excess"]


def test_granger_interval_over_clusters_counts_starts_not_runs() -> None:
    # 3 independent series, each run 4 times (4 runs of one start): the runs' excesses repeat within a start
    # (up to their own surrogates), so an interval over 12 runs is ~sqrt(4) too narrow; over the 3 starts it is not
    rng = np.random.default_rng(3)
    base = []
    for _ in range(3):
        x = rng.normal(size=120)
        base.append((x, np.r_[0.0, 0.3 * x[:-1]] + rng.normal(size=120)))
    series = [pair for pair in base for _ in range(4)]
    starts = [i for i in range(3) for _ in range(4)]
    runs = stats.granger_surrogate_test(series, lags=2, n_surrogates=99)
    clustered = stats.granger_surrogate_test(series, lags=2, n_surrogates=99, clusters=starts)
    assert runs["n_clusters"] == 12 and clustered["n_clusters"] == 3
    assert clustered["excess"] == runs["excess"] and clustered["p_value"] == runs["p_value"]
    assert clustered["hi"] - clustered["lo"] > 1.5 * (runs["hi"] - runs["lo"])
    with pytest.raises(ValueError, match="2 cluster labels for 12 runs"):
        stats.granger_surrogate_test(series, lags=2, n_surrogates=99, clusters=[0, 1])
