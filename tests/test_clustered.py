"""The cluster-aware statistics: runs nest in cold starts, and the start is the unit of replication."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from moe_rl.analysis import clustered


def test_fewer_than_five_starts_are_descriptive() -> None:
    assert clustered.descriptive_reason(4) == "descriptive: 4 independent starts (an interval needs 5)"
    assert clustered.descriptive_reason(1) == "descriptive: 1 independent start (an interval needs 5)"
    assert clustered.descriptive_reason(5) is None


def test_hierarchical_bootstrap_with_identical_runs_is_the_bootstrap_of_start_means() -> None:
    # Runs of one start equal: stage 2 changes nothing, so the replicates are the stage-1 draws of start means.
    means = np.array([0.1, 0.4, -0.2, 0.3, 0.0, 0.25])
    values, starts = np.repeat(means, 2), np.repeat(np.arange(6), 2)
    est, lo, hi = clustered.hierarchical_bootstrap(values, starts, n_resamples=999, seed=3)
    picks = np.random.default_rng(3).integers(0, 6, (999, 6))
    alpha = (1 - 0.95) / 2  # as the routine computes it (0.025 plus a rounding)
    want = np.quantile(means[picks].mean(1), [alpha, 1 - alpha])
    assert est == pytest.approx(means.mean(), abs=1e-15)
    assert (lo, hi) == (float(want[0]), float(want[1]))


def test_hierarchical_bootstrap_weighs_each_start_once() -> None:
    # start a: ten runs at 0; start b: one run at 1 -> mean of start means 0.5, not 1/11.
    est, lo, hi = clustered.hierarchical_bootstrap([0.0] * 10 + [1.0], ["a"] * 10 + ["b"])
    assert est == 0.5
    assert (lo, hi) == (0.0, 1.0)  # two starts: every replicate is 0, 0.5 or 1
    assert math.isnan(clustered.hierarchical_bootstrap([1.0, 2.0], ["a", "a"])[1])


def test_hierarchical_interval_covers_where_a_run_level_interval_does_not() -> None:
    # 6 starts x 2 seeds, intraclass correlation 0.8: resampling runs as independent is too narrow.
    rng = np.random.default_rng(0)
    hits_h = hits_naive = 0
    trials = 300
    for _ in range(trials):
        start_effect = rng.normal(0, math.sqrt(0.8), 6)
        values = np.repeat(start_effect, 2) + rng.normal(0, math.sqrt(0.2), 12)
        starts = np.repeat(np.arange(6), 2)
        _, lo, hi = clustered.hierarchical_bootstrap(values, starts, n_resamples=999)
        hits_h += lo <= 0 <= hi
        boot = values[rng.integers(0, 12, (999, 12))].mean(1)
        nlo, nhi = np.quantile(boot, [0.025, 0.975])
        hits_naive += nlo <= 0 <= nhi
    # binomial sd of a coverage over 300 trials is <= 0.029; the expected gap is ~0.2
    assert hits_h / trials > 0.83
    assert hits_h / trials - hits_naive / trials > 0.1


def test_cluster_sign_flip_by_hand() -> None:
    # start means 1, 2, 3, -0.5 (sum 5.5): of 16 sign patterns two reach >= 5.5 and two <= -5.5
    d = [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, -0.5, -0.5]
    starts = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert clustered.cluster_sign_flip_pvalue(d, starts) == 4 / 16
    assert clustered.cluster_sign_flip_pvalue(d, starts, alternative="greater") == 2 / 16
    assert clustered.cluster_sign_flip_pvalue(d, starts, alternative="less") == 15 / 16
    # the same eight differences as independent pairs: 6 of 256 patterns reach >= 11 (13 less 0, 1 or 2), p = 12 / 256
    assert clustered.cluster_sign_flip_pvalue(d, range(8)) == 12 / 256
    # two starts can never go below p = 0.5
    assert clustered.cluster_sign_flip_pvalue([5.0, 6.0, 7.0, 8.0], [0, 0, 1, 1]) == 0.5


def test_cluster_permutation_matches_scipy_on_start_means() -> None:
    a, ca = [1.0, 1.2, 2.0, 3.0], ["s0", "s0", "s1", "s2"]  # start means 1.1, 2, 3
    b, cb = [4.0, 5.0, 6.0, 6.4], ["t0", "t1", "t2", "t2"]  # 4, 5, 6.2
    p = clustered.cluster_permutation_pvalue(a, ca, b, cb)
    assert p == 2 / 20  # C(6, 3) splits: only the observed and its mirror are as extreme
    want = sps.permutation_test(
        ([1.1, 2.0, 3.0], [4.0, 5.0, 6.2]),
        lambda x, y, axis=-1: np.mean(x, axis=axis) - np.mean(y, axis=axis),
        permutation_type="independent",
        n_resamples=10**6,
        vectorized=True,
    ).pvalue
    assert p == pytest.approx(want, abs=1e-12)


def test_clustered_compare_pairs_within_start_and_seed_and_refuses_an_interval_below_five_starts() -> None:
    rows = []
    for start in range(6):
        for seed in range(2):
            base = 10.0 * start + seed
            rows += [("grpo", start, seed, base + 1.0 + 0.1 * start), ("r2", start, seed, base)]
    frame = pd.DataFrame(rows, columns=["arm", "start", "seed", "acc"])
    out = clustered.clustered_compare(frame, arm_col="arm", a="grpo", b="r2", value="acc")
    assert (out["n_starts"], out["n_seeds"]) == (6, 12)
    assert out["mean_diff"] == pytest.approx(1.25)  # mean of 1.0 .. 1.5 by start
    assert 1.0 <= out["lo"] < 1.25 < out["hi"] <= 1.5
    assert out["p_value"] == 2 / 64 and out["prob_improvement"] == 1.0 and out["descriptive"] is None
    few = clustered.clustered_compare(frame[frame.start < 4], arm_col="arm", a="grpo", b="r2", value="acc")
    assert few["n_starts"] == 4 and few["mean_diff"] == pytest.approx(1.15)
    assert math.isnan(few["lo"]) and math.isnan(few["p_value"])
    assert few["descriptive"] == "descriptive: 4 independent starts (an interval needs 5)"
    with pytest.raises(ValueError, match="several runs per"):
        clustered.clustered_compare(pd.concat([frame, frame]), arm_col="arm", a="grpo", b="r2", value="acc")


def test_intraclass_correlation_by_hand() -> None:
    assert clustered.intraclass_correlation([1, 1, 3, 3], [0, 0, 1, 1]) == 1.0
    assert clustered.intraclass_correlation([1, 3, 1, 3], [0, 0, 1, 1]) == -1.0
    # MSB = 2 * ((2-3)^2 + (4-3)^2) / 1 = 4, MSW = (0.5 + 0.5) / 2 = 0.5, m0 = 2: (4 - 0.5) / 4.5
    assert clustered.intraclass_correlation([1.5, 2.5, 3.5, 4.5], [0, 0, 1, 1]) == pytest.approx(3.5 / 4.5)


def _outcomes(n_starts: int, seeds: int) -> pd.DataFrame:
    rows = []
    for start in range(n_starts):
        for seed in range(seeds):
            for arm, shift in (("grpo+none", 0.02 * (start + 1)), ("grpo+r2", 0.0)):
                acc = 0.4 + 0.05 * start + 0.01 * seed + shift
                rows.append({"arm": arm, "seed": start * 100 + seed, "start": f"s{start}", "final_accuracy": acc})
    frame = pd.DataFrame(rows)
    return frame.assign(reward_auc=frame["final_accuracy"], collapsed_in_loop=False)


def test_arm_tests_take_the_start_as_the_unit() -> None:
    from moe_rl.analysis.arm_vs_reference import arm_tests, format_arm_tests_markdown

    decided = arm_tests(_outcomes(6, 2), groups=["arm"], pair_on=["seed"]).set_index("arm").loc["grpo+none"]
    assert (decided["final_accuracy_starts"], decided["final_accuracy_pairs"]) == (6, 12)
    assert decided["final_accuracy_diff"] == pytest.approx(0.07)  # mean of 0.02 .. 0.12 over starts
    # the t on the six start means 0.02, 0.04, ..., 0.12 (mean 0.07, SD 0.0374): its p and its interval
    means = 0.02 * np.arange(1, 7)
    half = sps.t.isf(0.025, 5) * means.std(ddof=1) / math.sqrt(6)
    assert decided["final_accuracy_p"] == pytest.approx(2 * sps.t.sf(0.07 / (means.std(ddof=1) / math.sqrt(6)), 5))
    assert decided["final_accuracy_lo"] == pytest.approx(0.07 - half) and decided["final_accuracy_hi"] == pytest.approx(
        0.07 + half
    )
    few = arm_tests(_outcomes(1, 3), groups=["arm"], pair_on=["seed"])
    row = few.set_index("arm").loc["grpo+none"]
    assert row["final_accuracy_starts"] == 1 and row["final_accuracy_diff"] == pytest.approx(0.02)
    assert math.isnan(row["final_accuracy_lo"]) and math.isnan(row["final_accuracy_p"])
    text = format_arm_tests_markdown(few, groups=["arm"])
    assert "| 1 × 3 | +2.0 (descriptive) | — | — |" in text
    # the collapse counts of one start: no Wilson interval and no exact test either
    assert math.isnan(row["collapsed_in_loop_lo"]) and math.isnan(row["collapsed_in_loop_p"])
    assert "| grpo+none | 0 of 3 (descriptive) | — | 1 × 3 |" in text
    assert decided["starts"] == 6 and np.isfinite(decided["collapsed_in_loop_hi"])


def test_seeds_repeated_across_starts_pair_within_each_start() -> None:
    """Every start runs seeds 0 and 1 (as a pool's members do): arm tests join runs of one start only, so each
    start's difference is its own shift (0.02 x (start + 1)), never a cross-start one."""
    from moe_rl.analysis.arm_vs_reference import arm_tests

    frame = _outcomes(6, 2).assign(seed=lambda f: f["seed"] % 100)  # seeds 0, 1 under every start

    def arms(f: pd.DataFrame) -> list[pd.DataFrame]:
        return [g for _, g in f.groupby("arm")]

    assert clustered.pair_keys(arms(frame), ["seed"]) == ["seed", "start"]
    assert clustered.pair_keys(arms(_outcomes(6, 2)), ["seed"]) == ["seed"]  # unique seeds: the seed alone
    row = arm_tests(frame, groups=["arm"], pair_on=["seed"]).set_index("arm").loc["grpo+none"]
    assert (row["final_accuracy_starts"], row["final_accuracy_pairs"]) == (6, 12)
    assert row["final_accuracy_diff"] == pytest.approx(0.07) and row["final_accuracy_p"] < 0.05


def test_run_starts_reads_the_cold_start_key_of_meta(tmp_path) -> None:
    import json

    from moe_rl.analysis.configs import run_starts

    for name, meta, config in (
        ("a", {"cold_start": {"key": "cb1e"}}, "seed: 0\n"),
        ("b", {}, "cold_start:\n  seed: 3\n"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(json.dumps(meta))
        (tmp_path / name / "config.yaml").write_text(config)
    df = pd.DataFrame(
        {"run": ["a", "b"], "seed": [0, 0], "step": [0, 0], "key": ["k", "k"], "value": [1.0, 1.0]}
    ).assign(run_dir=[str(tmp_path / "a"), str(tmp_path / "b")])
    assert run_starts(df).to_dict() == {"a": "cb1e", "b": "cold_seed=3"}


def test_the_sweep_figure_draws_intervals_only_from_five_starts() -> None:
    from moe_rl.analysis.plots import plot_metric_vs_axis

    rng = np.random.default_rng(0)
    rows = [
        {"arm": "grpo+none", "lr": lr, "start": f"s{seed % starts}", "acc": rng.normal(0.4, 0.05), "n": starts}
        for starts in (2, 6)
        for lr in (1e-4, 1e-3)
        for seed in range(12)
    ]
    frame = pd.DataFrame(rows)
    for starts, drawn in ((2, False), (6, True)):
        fig = plot_metric_vs_axis(frame[frame["n"] == starts], {"acc": "accuracy"}, "lr")
        bars = [c for c in fig.axes[0].collections if len(c.get_segments())]
        widths = [abs(seg[1][1] - seg[0][1]) for c in bars for seg in c.get_segments()]
        assert (max(widths) > 0) == drawn, (starts, widths)
