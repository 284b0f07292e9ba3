"""Calibrate the learning rate to a target per-update KL, per arm and model, from a few short pilots.

    python experiments/calibrate_kl.py --arm grpo_none --target 0.02                # the default model
    python experiments/calibrate_kl.py --arm grpo_none,sapo_none --model qwen3_dense --target 0.02 \\
        -- optim.updates_per_rollout=8 numerics=avx2                               # the study's own settings

The early per-update KL (`kl/update_k3`, mean over steps <= 20: `kl_summary`) grows with the learning rate as a
power law over the range that matters, so each arm gets `--lrs` pilots (default 3, a decade on a log grid) of
`--steps` steps (default 20) from one start (seed 0), a least-squares fit `log KL = a + b log lr` over them, and the lr
where the fit meets `--target`. One more pilot at that lr (held out of the fit) says how well the fit predicts:
its measured early KL over the predicted one. Each result is cached in `--cache` (json) under the arm, the model,
the target, the metric and the hash of every setting of the pilots but the lr (`calibration_key`), so a study reads
it (`cached_lr`) and a rerun skips it; pilot runs are resumed like any run (a finished folder is not rerun).

A study that matches arms to a reference arm's divergence rather than to a number reads a paired pilot instead:
short runs of each arm at a few lrs and of the reference at one, from the same pool members (`--match`; the arm is
a run's `rung`, else its `arm`; `moe_rl.analysis.dose.matched_lr`), on the KL each arm acts with:

    python experiments/calibrate_kl.py --match results/causal_matched/pilot --reference moe
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moe_rl.analysis.dose import EARLY_STEPS, kl_summary
from moe_rl.metrics.names import KL_UPDATE_K3
from moe_rl.run.atomic import write_atomic
from moe_rl.run.identity import NOT_IDENTITY, spec_hash

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = ROOT / "results" / "calibration" / "kl.json"
LRS = (1e-4, 3e-4, 1e-3)
# every pilot: scored on all rows (the calibration's own precision), evaluated only at its last step
PILOT = ("metrics.update_kl_rows=null", "snapshot_every=0", "checkpoint_every=0", "progress=false", "seed=0")


def fit_power_law(lrs: list[float], kls: list[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line `log KL = a + b log lr` through the pilots."""
    if len(lrs) < 2 or len(set(lrs)) < 2:
        raise ValueError(f"a fit needs pilots at 2 or more learning rates, got {lrs}")
    if not all(k > 0 and math.isfinite(k) for k in kls):
        raise ValueError(f"every pilot's KL must be finite and > 0 to fit in logs, got {kls}")
    b, a = np.polyfit(np.log(lrs), np.log(kls), 1)
    return float(a), float(b)


def lr_at(a: float, b: float, target: float) -> float:
    """The lr where the fit `log KL = a + b log lr` meets `target` (b must be > 0: KL grows with the lr)."""
    if not b > 0:
        raise ValueError(f"the fit's slope b={b:.3g} is not > 0: the pilots' KL does not grow with the lr")
    return math.exp((math.log(target) - a) / b)


def interpolated_lr(points: list[tuple[float, float]], target: float) -> float:
    """The lr where the log-log line through the two measured (lr, early KL) points that bracket `target` meets it:
    the points sorted by lr, the first adjacent pair whose KLs lie on either side of the target (the global power law
    bends over a decade, so the local pair predicts better); the end pair's line outside the measured range."""
    pts = sorted(points)
    if len(pts) < 2:
        raise ValueError(f"an interpolation needs 2 or more pilots, got {pts}")
    pairs = list(zip(pts, pts[1:], strict=False))
    inside = [(a, b) for a, b in pairs if min(a[1], b[1]) <= target <= max(a[1], b[1]) and a[0] != b[0]]
    (l0, k0), (l1, k1) = inside[0] if inside else (pairs[0] if target < pts[0][1] else pairs[-1])
    slope = math.log(k1 / k0) / math.log(l1 / l0)
    return l0 * math.exp(math.log(target / k0) / slope)


