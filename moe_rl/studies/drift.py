"""Routing drift against router geometry: per-run drift, a log-space fit with seed-bootstrap
intervals, held-out checks, extrapolation, and the flip-vs-margin calibration curve.

Pure functions over the long-format frame of `load_results` (run keys, step, key, value).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from moe_rl.analysis.clustered import start_draws
from moe_rl.analysis.stats import wilson_interval
from moe_rl.metrics.bins import MARGIN_EDGES
from moe_rl.metrics.names import (
    FLIP_VS_MARGIN_PREFIX,
    ROUTE_EXPERT_FLIP_FRAC,
    ROUTE_FLIP_RATE,
    ROUTE_TOKEN_FLIP_RATE,
    offpolicy_key,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DRIFT_KEYS = tuple(offpolicy_key(k) for k in (ROUTE_EXPERT_FLIP_FRAC, ROUTE_FLIP_RATE, ROUTE_TOKEN_FLIP_RATE))
GEOMETRY = ("num_experts", "top_k", "num_moe_layers", "lr")
# Fit features: a power law in every factor, log y = b0 + b1 log E + b2 log k + b3 log L + b4 log lr.
FEATURES = ("log_E", "log_k", "log_L", "log_lr")


def drift_per_run(df: pd.DataFrame, keys: Sequence[str] = DRIFT_KEYS, *, start_step: int = 11) -> pd.DataFrame:
    """One row per run: its geometry, seed and the mean of each drift key over steps >= start_step.

    The first steps after the cold start drift several times faster than later ones (the policy
    is still sharpening), so the default skips the first 10 of each run.
    """
    rows = df[df["key"].isin(keys) & (df["step"] >= start_step)]
    if rows.empty:
        raise ValueError(f"no values of {list(keys)} at steps >= {start_step}")
    table = rows.pivot_table(index=["run", "seed", *GEOMETRY], columns="key", values="value", aggfunc="mean")
    return table.reset_index().rename_axis(columns=None)


def design_matrix(table: pd.DataFrame) -> np.ndarray:
    """(n, 5) intercept and log features of `table`'s geometry columns."""
    return np.column_stack(
        [
            np.ones(len(table)),
            np.log(table["num_experts"]),
            np.log(table["top_k"]),
            np.log(table["num_moe_layers"]),
            np.log(table["lr"]),
        ]
    ).astype(float)


def _lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.linalg.lstsq(X, y, rcond=None)[0]


def fit_drift(
    table: pd.DataFrame, key: str, *, n_boot: int = 2000, seed: int = 0, targets: pd.DataFrame | None = None
) -> dict:
    """Least squares of log(drift) on the log features, with 95% intervals from a bootstrap over seeds.

    A bootstrap replicate (`clustered.start_draws`, the routine every study's intervals use) draws seeds with
    replacement and keeps every design point's runs of the
    drawn seeds, so a seed's runs stay together (they share nothing else, but their noise may).
    Returns coefficients with intervals, in-sample R^2 (log space) and, for each row of `targets`
    (geometry columns), the predicted drift with its interval.
    """
    data = table[np.isfinite(table[key]) & (table[key] > 0)]
    if len(data) < len(FEATURES) + 2:
        raise ValueError(f"{len(data)} usable runs for {key}: too few to fit {len(FEATURES) + 1} coefficients")
    X, y = design_matrix(data), np.log(data[key].to_numpy(float))
    flat = [f for f, col in zip(FEATURES, X[:, 1:].T) if np.ptp(col) == 0]
    if flat:
        raise ValueError(f"{key}: {flat} take a single value in these runs, so their coefficients are not identified")
    coef = _lstsq(X, y)
    resid = y - X @ coef
    r2 = 1.0 - resid.var() / y.var()
    seeds = np.sort(data["seed"].unique())
    by_seed = {s: np.flatnonzero(data["seed"].to_numpy() == s) for s in seeds}
    # one start for every run (each design point is its own model): `start_draws` then resamples seeds alone
    draws = start_draws(pd.DataFrame({"start": 0, "seed": seeds}), n_resamples=n_boot, seed=seed)
    Xt = design_matrix(targets) if targets is not None else None
    boot_coef, boot_pred = [], []
    for replicate in draws:
        idx = np.concatenate([by_seed[s] for _, s in replicate])
        b = _lstsq(X[idx], y[idx])
        boot_coef.append(b)
        if Xt is not None:
            boot_pred.append(Xt @ b)
    boot_coef = np.array(boot_coef)
    names = ["intercept", *FEATURES]
    out = {
        "key": key,
        "n_runs": int(len(data)),
        "r2": float(r2),
        "coef": {n: float(c) for n, c in zip(names, coef)},
        "coef_ci": {
            n: [float(lo), float(hi)]
            for n, lo, hi in zip(names, np.percentile(boot_coef, 2.5, 0), np.percentile(boot_coef, 97.5, 0))
        },
    }
    if Xt is not None:
        pred, boot_pred = np.exp(Xt @ coef), np.exp(np.array(boot_pred))
        out["predicted"] = pred.tolist()
        out["predicted_ci"] = np.stack(
            [np.percentile(boot_pred, 2.5, 0), np.percentile(boot_pred, 97.5, 0)], 1
        ).tolist()
    return out


