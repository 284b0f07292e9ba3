"""The drift forecast: boundary movement against a brute-force loop, the curve and prediction formulas
against hand-computed and brute-force values, and a smoke run of `python -m moe_rl.forecast`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import DRIFT_BASE, DRIFT_VARIED, ROOT, planted_routes

from moe_rl.forecast import main as forecast_main
from moe_rl.metrics.bins import MOVE_EDGES
from moe_rl.routing.compare import boundary_gaps, boundary_movement, movement_finalize, movement_parts
from moe_rl.studies.forecast_fit import (
    SIGMA_KEY,
    bin_index,
    fit_decay,
    flip_curve,
    move_counts,
    movement_decay,
    point_ratios,
    predict_flips,
    predicted_vs_measured,
    residual_dependence,
    shifted_rate,
    sigma_for_rate,
    window_forecast,
    window_points,
)


def test_boundary_gaps_by_hand() -> None:
    scores = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.6, 0.3]])
    gap, experts = boundary_gaps(scores, 1)
    assert gap.tolist() == pytest.approx([math.log(0.5 / 0.3), math.log(0.6 / 0.3)])
    assert experts.tolist() == [[0, 2], [1, 2]]
    gap2, experts2 = boundary_gaps(scores, 2)
    assert gap2.tolist() == pytest.approx([math.log(0.3 / 0.2), math.log(0.3 / 0.1)])
    assert experts2.tolist() == [[2, 1], [2, 0]]
    with pytest.raises(ValueError, match="0 < k < experts"):
        boundary_gaps(scores, 3)


def test_boundary_movement_matches_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    B, T, L, E, k = 3, 5, 2, 6, 2
    old_scores = torch.softmax(torch.randn(B, T, L, E, generator=g), -1)
    new_scores = torch.softmax(old_scores.log() + 0.3 * torch.randn(B, T, L, E, generator=g), -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, 0] = False
    old, new = (planted_routes(scores.topk(k, dim=-1).indices, mask, E) for scores in (old_scores, new_scores))
    sigma, sigma_layer, n, flips = boundary_movement(old_scores, new_scores, old, new)

    deltas, gaps, flipped = [[] for _ in range(L)], [[] for _ in range(L)], [[] for _ in range(L)]
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            for layer in range(L):
                p_old, p_new = old_scores[b, t, layer].double(), new_scores[b, t, layer].double()
                order = sorted(range(E), key=lambda e: -p_old[e].item())
                ek, ek1 = order[k - 1], order[k]
                gap = math.log(p_old[ek] / p_old[ek1])
                deltas[layer].append(math.log(p_new[ek] / p_new[ek1]) - gap)
                gaps[layer].append(gap)
                flipped[layer].append(set(order[:k]) != set(sorted(range(E), key=lambda e: -p_new[e].item())[:k]))
    all_d = [d for layer in deltas for d in layer]
    assert sigma.item() == pytest.approx(math.sqrt(sum(d * d for d in all_d) / len(all_d)), rel=1e-9)
    want_layer = [math.sqrt(sum(d * d for d in deltas[i]) / len(deltas[i])) for i in range(L)]
    assert sigma_layer.tolist() == pytest.approx(want_layer, rel=1e-9)
    want_n, want_flips = [0] * (len(MOVE_EDGES) - 1), [0] * (len(MOVE_EDGES) - 1)
    for layer in range(L):
        for gap, f in zip(gaps[layer], flipped[layer]):
            x = gap / want_layer[layer]
            b = max(i for i in range(len(MOVE_EDGES) - 1) if MOVE_EDGES[i] <= x)
            want_n[b] += 1
            want_flips[b] += int(f)
    assert n.tolist() == want_n and flips.tolist() == want_flips
    assert sum(want_flips) > 0  # the perturbation is large enough to flip something

    metrics = movement_finalize(movement_parts(old_scores, new_scores, old, new))  # the loop's path, one process
    assert metrics["old_vs_new/move/rms"] == pytest.approx(sigma.item())
    assert [metrics[f"old_vs_new/move/layer_{i}"] for i in range(L)] == pytest.approx(want_layer, rel=1e-9)
    assert [metrics[f"flip_vs_margin/move/n/bin_{b}"] for b in range(len(want_n))] == want_n
    assert [metrics[f"flip_vs_margin/move/flips/bin_{b}"] for b in range(len(want_n))] == want_flips


def test_no_movement_puts_every_pair_at_infinite_x() -> None:
    scores = torch.softmax(torch.randn(2, 3, 2, 5, generator=torch.Generator().manual_seed(1)), -1)
    routes = planted_routes(scores.topk(2, dim=-1).indices, num_experts=5)
    sigma, sigma_layer, n, flips = boundary_movement(scores, scores.clone(), routes, routes)
    assert sigma.item() == 0.0 and sigma_layer.tolist() == [0.0, 0.0]
    assert n.tolist() == [0] * (len(MOVE_EDGES) - 2) + [12] and flips.sum().item() == 0


def test_predict_flips_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    gaps = rng.exponential(0.05, size=(40, 3))
    sigma = np.array([0.02, 0.05, 0.0])
    curve_p = np.linspace(0.5, 0.0, len(MOVE_EDGES) - 1)
    flip, token = predict_flips(gaps, sigma, curve_p)
    f = np.zeros_like(gaps)
    for t in range(gaps.shape[0]):
        for layer in range(gaps.shape[1]):
            x = gaps[t, layer] / sigma[layer] if sigma[layer] > 0 else math.inf
            f[t, layer] = curve_p[max(i for i in range(len(MOVE_EDGES) - 1) if MOVE_EDGES[i] <= x)]
    assert flip == pytest.approx(f.mean(), rel=1e-12)
    want_token = np.mean([1 - (1 - f[t, 0]) * (1 - f[t, 1]) * (1 - f[t, 2]) for t in range(gaps.shape[0])])
    assert token == pytest.approx(want_token, rel=1e-12)
    assert bin_index(np.array([0.0, 0.1, 0.15, 10.0, math.inf])).tolist() == [0, 1, 1, 11, 11]
    with pytest.raises(ValueError, match="sigma"):
        predict_flips(gaps, sigma[:2], curve_p)


def test_sigma_for_rate_reaches_the_level() -> None:
    gaps = np.random.default_rng(1).exponential(0.05, size=(200, 2))
    sigma = np.array([0.01, 0.02])
    curve_p = np.array([0.45, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05, 0.02, 0.005, 0.001, 0.0])
    c = sigma_for_rate(gaps, sigma, curve_p, 0.2)
    assert (
        predict_flips(gaps, sigma * c * 1.001, curve_p)[0] >= 0.2 > predict_flips(gaps, sigma * c / 1.001, curve_p)[0]
    )
    assert sigma_for_rate(gaps, sigma, curve_p, 0.5) == math.inf  # above the curve's ceiling


def _frame(points: dict[tuple, list[tuple[int, int]]]) -> pd.DataFrame:
    """Long-format rows of the move counts: {(E, k, L, lr, seed): [(n, flips) per bin]} at steps 11 and 12."""
    rows = []
    for (E, k, L, lr, seed), bins in points.items():
        run = f"E{E}k{k}L{L}lr{lr}s{seed}"
        for step in (5, 11, 12):
            for b, (n, f) in enumerate(bins):
                keys = dict(run=run, seed=seed, num_experts=E, top_k=k, num_moe_layers=L, lr=lr, step=step)
                rows.append({**keys, "key": f"route/flip_vs_margin/move/n/bin_{b}", "value": float(n)})
                rows.append({**keys, "key": f"route/flip_vs_margin/move/flips/bin_{b}", "value": float(f)})
        rows.append({**keys, "key": "route/flip_vs_margin/n/bin_0", "value": 1.0})  # another curve: ignored
    return pd.DataFrame(rows)


def test_curve_and_prediction_by_hand() -> None:
    df = _frame(
        {
            (64, 8, 4, 1e-4, 0): [(100, 40), (300, 30)] + [(0, 0)] * 10,
            (8, 2, 2, 1e-4, 0): [(50, 10), (100, 20)] + [(0, 0)] * 10,
        }
    )
    counts = move_counts(df)  # steps 11 and 12 only
    assert counts.groupby("bin")["n"].sum().iloc[:2].tolist() == [300, 800]
    curve = flip_curve(counts)
    assert curve["p"].iloc[:2].tolist() == pytest.approx([100 / 300, 100 / 800])
    assert np.isnan(curve["p"].iloc[2]) and curve["x_lo"].iloc[1] == MOVE_EDGES[1]
    runs = predicted_vs_measured(counts, curve).set_index("num_experts")
    # E=8: 2 x (50 p0 + 100 p1) expected flips over 2 x 30 measured
    assert runs.loc[8, "predicted"] == pytest.approx((50 / 3 + 100 / 8) / 150)
    assert runs.loc[8, "measured"] == pytest.approx(30 / 150)
    points = point_ratios(predicted_vs_measured(counts, curve))
    assert points["expected"].sum() == pytest.approx(points["flips"].sum())  # the curve reproduces its own data


def test_a_universal_curve_leaves_no_residual_dependence() -> None:
    """Counts drawn from one curve, whatever the geometry: the residual exponents are ~0."""
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001, 0.0, 0.0])
    points = {}
    for E, k, L, lr in [DRIFT_BASE, *DRIFT_VARIED]:
        for seed in range(3):
            n = rng.integers(50_000, 100_000, size=len(p))
            points[(E, k, L, lr, seed)] = list(zip(n.tolist(), rng.binomial(n, p).tolist()))
    counts = move_counts(_frame(points))
    runs = predicted_vs_measured(counts, flip_curve(counts))
    fit = residual_dependence(runs, n_boot=200)
    for f in ("log_E", "log_k", "log_L", "log_lr"):
        assert abs(fit["coef"][f]) < 0.01
        assert fit["coef_ci"][f][0] <= 0 <= fit["coef_ci"][f][1] or abs(fit["coef"][f]) < 0.005
    assert runs["ratio"].between(0.97, 1.03).all()


CURVE_P = np.array([0.5, 0.44, 0.37, 0.3, 0.22, 0.15, 0.08, 0.04, 0.018, 0.005, 0.0006, 0.0])


def _window_frame(runs: dict[tuple, dict]) -> pd.DataFrame:
    """Long-format rows: {(E, k, L, lr, seed): {"probe": (sigma, {bin: (n, flips)}), "window": (...)}},
    written at every step of the probe (1-3) and of the window (11-40), and step 5 (in neither)."""
    rows = []
    for (E, k, L, lr, seed), parts in runs.items():
        keys = dict(run=f"E{E}k{k}L{L}lr{lr}s{seed}", seed=seed, num_experts=E, top_k=k, num_moe_layers=L, lr=lr)
        for part, steps in (("probe", range(1, 4)), ("window", range(11, 41)), ("other", [5])):
            sigma, bins = parts.get(part, (1.0, {0: (1000, 1000)}))
            for step in steps:
                rows.append({**keys, "step": step, "key": SIGMA_KEY, "value": sigma})
                for b in range(len(MOVE_EDGES) - 1):
                    n, f = bins.get(b, (0, 0))
                    rows.append(
                        {**keys, "step": step, "key": f"route/flip_vs_margin/move/n/bin_{b}", "value": float(n)}
                    )
                    rows.append(
                        {**keys, "step": step, "key": f"route/flip_vs_margin/move/flips/bin_{b}", "value": float(f)}
                    )
    return pd.DataFrame(rows)


def test_movement_decay_and_its_fit_by_hand() -> None:
    df = _window_frame(
        {
            (64, 8, 4, 1e-4, 0): {"probe": (0.04, {}), "window": (0.02, {})},
            (64, 8, 4, 1e-4, 1): {"probe": (0.05, {}), "window": (0.04, {})},
        }
    )
    decay = movement_decay(df).set_index("seed")
    assert decay.loc[0, "sigma_probe"] == pytest.approx(0.04) and decay.loc[0, "sigma_window"] == pytest.approx(0.02)
    assert decay["decay"].tolist() == pytest.approx([0.5, 0.8])  # step 5 (sigma 1) is in neither range
    fit = fit_decay(decay["decay"])
    assert fit["decay"] == pytest.approx(math.sqrt(0.5 * 0.8)) and [fit["min"], fit["max"]] == pytest.approx([0.5, 0.8])
    assert fit["log_sd"] == pytest.approx(abs(math.log(0.8 / 0.5)) / math.sqrt(2))
    assert movement_decay(df, probe=(1, 1), window=(5, 5))["decay"].tolist() == pytest.approx([25.0, 20.0])
    with pytest.raises(ValueError, match="> 0"):
        fit_decay([0.5, 0.0])


def test_shifted_rate_moves_pairs_across_bins() -> None:
    n = np.zeros(len(MOVE_EDGES) - 1)
    n[6] = 100  # every pair at x in [1, 1.5)
    assert shifted_rate(n, CURVE_P, 1.0) == pytest.approx(CURVE_P[6])
    assert shifted_rate(n, CURVE_P, 0.5) == pytest.approx(CURVE_P[8])  # x / 0.5 in [2, 3)
    # x / 0.75 in [1.33, 2): a quarter below 1.5, three quarters in [1.5, 2)
    assert shifted_rate(n, CURVE_P, 0.75) == pytest.approx(0.25 * CURVE_P[6] + 0.75 * CURVE_P[7])
    assert shifted_rate(n, CURVE_P, 2.0) == pytest.approx((51 * CURVE_P[4] + 13 * CURVE_P[5]) / 64)  # [0.5, 0.75)
    n2 = np.zeros_like(n)
    n2[[0, 11]] = [30, 70]  # [0, 0.1) and [10, inf)
    assert shifted_rate(n2, CURVE_P, 1.0) == pytest.approx((30 * CURVE_P[0] + 70 * CURVE_P[11]) / 100)
    # x / 0.5 on [0, 0.1) lands in [0, 0.2): half in each bin; [10, inf) stays in the last bin
    assert shifted_rate(n2, CURVE_P, 0.5) == pytest.approx(30 * (CURVE_P[0] + CURVE_P[1]) / 2 / 100)
    assert shifted_rate(n2, CURVE_P, 4.0) == pytest.approx((30 * CURVE_P[0] + 70 * CURVE_P[8]) / 100)  # 10 / 4
    with pytest.raises(ValueError, match="factor > 0"):
        shifted_rate(n, CURVE_P, 0.0)
    with pytest.raises(ValueError, match="no \\(token"):
        shifted_rate(np.zeros_like(n), CURVE_P, 1.0)


def test_window_forecast_of_planted_runs() -> None:
    """Probe pairs at x in [1, 1.5); the movement halves by the window, so the window's pairs sit at
    x in [2, 3). Run A's window flips as the curve says, run B's twice as often."""
    curve = pd.DataFrame({"bin": range(len(CURVE_P)), "p": CURVE_P})
    probe = (0.04, {6: (1000, 80)})
    runs = {
        (64, 8, 4, 1e-4, 0): {"probe": probe, "window": (0.02, {8: (500, 9)})},
        (64, 8, 4, 1e-4, 1): {"probe": probe, "window": (0.02, {8: (1500, 54)})},
        (8, 2, 2, 1e-4, 0): {"probe": probe, "window": (0.03, {8: (1000, 36)})},
    }
    df = _window_frame(runs)
    probe_counts = move_counts(df, start_step=1, end_step=3)
    window_counts = move_counts(df, start_step=11, end_step=40)
    assert probe_counts.groupby("run")["n"].sum().tolist() == [3000] * 3
    assert sorted(window_counts.groupby("run")["n"].sum().tolist()) == [15000, 30000, 45000]
    decay = movement_decay(df)
    out = window_forecast(probe_counts, window_counts, curve, decay, 0.5).set_index(["num_experts", "seed"])
    a, b, c = out.loc[(64, 0)], out.loc[(64, 1)], out.loc[(8, 0)]
    assert a["probe_measured"] == pytest.approx(0.08) and a["probe_curve"] == pytest.approx(CURVE_P[6])
    assert a["window_forecast"] == pytest.approx(CURVE_P[8]) and a["window_measured"] == pytest.approx(9 / 500)
    assert b["window_measured"] == pytest.approx(54 / 1500)
    assert c["decay"] == pytest.approx(0.75)
    assert c["window_own_decay"] == pytest.approx(0.25 * CURVE_P[6] + 0.75 * CURVE_P[7])
    points = window_points(out.reset_index()).set_index("num_experts")
    # E=64: forecast 1.8% for both seeds; measured (9 + 54) x 30 / (2000 x 30) = 3.15%
    assert points.loc[64, "window_measured"] == pytest.approx(63 / 2000)
    assert points.loc[64, "ratio"] == pytest.approx(CURVE_P[8] / (63 / 2000))
    assert points.loc[64, "decay"] == pytest.approx(0.5) and points.loc[64, "seeds"] == 2
    assert points.loc[64, "ratio_probe_curve"] == pytest.approx(CURVE_P[6] / (63 / 2000))
    assert points.loc[8, "ratio"] == pytest.approx(CURVE_P[8] / 0.036)  # flips twice what the curve says
    assert points.loc[8, "ratio_own_decay"] == pytest.approx((0.25 * CURVE_P[6] + 0.75 * CURVE_P[7]) / 0.036)


def test_fit_window_fits_the_decay_on_the_fit_runs_only() -> None:
    from moe_rl.studies.forecast_report import fit_window

    curve = pd.DataFrame({"bin": range(len(CURVE_P)), "p": CURVE_P})
    probe = (0.04, {6: (1000, 80)})
    df = _window_frame(
        {
            (64, 8, 4, 1e-4, 0): {"probe": probe, "window": (0.02, {8: (1000, 18)})},  # fit set
            (64, 8, 4, 1e-3, 0): {"probe": probe, "window": (0.01, {8: (1000, 9)})},  # held out (lr)
            (8, 2, 2, 1e-4, 0): {"probe": probe, "window": (0.02, {8: (1000, 36)})},  # held out (corner)
        }
    )
    fit_runs = pd.Index(["E64k8L4lr0.0001s0"])
    w = fit_window(df, curve, fit_runs)["window"]
    assert w["decay"]["decay"] == pytest.approx(0.5) and w["decay"]["n_runs"] == 1
    assert w["steps"] == [11, 40] and w["probe_steps"] == [1, 3] and w["held_out_points"] == 2
    ratios = sorted(p["ratio"] for p in w["points"] if not p["fitted"])
    assert ratios == pytest.approx([0.5, 2.0])  # both miss 1.3x: reported, not tuned away
    assert w["held_out_within_1.3x"] == 0 and w["held_out_ratio_range"] == pytest.approx([0.5, 2.0])
    fitted = next(p for p in w["points"] if p["fitted"])
    assert fitted["ratio"] == pytest.approx(1.0) and fitted["ratio_probe_curve"] == pytest.approx(CURVE_P[6] / 0.018)


@pytest.mark.slow
def test_forecast_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m moe_rl.forecast` on a tiny preset: a forecast next to the probe's own measurement. Its `main` runs
    in this process from the repository root (the probe trains in process either way: no interpreter to start)."""
    curve = pd.DataFrame(
        {
            "bin": range(len(MOVE_EDGES) - 1),
            "x_lo": MOVE_EDGES[:-1],
            "x_hi": MOVE_EDGES[1:],
            "p": [0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.06, 0.03, 0.01, 0.003, 0.0005, 0.0],
        }
    )
    curve.to_csv(tmp_path / "curve.csv", index=False)
    window = {"probe_steps": [1, 1], "steps": [11, 40], "decay": {"decay": 0.5}, "held_out_within_1.3x": 4}
    fit = {"experts_per_flip": {"mean": 1.0}, "window": {**window, "held_out_points": 5}}
    (tmp_path / "fit.json").write_text(json.dumps({**fit, "held_out_ratio_range": [0.9, 1.1]}))
    out = tmp_path / "forecast.json"
    argv = [
        "+preset=smoke",
        "model=qwen3_moe_fine",
        "model.num_layers=2",
        f"cold_start.cache_dir={tmp_path / 'cache'}",
        "cold_start.max_steps=60",
        "cold_start.eval_every=60",
        "--lr",
        "3e-4",
        "--probe-steps",
        "1",
        "--curve",
        str(tmp_path / "curve.csv"),
        "--json",
        str(out),
    ]
    monkeypatch.chdir(ROOT)  # the default config folder is relative to it
    forecast_main(argv)
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["geometry"] == {"num_experts": 64, "top_k": 8, "num_moe_layers": 2, "lr": 3e-4}
    assert len(doc["sigma"]) == 2 and all(s > 0 for s in doc["sigma"])
    predicted = doc["predicted"]["route/old_vs_new/flip_rate/offpolicy"]
    assert 0 < predicted <= 0.4 and 0 <= doc["predicted"]["route/old_vs_new/token_flip_rate/offpolicy"] <= 1
    gauss = doc["predicted_gaussian"]["route/old_vs_new/expert_flip_frac/offpolicy"]
    assert 0 < gauss < 1 and doc["movement_factor_for_paper_level"] > 0
    assert "gaussian" in printed and "probe: steps 1-1" in printed
    w = doc["window"]
    assert w["steps"] == [11, 40] and w["decay"] == 0.5 and "over steps 11-40 of a run" in printed
    # half the movement on the same gaps: the curve is monotone, so no more flips than at the probe
    assert 0 < w["predicted"]["route/old_vs_new/flip_rate/offpolicy"] <= predicted
    assert w["predicted_gaussian"]["route/old_vs_new/expert_flip_frac/offpolicy"] < gauss


