"""The mission's outcomes beside every verdict (`moe_rl.studies.secondary`): per run from the long-format metrics,
per contrast paired over starts, by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from moe_rl.studies import secondary as sec
from moe_rl.studies.study_rule import pair_values


def _long(run: str, values: dict[str, list[float]]) -> pd.DataFrame:
    rows = [{"run": run, "step": s + 1, "key": k, "value": v} for k, vals in values.items() for s, v in enumerate(vals)]
    return pd.DataFrame(rows)


def test_per_run_outcomes_read_the_acting_routes_where_a_run_replays() -> None:
    """A replayed run's acting flips are `used_vs_cached` (0: replay works), a live run's its old-vs-new flips; the
    early ratio variance averages steps 1..20 only; the clip fraction sums its two sides per step."""
    n = 22
    replayed = _long(
        "r2",
        {
            sec.FLIP_LIVE_KEY: [0.1] * n,
            sec.ROUTE_USED_VS_CACHED_FLIP_RATE: [0.0] * n,
            sec.RATIO_VAR_KEY: [1.0] * 20 + [4.0, 4.0],
            sec.RATIO_CLIPFRAC_LOW: [0.01] * n,
            sec.RATIO_CLIPFRAC_HIGH: [0.02] * n,
        },
    )
    live = _long("none", {sec.FLIP_LIVE_KEY: [0.2] * n, sec.RATIO_VAR_KEY: [2.0] * n})
    out = sec.per_run_secondary(pd.concat([replayed, live]))
    assert out.loc["r2", "flip_acting"] == 0.0 and out.loc["r2", "flip_live"] == pytest.approx(0.1)
    assert out.loc["none", "flip_acting"] == pytest.approx(0.2)
    assert out.loc["r2", "ratio_var_early"] == pytest.approx(1.0)
    assert out.loc["r2", "ratio_var"] == pytest.approx((20 + 8) / 22)
    assert out.loc["r2", "clip"] == pytest.approx(0.03) and math.isnan(out.loc["none", "clip"])


def test_a_contrast_pairs_collapses_and_variances_over_starts() -> None:
    """Four starts: a collapses at starts 0, 1, 2, b at 2 and 3 (discordant 2 vs 1, McNemar p = binom(2, 3) = 1.0);
    the collapse difference per start is [1, 1, 0, -1], mean 0.25 with its t interval; the ratio variance is read
    as the geometric mean ratio a / b."""
    runs = pd.DataFrame(
        {
            "cell": ["a@x"] * 4 + ["b@x"] * 4,
            "seed": [0, 1, 2, 3] * 2,
            "start": ["s0", "s1", "s2", "s3"] * 2,
            "collapsed": [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0],
            "ratio_var": [2.0, 4.0, 1.0, 8.0, 1.0, 1.0, 1.0, 2.0],
        }
    )
    weights = {("a", "x"): 1.0, ("b", "x"): -1.0}
    row = sec.secondary_row(runs, weights, "collapsed", pair_values)
    d = np.array([1.0, 1.0, 0.0, -1.0])
    half = stats.t.isf(0.025, 3) * d.std(ddof=1) / 2
    assert row["estimate"] == pytest.approx(0.25)
    assert (row["lo"], row["hi"]) == pytest.approx((0.25 - half, 0.25 + half))
    assert (row["k_first"], row["k_second"], row["runs"]) == (3, 2, 4)
    assert row["mcnemar_p"] == pytest.approx(1.0)
    var = sec.secondary_row(runs, weights, "ratio_var", pair_values)
    assert var["estimate"] == pytest.approx(math.exp(np.log([2.0, 4.0, 1.0, 4.0]).mean()))
    line = sec.describe(sec.secondary_table(runs, {"a_minus_b": weights}, pair_values), "a_minus_b")
    assert line.startswith("collapse events +25.0 pp") and "(3 vs 2 of 4, McNemar p 1)" in line and "x [" in line
