"""Forecast the routing drift over steps 11-40 of a run from margins and a short probe of the movement.

    python -m moe_rl.forecast +preset=drift_forecast drift_point=hold_big --lr 3e-4
    python -m moe_rl.forecast model.checkpoint=PATH task=dataset task.path=data.jsonl --lr 1e-6
    python -m moe_rl.forecast --fit results/drift_forecast/runs --out results/drift_forecast

Forecast: builds the policy of the config (a preset's cold start, or `model.checkpoint`), samples a
rollout batch of the task, records the old router's k-th vs (k+1)-th logit gaps on it, runs
`--probe-steps` real RL steps at the planned learning rate to measure the movement of that gap per
MoE layer (off-policy updates 2..N, as the drift metrics). The movement is highest in these first
updates and decays as training goes on, so the forecast is for a stated window of the run: steps
11-40 (what the drift sweeps average), with the probe's movement times the decay fitted by `--fit`
(movement over steps 11-40 / movement over steps 1-3, one constant: 0.52 on the `drift_forecast`
fit runs, for a 3-step probe; other probe lengths get no window forecast). It predicts the mean
per-update flip rate, share of activated experts changed and share of tokens with a changed layer
over the window two ways: with the fitted curve F(gap / movement)
(`moe_rl.analysis.forecast.predict_flips`), and with a gaussian model in which every router logit
moves by that amount (`simulate_flips`), which also covers movements large enough to change several
experts of a router at once. Validation on the held-out design points of `drift_forecast`, from each
run's own steps 1-3 to its steps 11-40: forecast / measured flip rate 0.52-1.11, 4 of 5 within
1.3x (the miss, E=8 k=2 L=2, is its gaps changing, not the decay); the probe's curve read as the
run's drift was 1.03-1.89x. The probe's own forecast and measured drift are printed below as a
check, and the factor on the probe's movement at which the gaussian model reaches the GSPO paper's
~10% of activated experts. `--fit` fits the curve on a sweep that logs
`route/flip_vs_margin/move/*` (experiment `drift_forecast`), the decay, and validates both on
design points it was not fitted on.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moe_rl.analysis.drift import GEOMETRY
from moe_rl.analysis.forecast import (
    EXPERT_KEY,
    FLIP_KEY,
    PROBE_STEPS,
    SIGMA_KEY,
    TOKEN_KEY,
    WINDOW,
    fit_decay,
    flip_curve,
    move_counts,
    movement_decay,
    point_ratios,
    power_fit,
    predict_flips,
    predicted_vs_measured,
    residual_dependence,
    scale_for_level,
    sigma_for_rate,
    sigma_vs_lr,
    simulate_flips,
    window_forecast,
    window_points,
)
from moe_rl.run.atomic import write_atomic

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CURVE = ROOT / "results" / "drift_forecast" / "curve.csv"
PAPER_LEVEL = 0.10  # GSPO paper: ~10% of activated experts change per update (Qwen3-30B-A3B)
CENTRE = {"num_experts": 64, "top_k": 8, "num_moe_layers": 4}
# Fitted on the one-factor axes at lr <= 1e-4; validated on the held-out corners and lr 3e-4, 1e-3.
FIT_MAX_LR = 1e-4
HELD_OUT = (
    {"num_experts": 8, "top_k": 2, "num_moe_layers": 2},
    {"num_experts": 16, "top_k": 4, "num_moe_layers": 2},
    {"num_experts": 128, "top_k": 8, "num_moe_layers": 8},
)


# --- the fit over a sweep ---------------------------------------------------------------------------


def is_fit_run(row: pd.Series) -> bool:
    """A run of the fit set: on a one-factor axis (not a held-out corner) at lr <= FIT_MAX_LR."""
    corner = any(all(row[k] == v for k, v in h.items()) for h in HELD_OUT)
    return not corner and row["lr"] <= FIT_MAX_LR * (1 + 1e-9)


def runs_without_signal(df: pd.DataFrame, *, start_step: int = 11) -> list[str]:
    """Runs in which every prompt group had zero reward variance at every step from `start_step`
    (`reward/zero_var_group_frac` = 1): no advantage, so no update moves the router and there is no
    drift to forecast (e.g. a run whose reward fell to 0 for good)."""
    rows = df[(df["key"] == "reward/zero_var_group_frac") & (df["step"] >= start_step)]
    return sorted(rows.groupby("run")["value"].min().loc[lambda v: v >= 1.0].index)


def _within(ratio: pd.Series, tol: float = 1.3) -> int:
    return int(((ratio <= tol) & (ratio >= 1 / tol)).sum())


def fit_window(df: pd.DataFrame, curve: pd.DataFrame, fit_runs: pd.Index) -> dict[str, Any]:
    """The forecast of the window WINDOW from a probe of PROBE_STEPS: the movement decay fitted on the fit
    runs, and per point forecast vs measured on the window (fit points and held-out points)."""
    probe_counts = move_counts(df, start_step=PROBE_STEPS[0], end_step=PROBE_STEPS[1])
    window_counts = move_counts(df, start_step=WINDOW[0], end_step=WINDOW[1])
    decay = movement_decay(df, probe=PROBE_STEPS, window=WINDOW)
    fitted = fit_decay(decay.loc[decay["run"].isin(fit_runs), "decay"])
    runs = window_forecast(probe_counts, window_counts, curve, decay, fitted["decay"])
    points = window_points(runs)
    points["fitted"] = points.apply(is_fit_run, axis=1)
    held = points[~points["fitted"]]
    span = (lambda r: [float(r.min()), float(r.max())]) if len(held) else (lambda r: None)
    summary = {
        "probe_steps": list(PROBE_STEPS),
        "steps": list(WINDOW),
        "decay_model": "sigma_window = decay * sigma_probe, one constant (geometric mean over the fit runs)",
        "decay": fitted,
        "held_out_points": int(len(held)),
        "held_out_ratio_range": span(held["ratio"]),
        "held_out_within_1.3x": _within(held["ratio"]),
        "held_out_probe_curve_ratio_range": span(held["ratio_probe_curve"]),
        "held_out_probe_curve_within_1.3x": _within(held["ratio_probe_curve"]),
        "held_out_own_decay_ratio_range": span(held["ratio_own_decay"]),
        "held_out_decay_range": span(held["decay"]),
        "points": [
            {
                **{k: float(r[k]) for k in GEOMETRY},
                "fitted": bool(r["fitted"]),
                "seeds": int(r["seeds"]),
                **{
                    k: float(r[k])
                    for k in (
                        "decay",
                        "probe_measured",
                        "probe_curve",
                        "window_forecast",
                        "window_measured",
                        "ratio",
                        "ratio_probe_curve",
                        "ratio_own_decay",
                    )
                },
            }
            for _, r in points.iterrows()
        ],
    }
    return {"window_runs": runs, "window_points": points, "window": summary}


def fit_forecast(df: pd.DataFrame, *, start_step: int = 11, n_boot: int = 2000) -> dict[str, Any]:
    """Curve, per-point validation, residual dependence on geometry and lr, movement against lr, and the
    window forecast (`fit_window`)."""
    dead = runs_without_signal(df, start_step=start_step)
    df = df[~df["run"].isin(dead)]
    counts = move_counts(df, start_step=start_step)
    keys = counts.drop_duplicates("run").set_index("run")
    fit_runs = keys[keys.apply(is_fit_run, axis=1)].index
    curve = flip_curve(counts[counts["run"].isin(fit_runs)])
    runs = predicted_vs_measured(counts, curve)
    runs["fitted"] = runs["run"].isin(fit_runs)
    points = point_ratios(runs)
    points["fitted"] = points.apply(is_fit_run, axis=1)
    residual = {}
    for name, subset in (("residual_fit", runs[runs["fitted"]]), ("residual_all", runs)):
        try:
            fit = residual_dependence(subset, n_boot=n_boot)
            residual[name] = {k: fit[k] for k in ("coef", "coef_ci", "r2", "n_runs")}
        except ValueError as err:  # a factor that does not vary in these runs
            residual[name] = {"error": str(err)}
    per_run = sigma_vs_lr(df, start_step=start_step)
    centre = per_run[np.all([per_run[k] == v for k, v in CENTRE.items()], axis=0)]
    a, b = power_fit(centre["lr"], centre[SIGMA_KEY])
    per_run["experts_per_flip"] = per_run[EXPERT_KEY] * per_run["top_k"] / per_run[FLIP_KEY]
    held = points[~points["fitted"]]
    window = fit_window(df, curve, fit_runs)
    return {
        "curve": curve,
        "runs": runs,
        "points": points,
        "per_run": per_run,
        "window_points": window["window_points"],
        "summary": {
            "start_step": start_step,
            "runs_without_signal": dead,
            "fit_runs": int(len(fit_runs)),
            "runs": int(len(keys)),
            "fit_set": f"one-factor axes at lr <= {FIT_MAX_LR:g}",
            "held_out_ratio_range": [float(held["ratio"].min()), float(held["ratio"].max())] if len(held) else None,
            "held_out_within_1.3x": int(((held["ratio"] <= 1.3) & (held["ratio"] >= 1 / 1.3)).sum()),
            "held_out_points": int(len(held)),
            **residual,
            "sigma_vs_lr_centre": {"a": a, "b": b, "lr": sorted(centre["lr"].unique().tolist())},
            "experts_per_flip": {
                "mean": float(per_run["experts_per_flip"].mean()),
                "max": float(per_run["experts_per_flip"].max()),
                "at_max_flip_rate": float(per_run.loc[per_run[FLIP_KEY].idxmax(), "experts_per_flip"]),
            },
            "curve_ceiling": float(curve["p"].max()),
            "window": window["window"],
        },
    }


def _fmt_point(row: pd.Series) -> str:
    return f"E={row['num_experts']:g} k={row['top_k']:g} L={row['num_moe_layers']:g} lr={row['lr']:g}"


def fit_markdown(result: dict[str, Any], wall: str | None = None) -> str:
    s, curve, points = result["summary"], result["curve"], result["points"]
    lines = [
        "# Drift forecast: P(flip) as one curve of margin / movement",
        "",
        f"{s['runs']} runs; counts of the off-policy updates (2..N) of steps >= {s['start_step']}. "
        "x = g / sigma_l: the old router's k-th vs (k+1)-th logit gap over the RMS change of that gap at its "
        f"layer in the update. Curve fitted on {s['fit_runs']} runs ({s['fit_set']}); every other point is "
        "held out.",
    ]
    if s["runs_without_signal"]:
        lines += [
            "",
            f"Left out, no learning signal in the window (zero reward variance in every group at every "
            f"step, so the router does not move): {', '.join(s['runs_without_signal'])}.",
        ]
    if wall:
        lines += ["", f"Wall time of the sweep on 2 cores: {wall}."]
    lines += [
        "",
        "## The curve F(x)",
        "",
        "| x bin | (token, layer) pairs | flips | P(flip) [Wilson 95%] |",
        "|---|---|---|---|",
    ]
    for _, r in curve.iterrows():
        p = "—" if not np.isfinite(r["p"]) else f"{100 * r['p']:.3g}% [{100 * r['p_lo']:.3g}%, {100 * r['p_hi']:.3g}%]"
        lines.append(f"| [{r['x_lo']:g}, {r['x_hi']:g}) | {int(r['n'])} | {int(r['flips'])} | {p} |")
    lines += [
        "",
        "## Predicted / measured flip rate per design point, at the window's own movement",
        "",
        "Prediction: sum over x bins of the point's own (token, layer) count times F, over its count. This "
        "checks the curve given the movement measured in the same steps; it is not a forecast of a run (that "
        "is the next section).",
        "",
        "| design point | fitted | seeds | measured | predicted | predicted / measured (seed range) |",
        "|---|---|---|---|---|---|",
    ]
    for _, r in points.sort_values(["fitted", *GEOMETRY], ascending=[False, True, True, True, True]).iterrows():
        lines.append(
            f"| {_fmt_point(r)} | {'yes' if r['fitted'] else 'held out'} | {r['seeds']} | "
            f"{100 * r['measured']:.3g}% | {100 * r['predicted']:.3g}% | "
            f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |"
        )
    lo_hi = s["held_out_ratio_range"]
    if lo_hi:
        lines += [
            "",
            f"Held out: {s['held_out_within_1.3x']} of {s['held_out_points']} points within 1.3x "
            f"(ratios {lo_hi[0]:.2f}-{lo_hi[1]:.2f}).",
        ]
    lines += _window_markdown(s["window"], result["window_points"])
    lines += [
        "",
        "## Do geometry and lr still matter once x is in?",
        "",
        "Power law of each run's predicted / measured ratio in E, k, L and lr (95% intervals from a bootstrap "
        "over seeds); an exponent whose interval holds 0 says the factor no longer matters.",
        "",
        "| runs | bE | bk | bL | blr | R² |",
        "|---|---|---|---|---|---|",
    ]
    for name, fit in (("fit set", s["residual_fit"]), ("all", s["residual_all"])):
        if "error" in fit:
            lines.append(f"| {name} | not identified: {fit['error']} | | | | |")
            continue
        cells = [
            f"{fit['coef'][f]:+.2f} [{fit['coef_ci'][f][0]:+.2f}, {fit['coef_ci'][f][1]:+.2f}]"
            for f in ("log_E", "log_k", "log_L", "log_lr")
        ]
        lines.append(f"| {name} ({fit['n_runs']}) | " + " | ".join(cells) + f" | {fit['r2']:.2f} |")
    sv = s["sigma_vs_lr_centre"]
    ep = s["experts_per_flip"]
    lines += [
        "",
        "## Movement against learning rate (centre geometry E=64, k=8, L=4)",
        "",
        f"sigma (RMS boundary-gap change per off-policy update, logits) = exp({sv['a']:.2f}) lr^{sv['b']:.2f}, "
        f"fitted on lr {', '.join(f'{v:g}' for v in sv['lr'])}.",
        "",
        f"Activated experts changed per flipped top-k set: mean {ep['mean']:.2f}, max {ep['max']:.2f} "
        f"({ep['at_max_flip_rate']:.2f} at the largest flip rate). The curve's ceiling is "
        f"{100 * s['curve_ceiling']:.3g}% (its smallest-x bin).",
    ]
    return "\n".join(lines) + "\n"


def _window_markdown(w: dict[str, Any], points: pd.DataFrame) -> list[str]:
    (p0, p1), (w0, w1), d = w["probe_steps"], w["steps"], w["decay"]
    lines = [
        "",
        f"## Forecast of the drift over steps {w0}-{w1} of a run, from a probe of steps {p0}-{p1}",
        "",
        f"What `python -m moe_rl.forecast` forecasts: the mean per-update flip rate over steps {w0}-{w1} of a "
        f"run with this sweep's config (its batch, updates per rollout and lr), from the x = gap / "
        f"movement counts of its first {p1} steps (the probe) with the movement decayed to the window's. "
        f"Decay model: movement over steps {w0}-{w1} = {d['decay']:.3f} x the probe's, one constant "
        f"(geometric mean over the {d['n_runs']} fit runs, range {d['min']:.2f}-{d['max']:.2f}; all at lr "
        f"{FIT_MAX_LR:g}, so a dependence on lr is not fitted). Within an x bin the probe's pairs are taken as "
        "uniform. Measured: flips / (token, layer) pairs over the window's off-policy updates. The last "
        "column applies the curve at the probe's own movement (the per-update forecast of the probe, "
        "read as the run's drift).",
        "",
        "| design point | fitted | seeds | decay measured | probe measured | forecast | measured | "
        "forecast / measured | at own decay | probe curve / measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in points.sort_values(["fitted", *GEOMETRY], ascending=[False, True, True, True, True]).iterrows():
        lines.append(
            f"| {_fmt_point(r)} | {'yes' if r['fitted'] else 'held out'} | {r['seeds']} | {r['decay']:.2f} | "
            f"{100 * r['probe_measured']:.3g}% | {100 * r['window_forecast']:.3g}% | "
            f"{100 * r['window_measured']:.3g}% | {r['ratio']:.2f}x | {r['ratio_own_decay']:.2f}x | "
            f"{r['ratio_probe_curve']:.2f}x |"
        )
    if w["held_out_ratio_range"]:
        lo, hi = w["held_out_ratio_range"]
        plo, phi = w["held_out_probe_curve_ratio_range"]
        olo, ohi = w["held_out_own_decay_ratio_range"]
        lines += [
            "",
            f"Held out, on steps {w0}-{w1}: {w['held_out_within_1.3x']} of {w['held_out_points']} points within "
            f"1.3x (forecast / measured {lo:.2f}-{hi:.2f}); the probe's curve read as the run's drift: "
            f"{w['held_out_probe_curve_within_1.3x']} of {w['held_out_points']} ({plo:.2f}-{phi:.2f}). With each "
            f"point's own measured decay the ratios are {olo:.2f}-{ohi:.2f}: what a point misses by then comes "
            "from its gaps changing between the probe and the window, not from the decay constant.",
        ]
    return lines


def run_fit(runs_dir: Path, out: Path, wall: str | None) -> dict[str, Any]:
    from moe_rl.analysis import load_results

    result = fit_forecast(load_results(runs_dir))
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "curve.csv", result["curve"].to_csv(index=False).encode())
    write_atomic(out / "points.csv", result["points"].to_csv(index=False).encode())
    write_atomic(out / "window.csv", result["window_points"].to_csv(index=False).encode())
    write_atomic(
        out / "runs.csv",
        result["per_run"]
        .merge(result["runs"][["run", "measured", "predicted", "ratio"]], on="run")
        .to_csv(index=False)
        .encode(),
    )
    write_atomic(out / "fit.json", (json.dumps(result["summary"], indent=1) + "\n").encode())
    write_atomic(out / "summary.md", fit_markdown(result, wall).encode())
    return result


# --- the forecast of one policy ---------------------------------------------------------------------


def compose_config(overrides: list[str]):
    """The TrainConfig of Hydra `overrides` on experiments/conf (as `experiments/train.py` composes it)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import TrainConfig, validate
    from moe_rl.run.experiment import refuse_old_preset_spelling, to_train_config

    refuse_old_preset_spelling(overrides)
    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    with initialize_config_dir(config_dir=str(ROOT / "experiments" / "conf"), version_base="1.3"):
        return validate(to_train_config(compose("config", overrides=overrides)))