def test_gaussian_model_against_the_normal_cdf() -> None:
    """Two experts, top-1, gap g: the gap moves by N(0, sigma^2), so P(flip) = Phi(-g / sigma)."""
    from scipy.stats import norm

    from moe_rl.studies.forecast_fit import scale_for_level, simulate_flips

    gaps = np.array([0.0, 0.5, 1.0, 2.0])
    logits = np.stack([np.stack([gaps, np.zeros(4)], -1)] * 2000).reshape(-1, 1, 2)  # (8000, 1, 2)
    sim = simulate_flips(logits, np.array([1.0]), 1, draws=5, seed=3)
    want = norm.cdf(-gaps).mean()
    assert sim["flip_rate"] == pytest.approx(want, abs=0.01)
    assert sim["expert_flip_frac"] == pytest.approx(want, abs=0.01)  # k = 1: a flip changes the one expert
    assert simulate_flips(logits, np.array([0.0]), 1)["flip_rate"] == 0.0
    # two layers: a token has a changed layer when either flips (independent noise per layer)
    two = np.concatenate([logits, logits], axis=1)
    p = norm.cdf(-gaps)
    assert simulate_flips(two, np.array([1.0, 1.0]), 1, draws=5)["token_flip_rate"] == pytest.approx(
        (1 - (1 - p) ** 2).mean(), abs=0.01
    )
    c = scale_for_level(logits, np.array([1.0]), 1, 0.3, key="flip_rate")
    assert simulate_flips(logits, np.array([c * 1.02]), 1, draws=2)["flip_rate"] >= 0.3 - 0.005
    with pytest.raises(ValueError, match="0 < k < E"):
        simulate_flips(logits, np.array([1.0]), 2)


