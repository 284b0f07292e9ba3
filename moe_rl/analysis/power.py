"""How many cold starts a paired contrast needs: variance components, power, cost, and the interval on start means.

A contrast of arm A against a reference B is a set of paired differences d = A - B, one per (start, seed), the
seeds nested in starts. With sigma_b the SD of the starts' true mean differences and sigma_w the SD of a pair
around its start's mean, a start with m seeds has a mean of variance sigma_b^2 + sigma_w^2 / m, and the contrast
is the one-sample t test on the C start means (`start_mean_interval`). So:

- `variance_components`: sigma_b, sigma_w and the ICC from the one-way random-effects ANOVA of the differences on
  their start (unbalanced: n0 = (N - sum n_i^2 / N) / (C - 1); sigma_b^2 = max(0, (MSB - MSW) / n0));
- `starts_needed` / `detectable_difference`: the starts C that detect a true difference `mde` with the given power
  by that t test (statsmodels' `TTestPower`, the noncentral t), and its inverse at a given C;
- `cheaper_design`: 1 against 2 seeds per start, priced by a warm-up (one per start, shared by both arms) and a run
  (a pair is two runs);
- `contrast_power`: all of it for arm A against B from a table of runs (one row per run: arm, start, seed, value);
- `start_mean_interval` / `t_interval`: the Student t interval and p on start means, the interval a contrast reads.

Pure functions over tidy frames; `load_outcomes` reads a results folder into the per-run table (torch-free).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import optimize, stats
from statsmodels.stats.power import TTestPower

from moe_rl.analysis.clustered import cluster_means

SEEDS = (1, 2)  # the designs `cheaper_design` compares: seeds per start
RUN_KEYS_NOT_STRATA = ("run", "seed", "start", "cold_seed", "cold_member", "experiment")


# --- variance components -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VarianceComponents:
    """The one-way random-effects ANOVA of paired differences on their start. `sd_within` is NaN where no start has
    two pairs; `var_between_raw` is the untruncated (unbiased) (MSB - MSW) / n0."""

    n_starts: int
    n_pairs: int
    mean: float  # the mean of the start means (each start weighs the same)
    sd_between: float
    sd_within: float
    icc: float
    msb: float
    msw: float
    n0: float
    var_between_raw: float

    @property
    def seeds_per_start(self) -> float:
        """Pairs per start on average (n_pairs / n_starts)."""
        return self.n_pairs / self.n_starts if self.n_starts else math.nan


def variance_components(frame: pd.DataFrame, start_col: str = "start", value_col: str = "diff") -> VarianceComponents:
    """Between-start SD (of the true start means), within-start SD, ICC and counts of the finite `value_col` of
    `frame` (one row per (start, seed) pair; starts with one pair count in the between mean square only).

    One-way random-effects ANOVA (unbalanced): MSB = sum n_i (mean_i - grand)^2 / (C - 1), MSW = sum (d - mean_i)^2
    / (N - C), n0 = (N - sum n_i^2 / N) / (C - 1); sigma_w^2 = MSW, sigma_b^2 = max(0, (MSB - MSW) / n0), ICC =
    sigma_b^2 / (sigma_b^2 + sigma_w^2) (equal to `clustered.intraclass_correlation` where MSB > MSW). Without
    a start of two pairs sigma_w is not identified (NaN) and sd_between is the SD of the start means, which then
    holds both. NaN below 2 starts."""
    d = frame[[start_col, value_col]].copy()
    d[value_col] = pd.to_numeric(d[value_col], errors="coerce")
    d = d[np.isfinite(d[value_col])]
    g = d.groupby(start_col, sort=False)[value_col]
    n, means = g.size().to_numpy(float), g.mean().to_numpy(float)
    C, N = len(n), int(n.sum())
    mean = float(means.mean()) if C else math.nan
    nan = math.nan
    if C < 2:
        return VarianceComponents(C, N, mean, nan, nan, nan, nan, nan, nan, nan)
    grand = float(d[value_col].mean())
    msb = float((n * (means - grand) ** 2).sum() / (C - 1))
    n0 = float((N - (n**2).sum() / N) / (C - 1))
    if N == C:  # one pair per start: the two components are confounded
        sd = float(np.std(means, ddof=1))
        return VarianceComponents(C, N, mean, sd, nan, nan, msb, nan, n0, nan)
    resid = d[value_col].to_numpy(float) - d[start_col].map(g.mean()).to_numpy(float)
    msw = float((resid**2).sum() / (N - C))
    raw = (msb - msw) / n0
    vb = max(0.0, raw)
    icc = vb / (vb + msw) if vb + msw > 0 else nan
    return VarianceComponents(C, N, mean, math.sqrt(vb), math.sqrt(msw), icc, msb, msw, n0, raw)


# --- power of the t test on start means ----------------------------------------------------------------------


def start_mean_sd(sd_between: float, sd_within: float, seeds_per_start: float) -> float:
    """The SD of a start's mean paired difference: sqrt(sigma_b^2 + sigma_w^2 / m). A NaN sigma_w (not identified)
    counts as 0: then sigma_b is the SD of the start means as observed."""
    sw = 0.0 if not np.isfinite(sd_within) else sd_within
    if seeds_per_start <= 0:
        raise ValueError(f"seeds_per_start must be > 0, got {seeds_per_start}")
    return math.sqrt(sd_between**2 + sw**2 / seeds_per_start)


def _alternative(sides: int) -> str:
    if sides not in (1, 2):
        raise ValueError(f"sides must be 1 or 2, got {sides}")
    return "two-sided" if sides == 2 else "larger"


def power_at(
    sd_between: float,
    sd_within: float,
    difference: float,
    starts: int,
    seeds_per_start: float,
    alpha: float = 0.05,
    sides: int = 2,
) -> float:
    """The power of the one-sample t test on `starts` start means (each of `seeds_per_start` pairs) against a true
    mean difference `difference` (statsmodels' `TTestPower`: the noncentral t)."""
    sd = start_mean_sd(sd_between, sd_within, seeds_per_start)
    effect = abs(difference) / sd if sd > 0 else math.inf
    return float(TTestPower().power(effect, starts, alpha, alternative=_alternative(sides)))


def starts_needed(
    sd_between: float,
    sd_within: float,
    mde: float,
    seeds_per_start: float,
    power: float = 0.8,
    alpha: float = 0.05,
    sides: int = 2,
) -> int:
    """The fewest starts C (at least 2) whose one-sample t test on start means detects a true mean difference `mde`
    with probability `power`: C = ceil of statsmodels' `TTestPower.solve_power` (effect size mde / sqrt(sigma_b^2
    + sigma_w^2 / m)), checked on the integer so that power_at(C) >= power > power_at(C - 1) (to 1e-9)."""
    if not mde > 0:
        raise ValueError(f"mde must be > 0, got {mde}")
    sd = start_mean_sd(sd_between, sd_within, seeds_per_start)
    if sd == 0:
        return 2
    effect, alt = mde / sd, _alternative(sides)
    solver = TTestPower()

    def reached(c: int) -> bool:  # within 1e-9: `detectable_difference` at C gives back C
        return bool(solver.power(effect, c, alpha, alternative=alt) >= power - 1e-9)

    if reached(2):
        return 2
    c = max(2, math.ceil(float(solver.solve_power(effect, None, alpha, power, alternative=alt)) - 1e-6))
    while c > 2 and reached(c - 1):
        c -= 1
    while not reached(c):
        c += 1
    return int(c)


def detectable_difference(
    sd_between: float,
    sd_within: float,
    starts: float,
    seeds_per_start: float,
    power: float = 0.8,
    alpha: float = 0.05,
    sides: int = 2,
) -> float:
    """The smallest true mean difference that `starts` starts (of `seeds_per_start` pairs each) detect with
    probability `power` by the t test on start means: the inverse of `starts_needed` (statsmodels solves for the
    effect size, times the start mean's SD). NaN below 2 starts."""
    if starts < 2:
        return math.nan
    sd = start_mean_sd(sd_between, sd_within, seeds_per_start)
    solver, alt = TTestPower(), _alternative(sides)
    rough = float(solver.solve_power(None, starts, alpha, power, alternative=alt))

    def gap(e: float) -> float:
        return float(solver.power(e, starts, alpha, alternative=alt)) - power

    # polished to 1e-12 on the same power function (statsmodels' own tolerance leaves ~1e-6 in the power)
    try:
        return float(optimize.brentq(gap, 0.5 * rough, 2 * rough, xtol=1e-14)) * sd
    except ValueError:  # at 2 starts the noncentral t's power is NaN this far out: statsmodels' own answer stands
        return rough * sd


# --- cost --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Design:
    """C starts x m seeds per start: C warm-ups and 2 C m runs (a pair is both arms' runs)."""

    seeds_per_start: int
    starts: int
    runs: int
    cost_s: float


@dataclass(frozen=True)
class CheaperDesign:
    designs: tuple[Design, ...]
    cheaper: int  # seeds per start of the cheaper design (the fewer seeds on a tie)
    break_even_warmup_s: float  # the warm-up cost above which 2 seeds per start is cheaper (inf: never; 0: always)


def cheaper_design(
    sd_between: float,
    sd_within: float,
    mde: float,
    warmup_s: float,
    run_s: float,
    power: float = 0.8,
    alpha: float = 0.05,
    sides: int = 2,
) -> CheaperDesign:
    """1 against 2 seeds per start at the MDE: each design's starts (`starts_needed`), runs (2 x starts x seeds) and
    cost (starts x (warmup_s + 2 x seeds x run_s)), the cheaper one, and the warm-up cost at which they break even:
    with C1, C2 starts needed, 2 seeds is cheaper when warmup_s > run_s (4 C2 - 2 C1) / (C1 - C2)."""
    if warmup_s < 0 or run_s < 0:
        raise ValueError(f"costs must be >= 0, got warmup_s={warmup_s}, run_s={run_s}")
    designs = []
    for m in SEEDS:
        c = starts_needed(sd_between, sd_within, mde, m, power, alpha, sides)
        designs.append(Design(m, c, 2 * c * m, c * (warmup_s + 2 * m * run_s)))
    one, two = designs
    cheaper = two.seeds_per_start if two.cost_s < one.cost_s else one.seeds_per_start
    extra = run_s * (4 * two.starts - 2 * one.starts)  # what 2 seeds costs more in runs
    if one.starts <= two.starts:
        even = math.inf if extra > 0 else 0.0
    else:
        even = max(0.0, extra / (one.starts - two.starts))
    return CheaperDesign(tuple(designs), cheaper, even)


# --- the interval on start means ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartInterval:
    """The one-sample t on start means: mean, [lo, hi], t, two-sided p, df = starts - 1."""

    n_starts: int
    mean: float
    lo: float
    hi: float
    t: float
    p_value: float
    df: int


def t_interval(
    start_means: np.ndarray | Sequence[float], confidence: float = 0.95
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(mean, lo, hi, t, two-sided p) of the one-sample t test of 0 on the last axis of `start_means` (vectorised:
    one row per data set): scipy's `ttest_1samp` and its `confidence_interval`. The interval excludes 0 exactly
    when p < 1 - confidence (one statistic)."""
    x = np.asarray(start_means, dtype=float)
    res = stats.ttest_1samp(x, 0.0, axis=-1)
    ci = res.confidence_interval(confidence)
    return x.mean(-1), np.asarray(ci.low), np.asarray(ci.high), np.asarray(res.statistic), np.asarray(res.pvalue)


def interval_text(values: pd.Series, scale: float = 100.0) -> str:
    """mean [95% t interval over its values] x `scale`, signed to one decimal ("—" without values; the mean alone
    where fewer than 2 values or all equal): a column of start means as a table prints it."""
    v = values.dropna().to_numpy(float)
    if not len(v):
        return "—"
    if len(v) < 2 or np.ptp(v) == 0:
        return f"{scale * v.mean():+.1f}"
    mean, lo, hi, _, _ = t_interval(v)
    return f"{scale * float(mean):+.1f} [{scale * float(lo):+.1f}, {scale * float(hi):+.1f}]"


def start_mean_interval(
    d: Sequence[float] | np.ndarray | pd.Series,
    starts: Sequence[object] | np.ndarray | pd.Series,
    confidence: float = 0.95,
) -> StartInterval:
    """The Student t interval of a contrast: paired differences d, each labelled by its start, reduced to the starts'
    means (each start weighs the same, whatever its seeds), then `t_interval` with starts - 1 degrees of freedom.
    NaN bounds below 2 starts."""
    m = cluster_means(d, starts)
    if len(m) < 2:
        mean = float(m.mean()) if len(m) else math.nan
        return StartInterval(len(m), mean, math.nan, math.nan, math.nan, math.nan, max(len(m) - 1, 0))
    mean, lo, hi, t, p = (float(v) for v in t_interval(m, confidence))
    return StartInterval(len(m), mean, lo, hi, t, p, len(m) - 1)


# --- a contrast from per-run outcomes ----------------------------------------------------------------------------


def paired_differences(
    runs: pd.DataFrame,
    a: str,
    b: str,
    *,
    by: str = "arm",
    value: str = "value",
    start_col: str = "start",
    seed_col: str = "seed",
) -> pd.DataFrame:
    """A - B paired on (start, seed): columns start, seed, a, b, diff (one row per pair both arms ran). Raises where
    an arm has several runs of one (start, seed) (pick a stratum first: `strata`)."""
    keys = [start_col, seed_col]
    sides = []
    for arm, name in ((a, "a"), (b, "b")):
        side = runs.loc[runs[by] == arm, [*keys, value]].rename(columns={value: name})
        if side.duplicated(keys).any():
            raise ValueError(f"{by}={arm!r} has several runs per ({start_col}, {seed_col}): split them first")
        sides.append(side)
    pairs = sides[0].merge(sides[1], on=keys, how="inner")
    pairs["diff"] = pairs["a"] - pairs["b"]
    return pairs.rename(columns={start_col: "start", seed_col: "seed"}).reset_index(drop=True)


@dataclass(frozen=True)
class ContrastPower:
    a: str
    b: str
    stratum: dict[str, object]  # the run keys this contrast was paired within ({} without strata)
    components: VarianceComponents
    interval: StartInterval
    mde: float
    power: float
    alpha: float
    sides: int
    starts_needed: dict[int, int]  # seeds per start -> starts needed at the MDE
    detectable: float  # at the observed starts and seeds per start
    design: CheaperDesign | None
    warmup_s: float | None
    run_s: float | None


def contrast_power(
    runs: pd.DataFrame,
    a: str,
    b: str,
    *,
    mde: float = 0.05,
    by: str = "arm",
    value: str = "value",
    start_col: str = "start",
    seed_col: str = "seed",
    power: float = 0.8,
    alpha: float = 0.05,
    sides: int = 2,
    warmup_s: float | None = None,
    run_s: float | None = None,
    stratum: dict[str, object] | None = None,
) -> ContrastPower:
    """Arm `a` against reference `b` from per-run outcomes (one row per run: `by`, start, seed, `value`): the pairs on
    (start, seed), their variance components, the t interval on start means, the starts needed at 1 and 2 seeds
    per start to detect `mde`, the detectable difference at the observed starts (and seeds per start), and with
    a run's cost the cheaper design: `run_s`, else the median `wall_s` of the two arms' runs where the table has it
    (`warmup_s` default 0)."""
    pairs = paired_differences(runs, a, b, by=by, value=value, start_col=start_col, seed_col=seed_col)
    vc = variance_components(pairs)
    interval = start_mean_interval(pairs["diff"], pairs["start"])
    needed: dict[int, int] = {}
    detectable = math.nan
    design = None
    if run_s is None and "wall_s" in runs:
        walls = pd.to_numeric(runs.loc[runs[by].isin([a, b]), "wall_s"], errors="coerce").dropna()
        run_s = float(walls.median()) if len(walls) else None
    if vc.n_starts >= 2 and np.isfinite(vc.sd_between):
        # without a start of 2 pairs sigma_w is not identified: only the 1-seed design can be sized
        seeds = SEEDS if np.isfinite(vc.sd_within) else (1,)
        needed = {m: starts_needed(vc.sd_between, vc.sd_within, mde, m, power, alpha, sides) for m in seeds}
        m_obs = vc.seeds_per_start if np.isfinite(vc.sd_within) else 1.0
        detectable = detectable_difference(vc.sd_between, vc.sd_within, vc.n_starts, m_obs, power, alpha, sides)
        if run_s is not None and np.isfinite(run_s) and len(seeds) == len(SEEDS):
            design = cheaper_design(vc.sd_between, vc.sd_within, mde, warmup_s or 0.0, run_s, power, alpha, sides)
    return ContrastPower(
        a, b, dict(stratum or {}), vc, interval, mde, power, alpha, sides, needed, detectable, design, warmup_s, run_s
    )


def arm_column(
    runs: pd.DataFrame, contrast: str, candidates: Sequence[str] = ("rung", "arm"), *, others: bool = True
) -> tuple[str, str, str]:
    """(column, A, B) of a contrast written "A-B": the first column of `candidates` (then, with `others`, any other
    column) whose values hold both A and B for some split of the text at a '-' (arm names may hold '-' themselves)."""
    columns = [*candidates, *[c for c in runs.columns if c not in candidates and others]]
    cuts = [i for i, ch in enumerate(contrast) if ch == "-"]
    for col in columns:
        if col not in runs or runs[col].dtype.kind in "fc":
            continue
        values = set(runs[col].dropna().astype(str))
        for i in cuts:
            a, b = contrast[:i], contrast[i + 1 :]
            if a in values and b in values and a != b:
                return col, a, b
    raise KeyError(f"no column of the runs holds both sides of {contrast!r} (write it A-B; tried {columns[:6]}...)")


def strata(runs: pd.DataFrame, a: str, b: str, by: str, keys: Sequence[str]) -> list[str]:
    """The run keys (of `keys`) that vary within arm a's or arm b's runs: a contrast pairs within each of their
    values (e.g. two learning rates per arm), never across them."""
    sub = runs[runs[by].astype(str).isin([a, b])]
    out = []
    for k in keys:
        if k in RUN_KEYS_NOT_STRATA or k == by or k not in sub:
            continue
        if sub.groupby(by)[k].nunique(dropna=False).max() > 1:
            out.append(k)
    return out


def contrast_power_table(
    runs: pd.DataFrame,
    a: str,
    b: str,
    *,
    within: Sequence[str] = (),
    by: str = "arm",
    value: str = "value",
    **kwargs: object,
) -> list[ContrastPower]:
    """`contrast_power` within each combination of the `within` run keys that both arms ran (one row without them)."""
    sub = runs[runs[by].astype(str).isin([a, b])].copy()
    sub[by] = sub[by].astype(str)
    if not within:
        return [contrast_power(sub, a, b, by=by, value=value, **kwargs)]  # type: ignore[arg-type]
    out = []
    for key, g in sub.groupby(list(within), sort=True, dropna=False):
        if set(g[by]) >= {a, b}:
            values = key if isinstance(key, tuple) else (key,)
            stratum = dict(zip(within, values))
            out.append(contrast_power(g, a, b, by=by, value=value, stratum=stratum, **kwargs))  # type: ignore[arg-type]
    return out


def describe(cp: ContrastPower) -> list[str]:
    """The lines a report prints for one contrast."""
    vc, iv = cp.components, cp.interval
    where = ", ".join(f"{k}={v}" for k, v in cp.stratum.items())
    test = f"{'two' if cp.sides == 2 else 'one'}-sided alpha {cp.alpha:g}, power {cp.power:g}"
    lines = [f"{cp.a} - {cp.b}" + (f" at {where}" if where else "") + f": {vc.n_pairs} pairs from {vc.n_starts} starts"]
    if vc.n_starts < 2:
        return [*lines, "  fewer than 2 starts: no components, no power"]
    lines += [
        f"  mean of start means {vc.mean:+.4f}; t interval on start means [{iv.lo:+.4f}, {iv.hi:+.4f}] "
        f"(t {iv.t:.2f}, df {iv.df}, two-sided p {iv.p_value:.3g})",
        f"  between-start SD {vc.sd_between:.4f}, within-start SD {vc.sd_within:.4f}, ICC {vc.icc:.2f} "
        f"(one-way ANOVA: MSB {vc.msb:.3g}, MSW {vc.msw:.3g}, n0 {vc.n0:.2f})",
        f"  starts needed to detect {cp.mde:g} ({test}): "
        + ", ".join(f"{c} at {m} seed{'s' if m > 1 else ''} per start" for m, c in cp.starts_needed.items()),
        f"  detectable difference at {vc.n_starts} starts x {vc.seeds_per_start:.2g} seeds: {cp.detectable:.4f}",
    ]
    if cp.design is None:
        lines.append("  cheaper design: no run cost (pass --run-s, or runs with status.json wall_s)")
        return lines
    d = cp.design
    costs = "; ".join(
        f"{x.seeds_per_start} seed{'s' if x.seeds_per_start > 1 else ''}: {x.starts} starts, {x.runs} runs, "
        f"{x.cost_s / 3600:.2f} h"
        for x in d.designs
    )
    warm = f"warm-up {cp.warmup_s:g} s" if cp.warmup_s is not None else "warm-up not given (0 s)"
    lines.append(f"  cost ({warm}, run {cp.run_s:.1f} s): {costs}; cheaper: {d.cheaper} seed(s) per start")
    lines.append(f"  2 seeds per start is cheaper when a warm-up costs more than {d.break_even_warmup_s:.0f} s")
    return lines


# --- per-run outcomes of a results folder ------------------------------------------------------------------------


def load_outcomes(folder: str | Path) -> pd.DataFrame:
    """One row per finished run under `folder`: its run keys, cold start (`configs.run_starts`), `value` = the
    accuracy change (late accuracy, the mean of the last 3 evaluations, minus step 0: the claims' "change") and
    `wall_s` (status.json). Runs still running, failed or missing are left out."""
    from moe_rl.analysis.load import load_results
    from moe_rl.analysis.outcomes import finished_runs
    from moe_rl.metrics.names import TASK_ACCURACY

    table = finished_runs(load_results(folder, keys=[TASK_ACCURACY]))
    table = table.drop(columns=["start_accuracy", "late_accuracy", "collapsed"]).rename(columns={"change": "value"})
    table["wall_s"] = [run_wall_s(Path(str(d))) for d in table["run_dir"]]
    return table.reset_index(drop=True)


def run_wall_s(run_dir: Path) -> float:
    """A run's own wall seconds (its status.json `wall_s`); NaN where unread."""
    try:
        return float(json.loads((run_dir / "status.json").read_text()).get("wall_s", math.nan))
    except (OSError, ValueError, TypeError):
        return math.nan