def probe(cfg, steps: int) -> dict[str, Any]:
    """Boundary gaps of the policy on one rollout batch, and the movement and drift of `steps` real steps.

    sigma per layer of the off-policy updates: the step metrics hold the off-policy mean of the overall
    RMS (`move/rms/offpolicy`) and the mean over all N updates of each layer's RMS; the first update
    runs on the old weights and moves nothing, so the layer profile (layer_i / rms) carries over.
    """
    import torch

    from moe_rl.routing.compare import boundary_gaps
    from moe_rl.train import Trainer

    if cfg.optim.updates_per_rollout < 2:
        raise ValueError("the movement is measured on off-policy updates: set optim.updates_per_rollout >= 2")
    trainer = Trainer(cfg)
    rollout, _, _ = trainer.rollout(1)
    old = trainer.old_pass(rollout)
    old_routes, old_scores = old.routes, old.scores
    if old_routes is None:
        raise ValueError(f"model.family={cfg.model.family!r} has no MoE layer: no router to forecast")
    scores = old_scores[old_routes.mask]  # (n, L, E) router probabilities of the valid tokens
    gaps, _ = boundary_gaps(scores, old_routes.top_k)  # (n, L)
    history = [trainer.step(s) for s in range(1, steps + 1)]
    L = gaps.shape[1]
    mean = {k: float(np.mean([m[k] for m in history])) for k in (SIGMA_KEY, FLIP_KEY, EXPERT_KEY, TOKEN_KEY)}
    rms = np.mean([m["route/old_vs_new/move/rms"] for m in history])
    profile = np.array([np.mean([m[f"route/old_vs_new/move/layer_{i}"] for m in history]) for i in range(L)]) / rms
    if not mean[SIGMA_KEY] > 0:
        log.warning("the %d probe step(s) did not move the router (every advantage 0?): the forecast is 0", steps)
    logits = scores.double().clamp(min=torch.finfo(torch.float64).tiny).log().numpy()
    return {
        "gaps": gaps.numpy(),
        "logits": logits,
        "sigma": mean[SIGMA_KEY] * profile,
        "measured": mean,
        "top_k": old_routes.top_k,
        "num_experts": int(old_scores.shape[-1]),
        "num_moe_layers": L,
    }


