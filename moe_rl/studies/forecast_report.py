"""The drift-forecast fit over a sweep (what `python -m moe_rl.forecast --fit` writes): the curve
F(gap / movement) fitted on the one-factor axes at lr <= FIT_MAX_LR, its validation per design point on
the points it was not fitted on, the residual dependence on geometry and lr, the movement against lr, and
the forecast of the window WINDOW from a probe of PROBE_STEPS (the movement decay).

`run_fit` writes curve.csv (read by the forecast of one policy, `moe_rl.forecast`), points.csv,
window.csv, runs.csv, fit.json and summary.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moe_rl.analysis.folder_report import kept_wall, with_provenance
from moe_rl.analysis.load import load_results
from moe_rl.run.atomic import write_atomic
from moe_rl.studies.drift import GEOMETRY
from moe_rl.studies.forecast_fit import (
    EXPERT_KEY,
    FLIP_KEY,
    PROBE_STEPS,
    SIGMA_KEY,
    WINDOW,
    fit_decay,
    flip_curve,
    move_counts,
    movement_decay,
    point_ratios,
    power_fit,
    predicted_vs_measured,
    residual_dependence,
    sigma_vs_lr,
    window_forecast,
    window_points,
)

CENTRE = {"num_experts": 64, "top_k": 8, "num_moe_layers": 4}
FILES = ("summary.md", "fit.json", "curve.csv", "points.csv", "runs.csv", "window.csv")
# Fitted on the one-factor axes at lr <= 1e-4; validated on the held-out corners and lr 3e-4, 1e-3.
FIT_MAX_LR = 1e-4
HELD_OUT = (
    {"num_experts": 8, "top_k": 2, "num_moe_layers": 2},
    {"num_experts": 16, "top_k": 4, "num_moe_layers": 2},
    {"num_experts": 128, "top_k": 8, "num_moe_layers": 8},
)


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
    """Fit and validate on the runs under `runs_dir`; write the report (the files of FILES) into `out`."""
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


def write_folder_report(runs_dir: Path, out: Path, presets: Path) -> list[Path]:
    """results/drift_forecast: the curve fit and its validation (what `python -m moe_rl.forecast --fit` writes),
    keeping the wall time its summary.md quotes; `presets` is not read."""
    run_fit(runs_dir, out, kept_wall(out))
    return [out / n for n in FILES]


report = with_provenance(
    write_folder_report
)  # the report its declaration names: summary.md says where its runs came from
