"""Dose-response against the realised per-update divergence: a run's KL summary, a monotone fit of outcome on log KL,
the KL where the fit crosses a threshold, and its bootstrap over cold starts.

The dose is a run's early per-update KL (`kl/update_k3`, k3 between the policy before and after each update on the
update's tokens, mean over steps 1..20: `kl_summary`), the outcome its accuracy change. The fit is isotonic
(non-increasing in log KL, `scipy.optimize.isotonic_regression`): more divergence per update never helps in it, and
nothing else about the curve's shape is assumed. A logistic in log KL would need the change's lower and upper
asymptotes, which differ by arm and are not reached inside a grid of three lrs; the isotonic fit needs neither. The
crossing is where the fit first falls below the threshold, interpolated in log KL between the two runs on either
side; a fit that never falls below it is right-censored (+inf: the crossing lies past the largest KL seen), one
already below at the smallest KL left-censored (0). Intervals resample cold starts, then seeds within each drawn
start (`moe_rl.analysis.clustered.start_draws` and `bootstrap`), with the same draws for every row, so a ratio of
two rows' crossings is paired on starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy.optimize import isotonic_regression

from moe_rl.metrics.names import KL_EARLY_STEPS as EARLY_STEPS
from moe_rl.metrics.names import KL_UPDATE_K3, KL_UPDATE_K3_ACTING


def kl_summary(frame: pd.DataFrame, key: str = KL_UPDATE_K3, early_steps: int = EARLY_STEPS) -> dict[str, float]:
    """A run's per-update KL: `early`, the mean of its per-step values over steps 1..`early_steps`, and `mean`, over
    the run (`frame`: the run's long-format metrics, columns step, key, value); NaN where none is logged. A run that
    scored the KL on a schedule (`metrics.update_kl_window`: every step of the early window, then every K-th) has
    each logged step stand for the steps since the one logged before it, so `mean` is the run's time average
    either way (every step logged: the plain mean)."""
    values = frame.loc[(frame["key"] == key) & (frame["step"] >= 1), ["step", "value"]].sort_values("step")
    early = values.loc[values["step"] <= early_steps, "value"]
    span = np.diff(values["step"].to_numpy(), prepend=0)  # (steps,) the steps each logged value stands for
    return {
        "early": float(early.mean()) if len(early) else math.nan,
        "mean": float(np.average(values["value"], weights=span)) if len(values) else math.nan,
    }


def kl_per_run(df: pd.DataFrame, key: str = KL_UPDATE_K3, early_steps: int = EARLY_STEPS) -> pd.DataFrame:
    """`kl_summary` of every run of a long-format frame (column run): index run, columns kl_early, kl_mean."""
    rows = {run: kl_summary(x, key, early_steps) for run, x in df.groupby("run")}
    out = pd.DataFrame.from_dict(rows, orient="index", columns=["early", "mean"])
    return out.rename(columns={"early": "kl_early", "mean": "kl_mean"})


def acting_kl_per_run(df: pd.DataFrame, early_steps: int = EARLY_STEPS) -> pd.Series:
    """Per run, its early per-update KL on the routes it acts with: `kl/update_k3/acting` where the run logged it
    (anchored routing), else `kl/update_k3` (a policy that samples with its own router acts with its routes)."""
    out = kl_per_run(df, KL_UPDATE_K3, early_steps)["kl_early"]
    if (df["key"] == KL_UPDATE_K3_ACTING).any():
        out = kl_per_run(df, KL_UPDATE_K3_ACTING, early_steps)["kl_early"].combine_first(out)
    return out.rename("kl_acting")


def isotonic_fit(log_kl: np.ndarray, change: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, fit): the distinct log KLs in increasing order and the non-increasing least-squares fit of change on them
    (runs at one x enter as their mean, weighted by their count, so the fit does not depend on the runs' order)."""
    x, inverse, counts = np.unique(np.asarray(log_kl, float), return_inverse=True, return_counts=True)
    means = np.bincount(inverse, weights=np.asarray(change, float)) / counts
    return x, np.asarray(isotonic_regression(means, weights=counts.astype(float), increasing=False).x)


def crossing(kl: Sequence[float] | np.ndarray, change: Sequence[float] | np.ndarray, threshold: float) -> float:
    """The KL at which the isotonic fit of `change` on log `kl` first falls below `threshold` (log-linear between the
    last point at or above it and the first below); +inf if it never does, 0 if it is below from the first point,
    NaN with no finite point. Runs without a finite KL > 0 are left out (the tables count them: `nonfinite_kl`)."""
    kl, change = np.asarray(kl, float), np.asarray(change, float)
    keep = np.isfinite(kl) & (kl > 0) & np.isfinite(change)
    if not keep.any():
        return math.nan
    x, fit = isotonic_fit(np.log(kl[keep]), change[keep])
    below = np.flatnonzero(fit < threshold)
    if len(below) == 0:
        return math.inf
    i = int(below[0])
    if i == 0:
        return 0.0
    t = (fit[i - 1] - threshold) / (fit[i - 1] - fit[i])
    return float(math.exp(x[i - 1] + t * (x[i] - x[i - 1])))


def law_fit(frame: pd.DataFrame, y: str = "log_kl") -> tuple[float, float]:
    """(b, c) of the least-squares fit `y = a_row + b log lr + c log N` (frame: columns row, lr, N and y); NaN where
    N or lr does not vary."""
    rows = pd.get_dummies(frame["row"], dtype=float).to_numpy()
    X = np.column_stack([rows, np.log(frame["lr"].to_numpy(float)), np.log(frame["N"].to_numpy(float))])
    target = frame[y].to_numpy(float)
    keep = np.isfinite(target)
    if keep.sum() <= X.shape[1] or np.linalg.matrix_rank(X[keep]) < X.shape[1]:
        return math.nan, math.nan
    coef, *_ = np.linalg.lstsq(X[keep], target[keep], rcond=None)
    return float(coef[-2]), float(coef[-1])


def law_exponent(frame: pd.DataFrame, y: str = "log_kl") -> float:
    """b / c of `law_fit`: how many powers of N one power of lr is worth; lr^2 x N reads 2. NaN where N or lr does
    not vary or c = 0 (b and c are reported beside it: the ratio is unstable where c is near 0)."""
    b, c = law_fit(frame, y)
    return b / c if c != 0 and math.isfinite(c) else math.nan


def matched_lr(frame: pd.DataFrame, reference: str) -> pd.DataFrame:
    """A calibration pilot read: which lr brings each arm to the reference's early KL. `frame`: one row per run with
    columns arm, lr, member (the pool member both arms ran from) and kl (its early acting KL); `reference` is the arm
    whose runs at one lr set the target. Per arm and lr: runs, the geometric mean KL, `ratio` = exp of the mean over
    members of log(KL / the reference's KL at that member) and its SD (`sd_log_ratio`); per arm, `slope` = d log KL /
    d log lr (least squares of the log ratios on log lr over its runs) and `lr_matched`, where that line reaches
    ratio 1 (NaN where the arm ran at one lr, or the slope is not positive)."""
    ref = frame[frame["arm"] == reference]
    if ref["lr"].nunique() != 1:
        raise ValueError(f"the reference {reference!r} must run at one lr, ran at {sorted(ref['lr'].unique())}")
    log_ref = np.log(ref.groupby("member")["kl"].mean())
    runs = frame.assign(log_ratio=np.log(frame["kl"]) - frame["member"].map(log_ref)).dropna(subset=["log_ratio"])
    rows = []
    for (arm, lr), g in runs.groupby(["arm", "lr"], sort=True):
        rows.append(
            {
                "arm": arm,
                "lr": float(lr),
                "runs": len(g),
                "kl": float(np.exp(np.log(g["kl"]).mean())),
                "ratio": float(np.exp(g["log_ratio"].mean())),
                "sd_log_ratio": float(g["log_ratio"].std()),
            }
        )
    out = pd.DataFrame(rows)
    out["slope"], out["lr_matched"] = math.nan, math.nan
    for arm, g in runs.groupby("arm"):
        if g["lr"].nunique() < 2:
            continue
        slope, icpt = np.polyfit(np.log(g["lr"].to_numpy(float)), g["log_ratio"].to_numpy(float), 1)
        out.loc[out["arm"] == arm, "slope"] = slope
        out.loc[out["arm"] == arm, "lr_matched"] = math.exp(-icpt / slope) if slope > 0 else math.nan
    return out
