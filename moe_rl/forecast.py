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
(`moe_rl.studies.forecast_fit.predict_flips`), and with a gaussian model in which every router logit
moves by that amount (`simulate_flips`), which also covers movements large enough to change several
experts of a router at once. Validation on the held-out design points of `drift_forecast`, from each
run's own steps 1-3 to its steps 11-40: forecast / measured flip rate 0.52-1.11, 4 of 5 within
1.3x (the miss, E=8 k=2 L=2, is its gaps changing, not the decay); the probe's curve read as the
run's drift was 1.03-1.89x. The probe's own forecast and measured drift are printed below as a
check, and the factor on the probe's movement at which the gaussian model reaches the GSPO paper's
~10% of activated experts. `--fit` fits the curve on a sweep that logs
`route/flip_vs_margin/move/*` (experiment `drift_forecast`), the decay, and validates both on
design points it was not fitted on (`moe_rl.studies.forecast_report`, the report it writes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moe_rl.run.atomic import write_atomic
from moe_rl.studies.forecast_fit import (
    EXPERT_KEY,
    FLIP_KEY,
    SIGMA_KEY,
    TOKEN_KEY,
    predict_flips,
    scale_for_level,
    sigma_for_rate,
    simulate_flips,
)
from moe_rl.studies.forecast_report import run_fit

log = logging.getLogger(__name__)
# from the repository root, where `python -m moe_rl.forecast` runs (as experiments/train.py and the report do)
DEFAULT_CURVE = Path("results") / "drift_forecast" / "curve.csv"
DEFAULT_CONF = Path("experiments") / "conf"
PAPER_LEVEL = 0.10  # GSPO paper: ~10% of activated experts change per update (Qwen3-30B-A3B)


def compose_config(overrides: list[str], conf: Path = DEFAULT_CONF):
    """The TrainConfig of Hydra `overrides` on the config folder `conf` (as `experiments/train.py` composes it)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import TrainConfig, to_train_config, validate
    from moe_rl.run.launch import refuse_old_preset_spelling

    refuse_old_preset_spelling(overrides)
    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    with initialize_config_dir(config_dir=str(Path(conf).resolve()), version_base="1.3"):
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
    # the movement is a route instrument: measured on every probe step (`metrics.route_every`)
    cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, route_every=1))
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


def forecast(
    overrides: list[str], *, lr: float | None, steps: int, curve_path: Path, conf: Path = DEFAULT_CONF
) -> dict[str, Any]:
    """Forecast for the policy of `overrides` at learning rate `lr` (None: the config's)."""
    curve = pd.read_csv(curve_path)
    curve_p = curve["p"].fillna(0.0).to_numpy(float)
    fit = json.loads((curve_path.parent / "fit.json").read_text()) if (curve_path.parent / "fit.json").is_file() else {}
    experts_per_flip = fit.get("experts_per_flip", {}).get("mean", 1.0)
    extra = [f"optim.lr={lr}"] if lr is not None else []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_config([*overrides, *extra, f"out_dir={tmp}/probe", "progress=false", "logger=[parquet]"], conf)
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
    parser.add_argument("--conf", type=Path, default=DEFAULT_CONF, help=f"the config folder (default {DEFAULT_CONF})")
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
    doc = forecast(args.overrides, lr=args.lr, steps=args.probe_steps, curve_path=args.curve, conf=args.conf)
    print(forecast_text(doc))
    if args.json is not None:
        write_atomic(args.json, (json.dumps(doc, indent=1) + "\n").encode())


if __name__ == "__main__":
    main()