def calibration_key(arm: str, model: str, target: float, metric: str, steps: int, overrides: list[str]) -> str:
    """The cache key: the arm, the model, the target and the metric, and a hash of the pilots' settings but their lr
    (the overrides that change what a run computes, the number of steps; the lrs of the grid only move the fit), which
    also names the pilots' folder: a calibration to another target or metric reads the same pilots."""
    settings = spec_hash({"overrides": sorted(computing(overrides)), "steps": steps})
    return f"{arm}|{model}|{metric}={target:g}|{settings}"


def computing(overrides: list[str]) -> list[str]:
    """The overrides that change what a run computes (not where it writes, its threads or its cache folder)."""
    return [o for o in overrides if o.partition("=")[0].lstrip("+") not in (*NOT_IDENTITY, "cold_start.cache_dir")]


def cached_lr(
    arm: str,
    model: str,
    target: float,
    *,
    overrides: tuple[str, ...] = (),
    steps: int = EARLY_STEPS,
    metric: str = KL_UPDATE_K3,
    cache: Path = CACHE,
) -> float | None:
    """The calibrated lr of `arm` on `model` at `target`, or None when it has not been calibrated."""
    if not cache.is_file():
        return None
    entry = json.loads(cache.read_text()).get(calibration_key(arm, model, target, metric, steps, list(overrides)))
    return None if entry is None else float(entry["lr"])


def pilot(arm: str, model: str, lr: float, folder: Path, overrides: list[str], steps: int) -> Path:
    """One pilot run of `arm` on `model` at `lr` into `folder` (`experiments/train.py`; a finished one is skipped)."""
    group = "arm" if any(o.startswith("+preset=") for o in overrides) else "+arm"  # a preset may name an arm already
    cmd = [sys.executable, str(HERE / "train.py"), *overrides, *PILOT, f"{group}={arm}", f"model={model}"]
    cmd += [f"optim.lr={lr:g}", f"steps={steps}", f"eval_every={steps}", "experiment=calibrate_kl"]
    cmd += [f"hydra.run.dir={folder}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0 or not (folder / "metrics.parquet").is_file():
        raise SystemExit(f"pilot {folder} failed:\n{out.stderr[-3000:]}")
    return folder


def measured(folder: Path, metric: str) -> dict[str, float]:
    """A pilot's early and run-mean KL."""
    return kl_summary(pd.read_parquet(folder / "metrics.parquet"), key=metric)


def calibrate(
    arm: str,
    model: str,
    target: float,
    *,
    lrs: tuple[float, ...] = LRS,
    steps: int = EARLY_STEPS,
    metric: str = KL_UPDATE_K3,
    overrides: tuple[str, ...] = (),
    runs: Path = ROOT / "runs",
    cache: Path = CACHE,
    force: bool = False,
) -> dict[str, Any]:
    """The calibration of `arm` on `model` (cached: read from `cache` unless `force`)."""
    key = calibration_key(arm, model, target, metric, steps, list(overrides))
    table = json.loads(cache.read_text()) if cache.is_file() else {}
    if key in table and not force:
        return {**table[key], "cached": True}
    start = time.perf_counter()
    folder = runs / "calibrate_kl" / model / arm / key.rsplit("|", 1)[1]
    pilots: list[dict[str, Any]] = []
    for lr in lrs:
        run = pilot(arm, model, lr, folder / f"lr_{lr:g}", list(overrides), steps)
        pilots.append({"lr": lr, **measured(run, metric), "run": str(run.relative_to(runs))})
    a, b = fit_power_law([p["lr"] for p in pilots], [p["early"] for p in pilots])
    lr = lr_at(a, b, target)
    held = pilot(arm, model, lr, folder / f"heldout_lr_{lr:.4g}", list(overrides), steps)
    holdout: dict[str, Any] = {"lr": lr, **measured(held, metric), "run": str(held.relative_to(runs))}
    entry = {
        "arm": arm,
        "model": model,
        "metric": metric,
        "target": target,
        "lr": lr,
        "extrapolated": not min(lrs) <= lr <= max(lrs),
        "fit": {"a": a, "b": b, "model": f"log early KL = a + b log lr, least squares over {len(lrs)} pilots"},
        "steps": steps,
        "overrides": computing(list(overrides)),
        "pilots": pilots,
        "holdout": {**holdout, "predicted": target, "measured_over_predicted": holdout["early"] / target},
        "interpolated_lr": interpolated_lr([(p["lr"], p["early"]) for p in [*pilots, holdout]], target),
        "seconds": time.perf_counter() - start,
    }
    table = json.loads(cache.read_text()) if cache.is_file() else {}  # another calibration may have written meanwhile
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cache, json.dumps({**table, key: entry}, indent=1, sort_keys=True) + "\n")
    return {**entry, "cached": False}