def holdout_check(train: pd.DataFrame, held: pd.DataFrame, key: str) -> dict:
    """Fit on `train`, predict the seed means of each held-out design point; R^2 in log space
    over held-out runs, and the predicted / measured ratio per held-out point."""
    coef = _lstsq(design_matrix(train), np.log(train[key].to_numpy(float)))
    y = np.log(held[key].to_numpy(float))
    pred = design_matrix(held) @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    points = (
        held.assign(predicted=np.exp(pred))
        .groupby([*GEOMETRY], as_index=False)
        .agg(measured=(key, "mean"), predicted=("predicted", "first"))
    )
    points["ratio"] = points["predicted"] / points["measured"]
    return {
        "r2_holdout": 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
        "rmse_log": float(np.sqrt(ss_res / len(y))),
        "points": points,
    }


def flip_vs_margin(df: pd.DataFrame, *, by: Sequence[str] = (), edges: Sequence[float] = MARGIN_EDGES) -> pd.DataFrame:
    """P(a (token, layer) top-k set flips at an off-policy update | the old router's margin bin).

    Pools the `route/flip_vs_margin/{n,flips}/bin_{b}` counts of every step of every run (per
    group of `by`). Columns: by..., bin, margin_lo, margin_hi, n, flips, p, p_lo, p_hi (Wilson 95%).
    """
    counts = df[df["key"].str.startswith(FLIP_VS_MARGIN_PREFIX)]
    if counts.empty:
        raise ValueError("no route/flip_vs_margin/* counts in these runs (logged since the router-shift release)")
    parts = counts["key"].str.extract(r"^route/flip_vs_margin/(?P<kind>n|flips)/bin_(?P<bin>\d+)$")
    keep = parts["kind"].notna()  # the gap/movement counts (`.../move/...`) have their own curve (moe_rl.forecast)
    counts = counts[keep].assign(kind=parts["kind"][keep], bin=parts["bin"][keep].astype(int))
    table = counts.pivot_table(index=[*by, "bin"], columns="kind", values="value", aggfunc="sum").reset_index()
    table = table.rename_axis(columns=None)
    table["n"], table["flips"] = table["n"].round().astype(int), table["flips"].round().astype(int)
    table["margin_lo"] = [edges[b] for b in table["bin"]]
    table["margin_hi"] = [edges[b + 1] for b in table["bin"]]
    table["p"] = np.where(table["n"] > 0, table["flips"] / table["n"].clip(lower=1), np.nan)
    bounds = [wilson_interval(int(k), int(n)) if n else (np.nan, np.nan) for k, n in zip(table["flips"], table["n"])]
    table["p_lo"] = [lo for lo, _ in bounds]
    table["p_hi"] = [hi for _, hi in bounds]
    return table[[*by, "bin", "margin_lo", "margin_hi", "n", "flips", "p", "p_lo", "p_hi"]]