def _write_forecast(root: Path, ratio_range: tuple[float, float], factor: float) -> None:
    folder = root / "drift_forecast"
    (folder / "forecasts").mkdir(parents=True, exist_ok=True)
    fit = {
        "held_out_ratio_range": list(ratio_range),
        "held_out_points": 5,
        "held_out_within_1.3x": 4,
        "experts_per_flip": {"mean": 1.0, "max": 1.2, "at_max_flip_rate": 1.2},
        "curve_ceiling": 0.5,
        "sigma_vs_lr_centre": {"a": 3.0, "b": 0.5, "lr": [3e-5, 1e-4, 3e-4, 1e-3]},
    }
    (folder / "fit.json").write_text(json.dumps(fit))
    keys = (
        "route/old_vs_new/flip_rate/offpolicy",
        "route/old_vs_new/expert_flip_frac/offpolicy",
        "route/old_vs_new/token_flip_rate/offpolicy",
    )
    doc = {
        "geometry": {"num_experts": 64, "top_k": 8, "num_moe_layers": 4, "lr": 1e-4},
        "sigma_rms": 0.02,
        "measured_in_probe": dict.fromkeys(keys, 0.01),
        "predicted": dict.fromkeys(keys, 0.011),
        "movement_factor_for_paper_level": factor,
    }
    (folder / "forecasts" / "centre.json").write_text(json.dumps(doc))