def forecast(overrides: list[str], *, lr: float | None, steps: int, curve_path: Path) -> dict[str, Any]:
    """Forecast for the policy of `overrides` at learning rate `lr` (None: the config's)."""
    curve = pd.read_csv(curve_path)
    curve_p = curve["p"].fillna(0.0).to_numpy(float)
    fit = json.loads((curve_path.parent / "fit.json").read_text()) if (curve_path.parent / "fit.json").is_file() else {}
    experts_per_flip = fit.get("experts_per_flip", {}).get("mean", 1.0)
    extra = [f"optim.lr={lr}"] if lr is not None else []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_config([*overrides, *extra, f"out_dir={tmp}/probe", "progress=false", "logger=[parquet]"])
        result = probe(cfg, steps)
    flip, token = predict_flips(result["gaps"], result["sigma"], curve_p)
    k = result["top_k"]
    factor_curve = sigma_for_rate(result["gaps"], result["sigma"], curve_p, PAPER_LEVEL * k / experts_per_flip)
    gauss = simulate_flips(result["logits"], result["sigma"], k)
    factor = scale_for_level(result["logits"], result["sigma"], k, PAPER_LEVEL)
    window = window_block(fit.get("window"), steps, result["gaps"], result["logits"], result["sigma"], curve_p, k)
    if window is not None:
        window["predicted"][EXPERT_KEY] = window["predicted"][FLIP_KEY] * experts_per_flip / k
    return {
        "geometry": {
            "num_experts": result["num_experts"],
            "top_k": k,
            "num_moe_layers": result["num_moe_layers"],
            "lr": cfg.optim.lr,
        },
        "probe_steps": steps,
        "tokens": int(result["gaps"].shape[0]),
        "gap_quantiles": {f"q{q}": float(np.quantile(result["gaps"], q / 100)) for q in (10, 50, 90)},
        "sigma": result["sigma"].tolist(),
        "sigma_rms": float(np.sqrt(np.mean(result["sigma"] ** 2))),
        "predicted": {FLIP_KEY: flip, EXPERT_KEY: flip * experts_per_flip / k, TOKEN_KEY: token},
        "predicted_gaussian": {
            FLIP_KEY: gauss["flip_rate"],
            EXPERT_KEY: gauss["expert_flip_frac"],
            TOKEN_KEY: gauss["token_flip_rate"],
        },
        "measured_in_probe": result["measured"],
        "movement_factor_for_paper_level": factor,
        "movement_factor_for_paper_level_curve": factor_curve,
        "experts_per_flip": experts_per_flip,
        "window": window,
    }


