"""Drift-scaling analysis on hand-built inputs with known answers."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from helpers import DRIFT_BASE, DRIFT_VARIED
from scipy import stats

from moe_rl.studies.drift import DRIFT_KEYS, drift_per_run, fit_drift, flip_vs_margin, holdout_check

KEY = DRIFT_KEYS[0]
TRUE = {"intercept": -1.0, "log_E": 0.5, "log_k": -0.3, "log_L": 0.4, "log_lr": 0.8}


def _law(E, k, L, lr):
    return np.exp(
        TRUE["intercept"]
        + TRUE["log_E"] * np.log(E)
        + TRUE["log_k"] * np.log(k)
        + TRUE["log_L"] * np.log(L)
        + TRUE["log_lr"] * np.log(lr)
    )


def _table(noise: float = 0.0, seeds=(0, 1, 2)) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for (E, k, L, lr), s in itertools.product(
        [DRIFT_VARIED[0], DRIFT_BASE, *DRIFT_VARIED[1:]],
        seeds,
    ):
        rows.append(
            {
                "run": f"{E}-{k}-{L}-{lr}-{s}",
                "seed": s,
                "num_experts": E,
                "top_k": k,
                "num_moe_layers": L,
                "lr": lr,
                KEY: _law(E, k, L, lr) * np.exp(noise * rng.standard_normal()),
            }
        )
    return pd.DataFrame(rows)


def test_fit_recovers_a_power_law_exactly() -> None:
    target = pd.DataFrame([{"num_experts": 128, "top_k": 8, "num_moe_layers": 48, "lr": 1e-4}])
    fit = fit_drift(_table(), KEY, n_boot=50, targets=target)
    assert fit["coef"] == pytest.approx(TRUE, abs=1e-9)
    assert fit["r2"] == pytest.approx(1.0)
    assert fit["predicted"][0] == pytest.approx(_law(128, 8, 48, 1e-4))
    # Noise-free data: every bootstrap replicate gives the same fit.
    lo, hi = fit["predicted_ci"][0]
    assert lo == pytest.approx(hi) == pytest.approx(_law(128, 8, 48, 1e-4))


def test_bootstrap_intervals_cover_the_truth_and_widen_with_noise() -> None:
    quiet, noisy = fit_drift(_table(0.05), KEY, n_boot=400), fit_drift(_table(0.3), KEY, n_boot=400)
    for name in TRUE:
        lo, hi = noisy["coef_ci"][name]
        assert lo <= noisy["coef"][name] <= hi
    width = lambda f: f["coef_ci"]["log_E"][1] - f["coef_ci"]["log_E"][0]  # noqa: E731
    assert width(noisy) > 3 * width(quiet)


def test_fit_refuses_too_few_runs_and_unidentified_factors() -> None:
    with pytest.raises(ValueError, match="too few"):
        fit_drift(_table().iloc[:5], KEY)
    only_experts = _table().query("top_k == 8 and num_moe_layers == 4 and lr == 1e-4")
    with pytest.raises(ValueError, match=r"\['log_k', 'log_L', 'log_lr'\] take a single value"):
        fit_drift(only_experts, KEY)


def test_holdout_check_on_a_point_off_the_axes() -> None:
    held = pd.DataFrame(
        [
            {
                "run": "h",
                "seed": 0,
                "num_experts": 8,
                "top_k": 2,
                "num_moe_layers": 2,
                "lr": 1e-4,
                KEY: 2 * _law(8, 2, 2, 1e-4),
            }
        ]
    )  # measured twice the law's value
    check = holdout_check(_table(), held, KEY)
    assert check["points"]["ratio"].iloc[0] == pytest.approx(0.5)
    assert check["rmse_log"] == pytest.approx(np.log(2))


def test_drift_per_run_skips_early_steps() -> None:
    base = {"run": "a", "seed": 0, "num_experts": 8, "top_k": 2, "num_moe_layers": 2, "lr": 1e-4}
    df = pd.DataFrame([{**base, "step": s, "key": KEY, "value": v} for s, v in [(1, 9.0), (11, 1.0), (12, 3.0)]])
    table = drift_per_run(df, [KEY], start_step=11)
    assert table[KEY].tolist() == [2.0]
    assert drift_per_run(df, [KEY], start_step=1)[KEY].tolist() == [pytest.approx(13 / 3)]


def test_flip_vs_margin_pools_counts_and_wilson_matches_scipy() -> None:
    rows = []
    for run, step, b, n, f in [
        ("a", 1, 0, 10, 4),
        ("a", 2, 0, 10, 2),
        ("b", 1, 0, 20, 6),
        ("a", 1, 1, 50, 1),
        ("b", 1, 1, 0, 0),
    ]:
        rows += [
            {"run": run, "step": step, "key": f"route/flip_vs_margin/n/bin_{b}", "value": float(n)},
            {"run": run, "step": step, "key": f"route/flip_vs_margin/flips/bin_{b}", "value": float(f)},
        ]
    rows.append({"run": "a", "step": 1, "key": "route/flip_vs_margin/move/n/bin_0", "value": 99.0})  # another curve
    curve = flip_vs_margin(pd.DataFrame(rows), edges=(0.0, 1e-3, 1.0))
    assert curve["n"].tolist() == [40, 50] and curve["flips"].tolist() == [12, 1]
    assert curve["p"].tolist() == pytest.approx([0.3, 0.02])
    ci = stats.binomtest(12, 40).proportion_ci(0.95, method="wilson")
    assert (curve["p_lo"].iloc[0], curve["p_hi"].iloc[0]) == pytest.approx((ci.low, ci.high))
    # Hand-computed Wilson bound for 1 of 50: (p + z^2/2n - z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)
    z, n, p = 1.959963984540054, 50, 0.02
    low = (p + z * z / (2 * n) - z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)
    assert curve["p_lo"].iloc[1] == pytest.approx(low)
    assert curve["margin_lo"].tolist() == [0.0, 1e-3]


def _fake_drift_folder(root, points, seeds=(0, 1, 2)) -> None:
    """Run folders whose off-policy drift follows the power law exactly (flip-vs-margin counts too)."""
    import json

    for (E, k, L, lr), s in itertools.product(points, seeds):
        run = f"E{E}_k{k}_L{L}_lr{lr}_s{s}"
        keys = {
            "run": run,
            "experiment": "drift_scaling",
            "arm": "grpo+none",
            "seed": s,
            "N": 4,
            "lr": lr,
            "num_moe_layers": L,
            "num_experts": E,
            "top_k": k,
        }
        value = _law(E, k, L, lr)
        rows = [
            {**keys, "step": step, "key": key, "value": value * scale}
            for step in (5, 11, 12)
            for key, scale in zip(DRIFT_KEYS, (1.0, 4.0, 9.0))
        ]
        rows += [
            {**keys, "step": 12, "key": f"route/flip_vs_margin/{kind}/bin_{b}", "value": v}
            for b, (n, f) in enumerate([(100, 30), (100, 5)])
            for kind, v in (("n", n), ("flips", f))
        ]
        (root / run).mkdir(parents=True)
        pd.DataFrame(rows).to_parquet(root / run / "metrics.parquet")
        (root / run / "status.json").write_text(json.dumps({"status": "completed", "collapse_events": []}))


def test_drift_report_end_to_end(tmp_path) -> None:
    import json

    from moe_rl import drift_report

    axes = [DRIFT_BASE, *DRIFT_VARIED[:3], (64, 1, 4, 1e-4), *DRIFT_VARIED[4:]]  # top-k 1 where the design has 4
    _fake_drift_folder(tmp_path / "runs", axes + [(8, 2, 2, 1e-4), (16, 4, 2, 3e-4)])
    # extra seeds on the depth axis (for the depth claim) stay out of the fit: its design stays balanced
    _fake_drift_folder(tmp_path / "runs", [(64, 8, 2, 1e-4), (64, 8, 8, 1e-4)], seeds=(3, 4))
    drift_report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--n-boot", "50", "--wall", "1 min"])
    fit = json.loads((tmp_path / "out" / "fit.json").read_text())
    m = fit["metrics"][DRIFT_KEYS[0]]
    assert m["predicted"] == pytest.approx(_law(128, 8, 48, 1e-4))
    assert m["coef"] == pytest.approx(TRUE)
    assert m["r2_holdout"] == pytest.approx(1.0)  # the corners lie on the law
    assert fit["held_out_runs"] == 6 and fit["fit_runs"] == 8 * 3  # top-1 excluded from the fit
    assert fit["fit_seeds"] == [0, 1, 2]
    points = pd.read_csv(tmp_path / "out" / "points.csv")
    depth = points[(points["num_experts"] == 64) & (points["top_k"] == 8) & (points["lr"] == 1e-4)]
    assert dict(zip(depth["num_moe_layers"], depth["n_seeds"])) == {2: 5, 4: 3, 8: 5}
    assert fit["metrics"][DRIFT_KEYS[1]]["predicted"] == pytest.approx(4 * _law(128, 8, 48, 1e-4))
    # The top-1 point lies on the law here, so the largest measured value is the top-1 one.
    assert m["measured_max"] == pytest.approx(max(_law(*p) for p in axes))
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "Wall time of the sweep on 2 cores: 1 min." in summary and "| [0, 0.0001) | 3700 | 1110 | 30% [" in summary
    for name in ("drift_scaling.png", "flip_vs_margin.png", "points.csv", "drift_table.csv", "flip_vs_margin.csv"):
        assert (tmp_path / "out" / name).stat().st_size > 0
