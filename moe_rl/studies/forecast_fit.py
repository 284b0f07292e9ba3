"""A drift forecast in units that transfer: P(top-k set flips) as one curve of margin / movement.

A (token, layer) flips when an update moves its router logits across the top-k boundary, so with
g the old k-th vs (k+1)-th logit gap and sigma_l the RMS change of that gap at its layer in the
update (`moe_rl.routing.compare.boundary_movement`), the flip probability should depend on
x = g / sigma_l alone, whatever E, k, L and lr produced g and sigma_l. The loop logs per update
sigma (`route/old_vs_new/move/*`) and (t, l) counts per x bin (`route/flip_vs_margin/move/*`).
Here: pool the counts into one curve F(x), predict a run's flip rate from its own x counts, test
whether geometry and lr still matter once x is in, and turn a measured gap sample plus a movement
into a forecast (`predict_flips`, what `python -m moe_rl.forecast` prints).

The forecast is for a window of a run, steps 11-40 (`WINDOW`), from a probe of its first 3 steps
(`PROBE_STEPS`): `movement_decay` measures sigma_window / sigma_probe per run, `fit_decay` makes it
one constant, and `window_forecast` moves each probe (t, l) from x to x / decay (`shifted_rate`) to
forecast the window's flip rate, validated against the window's measured counts (`window_points`).

Pure functions over the long-format frame of `load_results` and over arrays.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pandas as pd

from moe_rl.analysis.stats import wilson_interval
from moe_rl.metrics.bins import MOVE_EDGES
from moe_rl.metrics.names import (
    EXPERT_FLIP_FRAC,
    FLIP_RATE,
    FLIP_VS_MOVE_PREFIX,
    ROUTE_EXPERT_FLIP_FRAC,
    ROUTE_FLIP_RATE,
    ROUTE_MOVE_RMS,
    ROUTE_TOKEN_FLIP_RATE,
    TOKEN_FLIP_RATE,
    offpolicy_key,
)
from moe_rl.studies.drift import GEOMETRY, fit_drift

MOVE_COUNT = rf"^{re.escape(FLIP_VS_MOVE_PREFIX)}(?P<kind>n|flips)/bin_(?P<bin>\d+)$"
SIGMA_KEY = offpolicy_key(ROUTE_MOVE_RMS)
FLIP_KEY = offpolicy_key(ROUTE_FLIP_RATE)
EXPERT_KEY = offpolicy_key(ROUTE_EXPERT_FLIP_FRAC)
TOKEN_KEY = offpolicy_key(ROUTE_TOKEN_FLIP_RATE)


def move_counts(df: pd.DataFrame, *, start_step: int = 11, end_step: int | None = None) -> pd.DataFrame:
    """(t, l) counts per x bin and run, summed over the off-policy updates of steps start_step..end_step
    (None: to the end).

    One row per run and bin: run, seed, geometry columns, bin, n, flips. The first steps after the
    cold start are skipped as in `drift_per_run` (the policy is still sharpening).
    """
    in_steps = df["step"] >= start_step
    if end_step is not None:
        in_steps &= df["step"] <= end_step
    rows = df[df["key"].str.match(MOVE_COUNT) & in_steps]
    if rows.empty:
        raise ValueError("no route/flip_vs_margin/move/* counts at these steps (logged since the drift forecast)")
    parts = rows["key"].str.extract(MOVE_COUNT)
    rows = rows.assign(kind=parts["kind"], bin=parts["bin"].astype(int))
    table = rows.pivot_table(index=["run", "seed", *GEOMETRY, "bin"], columns="kind", values="value", aggfunc="sum")
    table = table.reset_index().rename_axis(columns=None)
    table["n"], table["flips"] = table["n"].round().astype(int), table["flips"].round().astype(int)
    return table


def flip_curve(counts: pd.DataFrame, edges: Sequence[float] = MOVE_EDGES) -> pd.DataFrame:
    """F(x): pooled P(flip) per x bin with Wilson 95% intervals.

    Columns: bin, x_lo, x_hi, n, flips, p, p_lo, p_hi. A bin without (t, l) has p NaN.
    """
    pooled = counts.groupby("bin")[["n", "flips"]].sum().reindex(range(len(edges) - 1), fill_value=0).astype(int)
    curve = pooled.reset_index()
    curve["x_lo"] = [edges[b] for b in curve["bin"]]
    curve["x_hi"] = [edges[b + 1] for b in curve["bin"]]
    curve["p"] = np.where(curve["n"] > 0, curve["flips"] / curve["n"].clip(lower=1), np.nan)
    bounds = [wilson_interval(int(k), int(n)) for k, n in zip(curve["flips"], curve["n"])]
    curve["p_lo"] = [lo for lo, _ in bounds]
    curve["p_hi"] = [hi for _, hi in bounds]
    return curve[["bin", "x_lo", "x_hi", "n", "flips", "p", "p_lo", "p_hi"]]


def predicted_vs_measured(counts: pd.DataFrame, curve: pd.DataFrame) -> pd.DataFrame:
    """Per run: measured flip rate (sum flips / sum n), predicted sum_b n_b F_b / sum n and their ratio.

    The prediction uses only the run's x distribution (its gaps and movements) and the curve; a
    curve that holds across geometries gives ratios near 1 on runs it was not fitted on.
    """
    p = curve.set_index("bin")["p"].fillna(0.0)
    frame = counts.assign(expected=counts["n"] * counts["bin"].map(p))
    runs = frame.groupby(["run", "seed", *GEOMETRY], as_index=False)[["n", "flips", "expected"]].sum()
    runs["measured"] = runs["flips"] / runs["n"]
    runs["predicted"] = runs["expected"] / runs["n"]
    runs["ratio"] = runs["predicted"] / runs["measured"]
    return runs


def point_ratios(runs: pd.DataFrame) -> pd.DataFrame:
    """Per design point (geometry and lr): pooled predicted / measured over its seeds, and the spread
    of the per-seed ratios (min, max)."""
    g = runs.groupby(list(GEOMETRY), as_index=False)
    out = g.agg(
        seeds=("seed", "nunique"),
        n=("n", "sum"),
        flips=("flips", "sum"),
        expected=("expected", "sum"),
        ratio_min=("ratio", "min"),
        ratio_max=("ratio", "max"),
    )
    out["measured"] = out["flips"] / out["n"]
    out["predicted"] = out["expected"] / out["n"]
    out["ratio"] = out["predicted"] / out["measured"]
    return out


def residual_dependence(runs: pd.DataFrame, *, n_boot: int = 2000, seed: int = 0) -> dict:
    """Does geometry or lr still matter once x is in? The power law of `fit_drift` fitted to each
    run's predicted / measured ratio: exponents whose intervals hold 0 say no."""
    return fit_drift(runs, "ratio", n_boot=n_boot, seed=seed)