def window_block(
    fit_window: dict[str, Any] | None,
    steps: int,
    gaps: np.ndarray,
    logits: np.ndarray,
    sigma: np.ndarray,
    curve_p: np.ndarray,
    k: int,
) -> dict[str, Any] | None:
    """The forecast over the fitted window: the probe's gaps at its movement times the fitted decay.

    None (with a warning) when fit.json has no window fit or its probe had another number of steps: the
    decay is the ratio of the window's movement to the movement of that probe."""
    if not fit_window:
        log.warning("fit.json has no window fit: no forecast over a window of the run (rerun --fit)")
        return None
    p0, p1 = fit_window["probe_steps"]
    if (p0, p1) != (1, steps):
        log.warning("the decay was fitted for a probe of steps %d-%d, not 1-%d: no window forecast", p0, p1, steps)
        return None
    d = float(fit_window["decay"]["decay"])
    flip, token = predict_flips(gaps, sigma * d, curve_p)
    gauss = simulate_flips(logits, sigma * d, k)
    return {
        "steps": list(fit_window["steps"]),
        "decay": d,
        "held_out_within_1.3x": fit_window.get("held_out_within_1.3x"),
        "held_out_points": fit_window.get("held_out_points"),
        "held_out_ratio_range": fit_window.get("held_out_ratio_range"),
        "predicted": {FLIP_KEY: flip, TOKEN_KEY: token},
        "predicted_gaussian": {
            FLIP_KEY: gauss["flip_rate"],
            EXPERT_KEY: gauss["expert_flip_frac"],
            TOKEN_KEY: gauss["token_flip_rate"],
        },
    }


