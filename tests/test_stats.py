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


def test_prob_improvement_counts_a_tie_as_one_half() -> None:
    """P(a > b) over pairs, by hand: a win counts 1, a tie 1/2, a loss 0 (the A statistic of paired data)."""
    a, b = [3.0, 2.0, 2.0, 1.0, 5.0], [1.0, 2.0, 2.0, 2.0, 4.0]  # d = 2, 0, 0, -1, 1: 2 wins, 2 ties, 1 loss
    assert stats.prob_improvement(np.subtract(a, b)) == pytest.approx((2 + 2 / 2) / 5)  # 0.6, not 0.4 or 0.8
    assert stats.prob_improvement(np.subtract(b, a)) == pytest.approx(0.4)  # the two directions sum to 1
    assert stats.prob_improvement([0.0, 0.0, 0.0]) == 0.5  # all ties: no effect
    assert np.isnan(stats.prob_improvement([]))


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