def bin_index(x: np.ndarray, edges: Sequence[float] = MOVE_EDGES) -> np.ndarray:
    """Bin of each x in `edges` (bin b holds [edges[b], edges[b+1])), as `torch.bucketize(right=True)`."""
    return np.searchsorted(np.asarray(edges[1:-1], dtype=float), x, side="right")


def predict_flips(
    gaps: np.ndarray, sigma: np.ndarray, curve_p: np.ndarray, edges: Sequence[float] = MOVE_EDGES
) -> tuple[float, float]:
    """(per-(t, l) flip rate, share of tokens with a changed layer) forecast for one update.

    gaps (n, L): the old router's k-th vs (k+1)-th logit gap of n tokens at each MoE layer; sigma
    (L,): the movement per layer (RMS change of that gap in an update); curve_p: F per bin of
    x = gap / sigma. flip rate = mean_{t,l} F(x); token share = mean_t [1 - prod_l (1 - F(x_tl))],
    which assumes layers flip independently given their x.
    """
    gaps, sigma, curve_p = np.asarray(gaps, float), np.asarray(sigma, float), np.asarray(curve_p, float)
    if gaps.ndim != 2 or sigma.shape != (gaps.shape[1],):
        raise ValueError(f"gaps must be (tokens, layers) and sigma (layers,), got {gaps.shape} and {sigma.shape}")
    if len(curve_p) != len(edges) - 1 or not np.all(np.isfinite(curve_p)):
        raise ValueError(f"curve_p needs one finite probability per bin ({len(edges) - 1}), got {curve_p}")
    with np.errstate(divide="ignore"):
        x = np.where(sigma > 0, gaps / sigma, np.inf)  # (n, L)
    f = curve_p[bin_index(x, edges)]  # (n, L)
    return float(f.mean()), float((1.0 - np.prod(1.0 - f, axis=1)).mean())