def forecast_text(doc: dict[str, Any]) -> str:
    g, p, m, q = doc["geometry"], doc["predicted"], doc["measured_in_probe"], doc["predicted_gaussian"]
    names = (
        (FLIP_KEY, "top-k sets changed"),
        (EXPERT_KEY, "activated experts changed"),
        (TOKEN_KEY, "tokens with a changed layer"),
    )
    lines = [
        f"geometry E={g['num_experts']} k={g['top_k']} L={g['num_moe_layers']}, lr {g['lr']:g}; "
        f"{doc['tokens']} tokens; logit gap quantiles (10/50/90%): "
        + ", ".join(f"{v:.3g}" for v in doc["gap_quantiles"].values()),
        "movement per off-policy update (RMS gap change, logits) per layer: "
        + ", ".join(f"{s:.3g}" for s in doc["sigma"])
        + f" (from {doc['probe_steps']} probe steps)",
    ]
    w = doc.get("window")
    if w is not None:
        (w0, w1), lo_hi = w["steps"], w["held_out_ratio_range"]
        lines.append(
            f"forecast: mean drift per update over steps {w0}-{w1} of a run with the fitted sweep's batch and "
            f"updates per rollout (movement {w['decay']:.3g}x the probe's, the decay fitted on that sweep; top-k "
            f"sets changed on held-out points: {w['held_out_within_1.3x']} of {w['held_out_points']} within 1.3x"
            + (f", forecast / measured {lo_hi[0]:.2f}-{lo_hi[1]:.2f})" if lo_hi else ")")
        )
        wp, wq = w["predicted"], w["predicted_gaussian"]
        lines.append(f"  {'steps ' + str(w0) + '-' + str(w1):<30} {'curve':>9} {'gaussian':>9}")
        for key, name in names:
            lines.append(f"  {name:<30} {100 * wp[key]:8.3f}% {100 * wq[key]:8.3f}%")
    else:
        lines.append("no forecast over a window of the run (see the warning): the probe's steps only")
    lines.append(
        f"probe: steps 1-{doc['probe_steps']} (the first updates, where drift is highest; not the drift of a run)"
    )
    lines.append(f"  {'steps 1-' + str(doc['probe_steps']):<30} {'curve':>9} {'gaussian':>9} {'measured':>9}")
    for key, name in names:
        lines.append(f"  {name:<30} {100 * p[key]:8.3f}% {100 * q[key]:8.3f}% {100 * m[key]:8.3f}%")
    f = doc["movement_factor_for_paper_level"]
    lines.append(
        f"10% of activated experts changed (gaussian model) needs {f:.3g}x the probe's movement "
        f"({f * doc['sigma_rms']:.3g} logits)"
        if math.isfinite(f)
        else "10% of activated experts changed is out of the gaussian model's reach (> 1000x this movement)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of experiments/conf (as experiments/train.py)")
    parser.add_argument("--lr", type=float, default=None, help="planned learning rate (default: the config's)")
    parser.add_argument("--probe-steps", type=int, default=3, help="real RL steps that measure the movement")
    parser.add_argument("--curve", type=Path, default=DEFAULT_CURVE, help="curve.csv written by --fit")
    parser.add_argument("--json", type=Path, default=None, help="also write the forecast as JSON here")
    parser.add_argument("--fit", type=Path, default=None, metavar="RUNS_DIR", help="fit the curve on these runs")
    parser.add_argument("--out", type=Path, default=None, help="with --fit: where to write the report")
    parser.add_argument("--wall", default=None, help="with --fit: the sweep's wall time, quoted in summary.md")
    args = parser.parse_args(argv)
    if args.fit is not None:
        out = args.out or args.fit.parent
        run_fit(args.fit, out, args.wall)
        print((out / "summary.md").read_text())
        return
    if args.probe_steps < 1:
        parser.error("--probe-steps must be >= 1")
    if not args.curve.is_file():
        parser.error(f"{args.curve} not found: fit a curve first (python -m moe_rl.forecast --fit RUNS_DIR)")
    doc = forecast(args.overrides, lr=args.lr, steps=args.probe_steps, curve_path=args.curve)
    print(forecast_text(doc))
    if args.json is not None:
        write_atomic(args.json, (json.dumps(doc, indent=1) + "\n").encode())


if __name__ == "__main__":
    main()