def test_claim_one_from_the_forecast(tmp_path: Path) -> None:
    from fake_results import write_fake_fit

    from moe_rl.studies import drift_claims

    write_fake_fit(tmp_path, ci=(0.21, 0.5))  # the power law alone says "not reproduced"
    assert drift_claims.claim_expert_drift(tmp_path).verdict == "not reproduced"
    _write_forecast(tmp_path, (0.85, 1.2), 16.0)
    c = drift_claims.claim_expert_drift(tmp_path)
    assert c.verdict == "untestable here" and c.experiment == "drift_forecast"
    # 16x the movement at lr^0.5 is 16^2 = 256x the lr: 1e-4 * 256
    assert "16x that movement (0.32 logits), i.e. lr ~0.026 for our models" in c.statistic
    assert any("not reproduced" in n for n in c.notes)  # the power law's verdict stays visible
    _write_forecast(tmp_path, (0.6, 1.2), 16.0)
    assert drift_claims.claim_expert_drift(tmp_path).verdict == "inconclusive"
    _write_forecast(tmp_path, (0.9, 1.1), math.inf)
    assert "more than any movement" in drift_claims.claim_expert_drift(tmp_path).statistic
    (tmp_path / "drift_forecast" / "fit.json").write_text("{}")
    assert "lacks" in drift_claims.claim_expert_drift(tmp_path).reason