def sigma_for_rate(
    gaps: np.ndarray, sigma: np.ndarray, curve_p: np.ndarray, level: float, edges: Sequence[float] = MOVE_EDGES
) -> float:
    """The factor c by which the movement `sigma` must grow for the forecast flip rate to reach `level`
    (bisection in log c over [1e-3, 1e4]); inf when the curve cannot reach it (level above F's ceiling)."""

    def rate(c: float) -> float:
        return predict_flips(gaps, sigma * c, curve_p, edges)[0]

    lo, hi = 1e-3, 1e4
    if rate(hi) < level:
        return float("inf")
    if rate(lo) >= level:
        return lo
    for _ in range(60):
        mid = float(np.sqrt(lo * hi))
        lo, hi = (mid, hi) if rate(mid) < level else (lo, mid)
    return float(np.sqrt(lo * hi))


def sigma_vs_lr(df: pd.DataFrame, *, start_step: int = 11) -> pd.DataFrame:
    """One row per run: geometry, seed and the mean over steps >= start_step of the off-policy movement
    sigma and of the drift keys (flip rate, activated experts changed, tokens with a changed layer)."""
    keys = [SIGMA_KEY, FLIP_KEY, EXPERT_KEY, TOKEN_KEY]
    rows = df[df["key"].isin(keys) & (df["step"] >= start_step)]
    if rows.empty:
        raise ValueError(f"no values of {keys} at steps >= {start_step}")
    table = rows.pivot_table(index=["run", "seed", *GEOMETRY], columns="key", values="value", aggfunc="mean")
    return table.reset_index().rename_axis(columns=None)


# --- from the probe to a window of the run ---------------------------------------------------------

PROBE_STEPS = (1, 3)  # the steps `python -m moe_rl.forecast` runs to measure the movement (--probe-steps 3)
WINDOW = (11, 40)  # the steps of a run the forecast is for: what the drift sweeps average (start_step 11)


def movement_decay(
    df: pd.DataFrame, *, probe: tuple[int, int] = PROBE_STEPS, window: tuple[int, int] = WINDOW
) -> pd.DataFrame:
    """One row per run: geometry, seed, the mean off-policy movement sigma over the probe steps and over
    the window steps (inclusive ranges), and decay = sigma_window / sigma_probe."""
    rows = df[df["key"] == SIGMA_KEY]
    index = ["run", "seed", *GEOMETRY]
    parts = []
    for name, (lo, hi) in (("sigma_probe", probe), ("sigma_window", window)):
        part = rows[rows["step"].between(lo, hi)].groupby(index)["value"].mean().rename(name)
        if part.empty:
            raise ValueError(f"no {SIGMA_KEY} at steps {lo}-{hi}")
        parts.append(part)
    out = pd.concat(parts, axis=1, join="inner").reset_index()
    out["decay"] = out["sigma_window"] / out["sigma_probe"]
    return out


def fit_decay(decay: Sequence[float] | np.ndarray) -> dict[str, float]:
    """The window / probe movement ratio as one constant: the geometric mean of the runs' ratios, with
    their range and the spread of log ratio (sd). A run without probe movement has no ratio: an error."""
    d = np.asarray(decay, float)
    if len(d) == 0 or not np.all(np.isfinite(d) & (d > 0)):
        raise ValueError(f"decay ratios must be finite and > 0, got {d}")
    logs = np.log(d)
    return {
        "decay": float(np.exp(logs.mean())),
        "min": float(d.min()),
        "max": float(d.max()),
        "log_sd": float(logs.std(ddof=1)) if len(d) > 1 else 0.0,
        "n_runs": len(d),
    }