def matched(pilot_dir: Path, reference: str) -> str:
    """`--match`: the paired pilot's table (`dose.matched_lr`) and, per arm, the lr where it meets the reference."""
    from moe_rl.analysis.dose import acting_kl_per_run, matched_lr
    from moe_rl.analysis.load import load_results
    from moe_rl.analysis.outcomes import finished_runs
    from moe_rl.metrics.names import KL_UPDATE_K3_ACTING, TASK_ACCURACY
    from moe_rl.studies.design import POOL

    df = load_results(pilot_dir, keys=[KL_UPDATE_K3, KL_UPDATE_K3_ACTING, TASK_ACCURACY])
    runs = finished_runs(df).join(acting_kl_per_run(df))
    arm = runs["rung"] if "rung" in runs else runs["arm"]
    frame = runs.assign(arm=arm.astype(str), lr=runs["lr"].astype(float), member=runs["seed"].astype(int) % POOL)
    table = matched_lr(frame.rename(columns={"kl_acting": "kl"}), reference)
    lines = [f"{pilot_dir}: early acting KL (steps 1..{EARLY_STEPS}) against {reference}, paired by pool member"]
    lines.append(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    for name, g in table.groupby("arm", sort=False):
        lr0, lr1 = float(g["lr"].min()), float(g["lr_matched"].iloc[0])
        if math.isfinite(lr1):
            lines.append(f"{name}: ratio 1 at lr {lr1:.4g} ({lr1 / lr0:.3f}x its smallest pilot lr, {lr0:.4g})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", help="arm files (experiments/conf/arm/), comma-separated")
    parser.add_argument("--model", default="qwen3_moe", help="a model file (experiments/conf/model/)")
    parser.add_argument("--target", type=float, help="the early per-update KL to reach")
    parser.add_argument("--match", type=Path, help="read a paired pilot's folder instead (with --reference)")
    parser.add_argument("--reference", help="with --match: the arm whose early KL the others are brought to")
    parser.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LRS), help="the pilots' lrs, comma-separated")
    parser.add_argument("--steps", type=int, default=EARLY_STEPS, help="steps per pilot (the early window's)")
    parser.add_argument("--metric", default=KL_UPDATE_K3, help="the KL the target is in (kl/k3: the drift within N)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs", help="the pilots go to RUNS/calibrate_kl/")
    parser.add_argument("--cache", type=Path, default=CACHE, help="the calibrations' json")
    parser.add_argument("--force", action="store_true", help="calibrate again even where the cache has a result")
    parser.add_argument(
        "overrides", nargs="*", help="the study's settings, after `--` (e.g. optim.updates_per_rollout=8)"
    )
    args = parser.parse_args(argv)
    if args.match is not None:
        if not args.reference:
            parser.error("--match needs --reference ARM")
        print(matched(args.match, args.reference))
        return 0
    if not args.arm or args.target is None:
        parser.error("--arm and --target are required (or --match DIR --reference ARM)")
    if not args.target > 0:
        parser.error(f"--target={args.target} must be > 0")
    lrs = tuple(float(x) for x in args.lrs.split(","))
    for arm in args.arm.split(","):
        out = calibrate(
            arm,
            args.model,
            args.target,
            lrs=lrs,
            steps=args.steps,
            metric=args.metric,
            overrides=tuple(args.overrides),
            runs=args.runs,
            cache=args.cache,
            force=args.force,
        )
        held = out["holdout"]
        print(
            f"{arm} on {args.model}: lr {out['lr']:.3g} for early {args.metric} {args.target:g}"
            f"{' (extrapolated)' if out['extrapolated'] else ''}; fit b = {out['fit']['b']:.2f}; held-out pilot "
            f"{held['early']:.4g} ({held['measured_over_predicted']:.2f}x predicted); local interpolation over every "
            f"pilot: lr {out.get('interpolated_lr', math.nan):.3g}"
            + (" [cached]" if out["cached"] else f" [{out['seconds']:.0f} s]")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