# --- figures (returned, never saved) ------------------------------------------------------------

AXES = (("num_experts", "experts E"), ("top_k", "top-k"), ("num_moe_layers", "MoE layers L"), ("lr", "learning rate"))
SHORT = {
    DRIFT_KEYS[0]: "activated experts changed",
    DRIFT_KEYS[1]: "top-k sets changed",
    DRIFT_KEYS[2]: "tokens with a changed layer",
}


def on_axis(table: pd.DataFrame, factor: str, centre: dict) -> pd.DataFrame:
    """Runs whose geometry equals `centre` in every factor except `factor`."""
    keep = np.ones(len(table), bool)
    for other, _ in AXES:
        if other != factor:
            keep &= np.isclose(table[other].to_numpy(float), float(centre[other]))
    return table[keep]


def plot_drift_scaling(
    table: pd.DataFrame, centre: dict, fits: dict | None = None, keys: Sequence[str] = DRIFT_KEYS
) -> Figure:
    """Drift against each factor with the others at the centre: one row per drift key, one column
    per factor; dots are runs, black markers seed means, the line the fitted power law."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig = Figure(figsize=(13, 3.0 * len(keys)), layout="constrained")
    axes = fig.subplots(len(keys), len(AXES), sharey="row", squeeze=False)
    for r, key in enumerate(keys):
        for c, (factor, label) in enumerate(AXES):
            ax = axes[r][c]
            sub = on_axis(table, factor, centre)
            ax.scatter(sub[factor], sub[key] * 100, s=12, color="0.6", label="run")
            means = sub.groupby(factor)[key].mean()
            ax.plot(means.index, means.to_numpy() * 100, "ko", ms=6, label="mean of seeds")
            if fits and key in fits and len(means):
                grid = np.geomspace(means.index.min(), means.index.max(), 50)
                rows = pd.DataFrame({**{f: np.full(50, float(centre[f])) for f, _ in AXES}, factor: grid})
                coef = np.array(list(fits[key]["coef"].values()))
                ax.plot(grid, np.exp(design_matrix(rows) @ coef) * 100, "-", color="tab:blue", label="power-law fit")
            ax.set_xscale("log", base=2 if factor != "lr" else 10)
            ax.set_yscale("log")
            ax.set_xlabel(label)
            levels = sorted(sub[factor].unique())
            ax.set_xticks(levels, [f"{v:g}" for v in levels])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "235" else ""))
            if c == 0:
                ax.set_ylabel(f"% {SHORT.get(key, key)}\nper off-policy update")
            ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=8)
    others = ", ".join(f"{label}={centre[f]:g}" for f, label in AXES)
    fig.suptitle(f"Routing drift per off-policy update, GRPO without replay, N = 4 (others at the centre: {others})")
    return fig


def plot_flip_vs_margin(curve: pd.DataFrame, *, by: str | None = None) -> Figure:
    """P(flip at an off-policy update) against the old router's k-th vs (k+1)-th margin, Wilson 95% bars."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    groups = [(None, curve)] if by is None else list(curve.groupby(by))
    for i, (name, sub) in enumerate(groups):
        sub = sub[sub["n"] > 0]
        lo = sub["margin_lo"].clip(lower=3e-5)
        hi = sub["margin_hi"].where(np.isfinite(sub["margin_hi"]), 1.0)
        x = np.sqrt(lo * hi)  # geometric bin centre
        ax.errorbar(
            x * (1.06**i),
            sub["p"],
            yerr=[sub["p"] - sub["p_lo"], sub["p_hi"] - sub["p"]],
            marker="o",
            capsize=3,
            label="all runs" if name is None else f"{by}={name}",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("old router margin: p(k-th) - p((k+1)-th expert)")
    ax.set_ylabel("P(top-k set flips at an off-policy update)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title("What predicts a flip: pooled (token, layer) counts per margin bin")
    return fig