def shifted_rate(
    n: Sequence[float] | np.ndarray,
    curve_p: np.ndarray,
    factor: float,
    edges: Sequence[float] = MOVE_EDGES,
    points: int = 64,
) -> float:
    """Flip rate from binned x = gap / sigma counts when the movement becomes factor * sigma.

    n: (t, l) count per x bin; each (t, l) moves to x / factor and takes F of the bin it lands in. Within
    a finite bin x is taken as uniform (`points` midpoints), the open last bin as its lower edge (exact for
    factor <= 1: F is constant there). factor 1 gives sum_b n_b F_b / sum n, as `predicted_vs_measured`.
    """
    n, curve_p = np.asarray(n, float), np.asarray(curve_p, float)
    if len(n) != len(edges) - 1 or len(curve_p) != len(edges) - 1 or not factor > 0:
        raise ValueError(f"need one count and one F per bin ({len(edges) - 1}) and factor > 0, got {len(n)}, {factor}")
    if n.sum() <= 0:
        raise ValueError("no (token, layer) pairs to forecast")
    f = np.zeros(len(n))
    mid = (np.arange(points) + 0.5) / points
    for b in range(len(n)):
        lo, hi = edges[b], edges[b + 1]
        x = np.array([lo]) if not np.isfinite(hi) else lo + (hi - lo) * mid
        f[b] = curve_p[bin_index(x / factor, edges)].mean()
    return float((n * f).sum() / n.sum())


def window_forecast(
    probe_counts: pd.DataFrame,
    window_counts: pd.DataFrame,
    curve: pd.DataFrame,
    decay: pd.DataFrame,
    fitted_decay: float,
    edges: Sequence[float] = MOVE_EDGES,
) -> pd.DataFrame:
    """Per run: the forecast of the window's flip rate from the probe and its measured value.

    probe_counts / window_counts: `move_counts` over the probe and the window steps; decay: rows of
    `movement_decay`. Columns: probe_measured (flips / n in the probe), probe_curve (F at the probe's own
    movement: the per-update forecast of the probe), window_forecast (the probe's x counts at the movement
    times `fitted_decay`), window_own_decay (at the run's own measured decay: what is left is the change of
    the gaps), window_measured (flips / n in the window), n_window, flips_window.
    """
    p = curve.set_index("bin")["p"].reindex(range(len(edges) - 1)).fillna(0.0).to_numpy(float)
    own = decay.set_index("run")["decay"]
    window = window_counts.groupby("run")[["n", "flips"]].sum()
    rows = []
    for run, g in probe_counts.groupby("run"):
        if run not in window.index or run not in own.index:
            continue
        n = g.set_index("bin")["n"].reindex(range(len(edges) - 1), fill_value=0).to_numpy(float)
        rows.append(
            {
                "run": run,
                **{k: g[k].iloc[0] for k in ("seed", *GEOMETRY)},
                "decay": float(own[run]),
                "probe_measured": g["flips"].sum() / g["n"].sum(),
                "probe_curve": shifted_rate(n, p, 1.0, edges),
                "window_forecast": shifted_rate(n, p, fitted_decay, edges),
                "window_own_decay": shifted_rate(n, p, float(own[run]), edges),
                "n_window": int(window.loc[run, "n"]),
                "flips_window": int(window.loc[run, "flips"]),
            }
        )
    if not rows:
        raise ValueError("no run has counts in both the probe and the window")
    out = pd.DataFrame(rows)
    out["window_measured"] = out["flips_window"] / out["n_window"]
    return out


