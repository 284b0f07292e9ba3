"""Power of a paired contrast over cold starts (`moe_rl.analysis.power`): variance components, starts needed, the
cheaper design, the t interval on start means, and the `--power` report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from moe_rl.analysis import clustered
from moe_rl.analysis import power as pw


def _frame(groups: dict[str, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"start": s, "diff": v} for s, vals in groups.items() for v in vals])


# --- variance components ---------------------------------------------------------------------------------------


def test_components_of_a_small_balanced_example_by_hand() -> None:
    # starts a: 1, 2 (mean 1.5); b: 5, 6 (5.5); c: 9, 7 (8); grand mean 5.
    # SSW = 0.5 + 0.5 + 2 = 3 -> MSW = 3 / 3 = 1; SSB = 2 (3.5^2 + 0.5^2 + 3^2) = 43 -> MSB = 21.5; n0 = 2
    # sigma_b^2 = (21.5 - 1) / 2 = 10.25; ICC = 10.25 / 11.25
    vc = pw.variance_components(_frame({"a": [1, 2], "b": [5, 6], "c": [9, 7]}))
    assert (vc.n_starts, vc.n_pairs, vc.seeds_per_start) == (3, 6, 2.0)
    assert vc.mean == pytest.approx(5.0)
    assert (vc.msb, vc.msw, vc.n0) == pytest.approx((21.5, 1.0, 2.0))
    assert vc.sd_between == pytest.approx(math.sqrt(10.25))
    assert vc.sd_within == pytest.approx(1.0)
    assert vc.icc == pytest.approx(10.25 / 11.25)
    frame = _frame({"a": [1, 2], "b": [5, 6], "c": [9, 7]})
    assert vc.icc == pytest.approx(clustered.intraclass_correlation(frame["diff"], frame["start"]))


def test_components_truncate_the_between_part_at_zero() -> None:
    # a: 1, 3; b: 2, 6; c: 4, 4 -> means 2, 4, 4; MSW = (2 + 8 + 0) / 3 = 10/3, MSB = 2 (16 + 4 + 4) / 9 / 2 = 8/3
    vc = pw.variance_components(_frame({"a": [1, 3], "b": [2, 6], "c": [4, 4]}))
    assert (vc.msb, vc.msw) == pytest.approx((8 / 3, 10 / 3))
    assert vc.var_between_raw == pytest.approx((8 / 3 - 10 / 3) / 2)
    assert (vc.sd_between, vc.icc) == (0.0, 0.0)
    assert vc.sd_within == pytest.approx(math.sqrt(10 / 3))


def test_components_of_an_unbalanced_example_by_hand() -> None:
    # a: 1, 3 (n 2, mean 2); b: 4 (n 1); c: 6, 8, 10 (n 3, mean 8); N = 6, grand mean 32 / 6.
    # SSB = 2 (2 - 16/3)^2 + (4 - 16/3)^2 + 3 (8 - 16/3)^2 = 136/3 -> MSB = 68/3; SSW = 2 + 0 + 8 -> MSW = 10/3
    # n0 = (6 - (4 + 1 + 9) / 6) / 2 = 11/6; sigma_b^2 = (68/3 - 10/3) / (11/6) = 116/11
    vc = pw.variance_components(_frame({"a": [1, 3], "b": [4], "c": [6, 8, 10]}))
    assert (vc.msb, vc.msw, vc.n0) == pytest.approx((68 / 3, 10 / 3, 11 / 6))
    assert vc.sd_between**2 == pytest.approx(116 / 11)
    assert vc.mean == pytest.approx((2 + 4 + 8) / 3)  # each start weighs the same


def test_components_with_one_pair_per_start_or_one_start() -> None:
    vc = pw.variance_components(_frame({"a": [1.0], "b": [3.0], "c": [2.0]}))
    assert math.isnan(vc.sd_within) and math.isnan(vc.icc)
    assert vc.sd_between == pytest.approx(1.0)  # the SD of the start means holds both parts
    assert math.isnan(pw.variance_components(_frame({"a": [1.0, 2.0]})).sd_between)


def test_components_recovered_on_planted_data() -> None:
    """4,000 starts x 2 pairs, sigma_b 0.04, sigma_w 0.03. Sampling error (balanced one-way ANOVA, normal data):
    var(MSW) = 2 sigma_w^4 / (N - C), var(MSB) = 2 (sigma_w^2 + m sigma_b^2)^2 / (C - 1), independent, so
    var(sigma_b^2 hat) = (var MSB + var MSW) / m^2; an SD's SE is its variance's SE / (2 SD) (delta method).
    Tolerance: 4 SEs."""
    C, m, sb, sw = 4000, 2, 0.04, 0.03
    rng = np.random.default_rng(7)
    values = (rng.normal(0, sb, (C, 1)) + rng.normal(0, sw, (C, m))).ravel()
    frame = pd.DataFrame({"start": np.repeat(np.arange(C), m), "diff": values})
    vc = pw.variance_components(frame)
    N = C * m
    var_msw = 2 * sw**4 / (N - C)
    var_msb = 2 * (sw**2 + m * sb**2) ** 2 / (C - 1)
    se_sw = math.sqrt(var_msw) / (2 * sw)
    se_sb = math.sqrt((var_msb + var_msw) / m**2) / (2 * sb)
    assert abs(vc.sd_within - sw) < 4 * se_sw  # se_sw ~ 0.00034
    assert abs(vc.sd_between - sb) < 4 * se_sb  # se_sb ~ 0.00066
    icc = sb**2 / (sb**2 + sw**2)
    assert abs(vc.icc - icc) < 0.03  # ~4 SEs by the same delta method (SE of the ICC ~ 0.007)


def test_unbalanced_estimators_are_unbiased() -> None:
    """The n0 formula: over 300 planted data sets of 24 starts with 1, 2 or 3 pairs each, the mean of the untruncated
    (MSB - MSW) / n0 is sigma_b^2 and the mean of MSW is sigma_w^2, each within 4 SEs of the replicate mean."""
    sb, sw, sizes = 0.05, 0.04, np.tile([1, 2, 3], 8)
    rng = np.random.default_rng(11)
    raw, msw = [], []
    starts = np.repeat(np.arange(len(sizes)), sizes)
    for _ in range(300):
        values = rng.normal(0, sb, len(sizes))[starts] + rng.normal(0, sw, len(starts))
        vc = pw.variance_components(pd.DataFrame({"start": starts, "diff": values}))
        raw.append(vc.var_between_raw)
        msw.append(vc.msw)
    for est, want in ((np.array(raw), sb**2), (np.array(msw), sw**2)):
        assert abs(est.mean() - want) < 4 * est.std(ddof=1) / math.sqrt(len(est))


# --- starts needed and the detectable difference ---------------------------------------------------------------


def _by_hand(sb: float, sw: float, mde: float, m: int, alpha: float, sides: int) -> int:
    """The fewest C with power >= 0.8 by the noncentral t: P(T'_(C-1, d sqrt C) beyond the t critical value)."""
    d = mde / math.sqrt(sb**2 + sw**2 / m)
    for C in range(2, 10_000):
        crit = stats.t.isf(alpha / sides, C - 1)
        nc = d * math.sqrt(C)
        p = stats.nct.sf(crit, C - 1, nc) + (stats.nct.cdf(-crit, C - 1, nc) if sides == 2 else 0.0)
        if p >= 0.8:
            return C
    raise AssertionError("not found")


@pytest.mark.parametrize(
    ("sb", "sw", "mde", "m", "want"),
    [(0.04, 0.03, 0.05, 2, 9), (0.04, 0.03, 0.05, 1, 10), (0.02, 0.05, 0.03, 2, 17), (0.0, 0.15, 0.05, 1, 73)],
)
def test_starts_needed_by_hand(sb: float, sw: float, mde: float, m: int, want: int) -> None:
    assert pw.starts_needed(sb, sw, mde, m) == want == _by_hand(sb, sw, mde, m, 0.05, 2)
    assert pw.starts_needed(sb, sw, mde, m, alpha=0.025, sides=1) == _by_hand(sb, sw, mde, m, 0.025, 1)


def test_starts_needed_near_the_normal_approximation() -> None:
    # sd of a start mean sqrt(0.04^2 + 0.03^2 / 2) = 0.0453, d = 1.104: ((z_.975 + z_.8) / d)^2 = 6.4, plus
    # z_.975^2 / 2 = 1.9 for the t (Guenther 1981) = 8.4 -> 9
    sd = math.sqrt(0.04**2 + 0.03**2 / 2)
    z = stats.norm.isf(0.025) + stats.norm.isf(0.2)
    approx = (z * sd / 0.05) ** 2 + stats.norm.isf(0.025) ** 2 / 2
    assert pw.starts_needed(0.04, 0.03, 0.05, 2) == math.ceil(approx)
    assert pw.starts_needed(0.04, 0.03, 10.0, 2) == 2  # at least 2
    assert pw.starts_needed(0.0, 0.0, 0.01, 2) == 2


def test_detectable_difference_is_the_inverse() -> None:
    previous = math.inf
    for C in (3, 6, 12, 36):
        mde = pw.detectable_difference(0.04, 0.03, C, 2)
        assert pw.starts_needed(0.04, 0.03, mde, 2) == C
        assert pw.starts_needed(0.04, 0.03, mde * 0.999, 2) == C + 1  # just below it: one start more
        assert pw.power_at(0.04, 0.03, mde, C, 2) == pytest.approx(0.8, abs=1e-9)
        assert mde < previous
        previous = mde
    assert math.isnan(pw.detectable_difference(0.04, 0.03, 1, 2))


def test_cheaper_design() -> None:
    # starts needed 10 at 1 seed, 9 at 2 (above); warm-up 600 s, run 60 s: 10 x (600 + 120) = 7200 s against
    # 9 x (600 + 240) = 7560 s -> 1 seed. Break-even warm-up 60 (4 x 9 - 2 x 10) / (10 - 9) = 960 s.
    d = pw.cheaper_design(0.04, 0.03, 0.05, warmup_s=600, run_s=60)
    one, two = d.designs
    assert (one.starts, one.runs, one.cost_s) == (10, 20, 7200)
    assert (two.starts, two.runs, two.cost_s) == (9, 36, 7560)
    assert d.cheaper == 1
    assert d.break_even_warmup_s == pytest.approx(960)
    assert pw.cheaper_design(0.04, 0.03, 0.05, warmup_s=1000, run_s=60).cheaper == 2
    # no start-to-start spread: 2 seeds halve the starts (73 -> 38) and cost about the same in runs
    flat = pw.cheaper_design(0.0, 0.15, 0.05, warmup_s=0, run_s=68)
    assert [x.starts for x in flat.designs] == [73, 38]


# --- the interval on start means ---------------------------------------------------------------------------------


@pytest.mark.parametrize("icc", [0.5, 0.9])
def test_t_interval_covers_at_six_starts(icc: float) -> None:
    """6 starts x 2 seeds, 4,000 planted data sets: the 95% t interval on start means covers the true mean at 0.95
    within 4 Monte Carlo SEs (sqrt(0.95 x 0.05 / 4000) = 0.0034). Exact in theory: the start means are iid normal."""
    R, C, m, total = 4000, 6, 2, 0.05
    sb, sw = math.sqrt(icc) * total, math.sqrt(1 - icc) * total
    rng = np.random.default_rng(int(icc * 100))
    mu = 0.03
    means = mu + rng.normal(0, sb, (R, C)) + rng.normal(0, sw, (R, C, m)).mean(-1)
    _, lo, hi, _, _ = pw.t_interval(means)
    coverage = np.mean((lo <= mu) & (mu <= hi))
    assert abs(coverage - 0.95) < 4 * math.sqrt(0.95 * 0.05 / R)


def test_interval_excludes_zero_exactly_when_the_t_test_rejects() -> None:
    rng = np.random.default_rng(3)
    means = rng.normal(rng.normal(0, 0.03, (3000, 1)), 0.04, (3000, 6))  # about half the data sets reject
    _, lo, hi, t, p = pw.t_interval(means)
    excludes = (lo > 0) | (hi < 0)
    assert np.array_equal(excludes, p < 0.05)
    assert 0.2 < excludes.mean() < 0.8
    # the scipy test it is, on the start means of a frame of pairs (2 seeds per start; one start with one)
    d = np.array([0.1, 0.2, -0.05, 0.0, 0.3, 0.1, 0.05, 0.15, 0.2, 0.1, 0.12])
    starts = ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e", "f"]
    iv = pw.start_mean_interval(d, starts)
    m = clustered.cluster_means(d, starts)
    assert m == pytest.approx([0.15, -0.025, 0.2, 0.1, 0.15, 0.12])
    ref = stats.ttest_1samp(m, 0.0)
    assert (iv.t, iv.p_value, iv.df, iv.n_starts) == pytest.approx((ref.statistic, ref.pvalue, 5, 6))
    half = stats.t.isf(0.025, 5) * m.std(ddof=1) / math.sqrt(6)
    assert (iv.lo, iv.hi) == pytest.approx((m.mean() - half, m.mean() + half))
    assert math.isnan(pw.start_mean_interval([0.1, 0.2], ["a", "a"]).lo)


# --- a contrast from per-run outcomes ----------------------------------------------------------------------------


def _runs(rng: np.random.Generator, starts: int = 8, seeds: int = 2) -> pd.DataFrame:
    rows = []
    for s in range(starts):
        level = rng.normal(0, 0.1)  # the start's own accuracy change, shared by both arms
        effect = rng.normal(0.05, 0.03)  # the start's true difference
        for k in range(seeds):
            seed = s + starts * k
            for arm, shift in (("grpo+anchored-x", effect), ("moe", 0.0)):
                for lr in (1e-4, 4e-4):
                    v = level + shift + rng.normal(0, 0.02) + (lr == 4e-4) * 0.3
                    rows.append({"rung": arm, "start": f"s{s}", "seed": seed, "lr": lr, "value": v, "wall_s": 50.0})
    return pd.DataFrame(rows)


def test_contrast_power_pairs_on_start_and_seed_within_strata() -> None:
    runs = _runs(np.random.default_rng(0))
    col, a, b = pw.arm_column(runs, "grpo+anchored-x-moe")
    assert (col, a, b) == ("rung", "grpo+anchored-x", "moe")  # a name holding '-' splits where both sides exist
    assert pw.strata(runs, a, b, col, ["lr", "seed", "start"]) == ["lr"]
    with pytest.raises(ValueError, match="several runs"):
        pw.contrast_power(runs, a, b, by=col)
    rows = pw.contrast_power_table(runs, a, b, within=["lr"], by=col, mde=0.05)
    assert [r.stratum for r in rows] == [{"lr": 1e-4}, {"lr": 4e-4}]
    r = rows[0]
    at = runs[runs["lr"] == 1e-4]
    pairs = pw.paired_differences(at, a, b, by=col)
    assert len(pairs) == 16 and r.components.n_pairs == 16 and r.components.n_starts == 8
    assert r.components == pw.variance_components(pairs)
    assert r.starts_needed == {
        m: pw.starts_needed(r.components.sd_between, r.components.sd_within, 0.05, m) for m in (1, 2)
    }
    assert r.detectable == pytest.approx(
        pw.detectable_difference(r.components.sd_between, r.components.sd_within, 8, 2)
    )
    assert r.run_s == 50.0 and r.design is not None  # the runs' median wall_s
    assert r.interval.mean == pytest.approx(pairs.groupby("start")["diff"].mean().mean())
    assert any("starts needed" in line for line in pw.describe(r))
    with pytest.raises(KeyError):
        pw.arm_column(runs, "moe-dense")
    with pytest.raises(KeyError):  # only the named column
        pw.arm_column(runs.rename(columns={"rung": "arm_file"}), "grpo+anchored-x-moe", ["arm"], others=False)
    assert pw.arm_column(runs.rename(columns={"rung": "arm_file"}), "grpo+anchored-x-moe")[0] == "arm_file"


def _write_run(root: Path, rung: str, seed: int, member: int, acc: list[float]) -> None:
    run = f"rung={rung},seed={seed}"
    d = root / run
    d.mkdir(parents=True)
    rows = [(step, "task/accuracy", a) for step, a in zip(range(0, 10 * len(acc), 10), acc)]
    frame = pd.DataFrame(rows, columns=["step", "key", "value"])
    keys = {"run": run, "experiment": "causal", "arm": "grpo+none", "seed": seed, "lr": 4e-4, "rung": rung}
    for col, value in reversed(keys.items()):
        frame.insert(0, col, value)
    frame.to_parquet(d / "metrics.parquet", index=False)
    meta = {"seed": seed, "run_keys": keys, "cold_start": {"key": f"start{member}"}}
    (d / "meta.json").write_text(json.dumps(meta))
    (d / "status.json").write_text(json.dumps({"status": "completed", "collapse_events": [], "wall_s": 40.0}))


def test_power_command_on_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moe_rl.report import main

    rng = np.random.default_rng(5)
    for member in range(6):
        for seed in (member, member + 6):
            base = 0.4 + rng.normal(0, 0.05)
            for rung, shift in (("anchored", 0.05), ("moe", 0.0)):
                late = base - 0.1 + shift + rng.normal(0, 0.02)
                _write_run(tmp_path, rung, seed, member, [base, base, late, late, late])
    assert main(["--power", str(tmp_path), "--contrast", "anchored-moe", "--warmup-s", "100"]) == 0
    out = capsys.readouterr().out
    assert "rung anchored against moe" in out
    assert "12 pairs from 6 starts" in out
    assert "at 1 seed per start" in out and "at 2 seeds per start" in out
    assert "warm-up 100 s, run 40.0 s" in out
    assert main(["--power", str(tmp_path), "--contrast", "anchored-dense"]) == 1
    assert main(["--power", str(tmp_path), "--contrast", "anchored-moe", "--by", "arm"]) == 1  # arm: grpo+none