def window_points(runs: pd.DataFrame) -> pd.DataFrame:
    """Per design point: the seeds' forecasts weighted by their window (t, l) counts, the pooled measured
    window flip rate, and the ratios window_forecast / measured (`ratio`), probe_curve / measured
    (`ratio_probe_curve`: the probe forecast read as the run's drift) and window_own_decay / measured."""
    cols = ["probe_measured", "probe_curve", "window_forecast", "window_own_decay", "decay"]
    w = runs.assign(**{c: runs[c] * runs["n_window"] for c in cols})
    out = w.groupby(list(GEOMETRY), as_index=False).agg(
        seeds=("seed", "nunique"),
        n_window=("n_window", "sum"),
        flips_window=("flips_window", "sum"),
        **{c: (c, "sum") for c in cols},
    )
    for c in cols:
        out[c] = out[c] / out["n_window"]
    out["window_measured"] = out["flips_window"] / out["n_window"]
    out["ratio"] = out["window_forecast"] / out["window_measured"]
    out["ratio_probe_curve"] = out["probe_curve"] / out["window_measured"]
    out["ratio_own_decay"] = out["window_own_decay"] / out["window_measured"]
    return out


def power_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(a, b) of log y = a + b log x by least squares (e.g. movement against learning rate)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2 or np.ptp(np.log(x)) == 0:
        raise ValueError("a power law needs at least two distinct x values")
    b, a = np.polyfit(np.log(x), np.log(y), 1)
    return float(a), float(b)


def simulate_flips(
    logits: np.ndarray, sigma: np.ndarray, k: int, *, draws: int = 4, seed: int = 0, scale: float = 1.0
) -> dict[str, float]:
    """Drift under a Gaussian model of the update: every router logit moves by iid N(0, s_l^2).

    logits (n, L, E): the old router's log selection probabilities of n tokens (logits up to a per-row
    constant); sigma (L,): the measured RMS change of the boundary gap, so s_l = scale * sigma_l / sqrt(2)
    (a gap is a difference of two logits). Unlike the boundary curve this counts every expert that
    leaves the top-k, so it reaches the regime where several experts of a router change at once.
    Returns the mean over `draws` (same noise for every `scale`, so the result is smooth in it) of
    flip_rate, expert_flip_frac and token_flip_rate, as the route metrics define them.
    """
    logits, sigma = np.asarray(logits, float), np.asarray(sigma, float)
    if logits.ndim != 3 or sigma.shape != (logits.shape[1],) or not 0 < k < logits.shape[2]:
        raise ValueError(
            f"logits must be (n, L, E) with 0 < k < E and sigma (L,), got {logits.shape}, {sigma.shape}, k={k}"
        )
    rng = np.random.default_rng(seed)
    old = _topk_mask(logits, k)
    s = (scale * sigma / np.sqrt(2.0))[None, :, None]
    out = np.zeros(3)
    for _ in range(draws):
        new = _topk_mask(logits + s * rng.standard_normal(logits.shape), k)
        overlap = (old & new).sum(-1)  # (n, L)
        flipped = overlap < k
        out += [flipped.mean(), (1.0 - overlap / k).mean(), flipped.any(-1).mean()]
    out /= draws
    return dict(zip((FLIP_RATE, EXPERT_FLIP_FRAC, TOKEN_FLIP_RATE), out.tolist()))


def _topk_mask(x: np.ndarray, k: int) -> np.ndarray:
    """Boolean (..., E): True at the k largest entries of the last axis."""
    idx = np.argpartition(-x, k - 1, axis=-1)[..., :k]
    mask = np.zeros(x.shape, bool)
    np.put_along_axis(mask, idx, True, axis=-1)
    return mask


def scale_for_level(
    logits: np.ndarray,
    sigma: np.ndarray,
    k: int,
    level: float,
    *,
    key: str = EXPERT_FLIP_FRAC,
    draws: int = 2,
    seed: int = 0,
) -> float:
    """The factor on the measured movement at which `simulate_flips` reaches `level` of `key`
    (bisection in log scale over [1e-2, 1e3], common random numbers); inf when even 1e3 does not."""

    def value(c: float) -> float:
        return simulate_flips(logits, sigma, k, draws=draws, seed=seed, scale=c)[key]

    lo, hi = 1e-2, 1e3
    if value(hi) < level:
        return float("inf")
    if value(lo) >= level:
        return lo
    for _ in range(30):
        mid = float(np.sqrt(lo * hi))
        lo, hi = (mid, hi) if value(mid) < level else (lo, mid)
    return float(np.sqrt(lo * hi))
