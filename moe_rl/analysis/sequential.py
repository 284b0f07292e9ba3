"""Group-sequential looks at a paired contrast: Lan-DeMets alpha spending with O'Brien-Fleming-type boundaries.

A contrast is read at looks after C_1 < ... < C_K independent starts. Its information is proportional to the
number of starts, so the look's information fraction is t_k = C_k / C_K. The cumulative type-I error spent by
look k is the Lan-DeMets (1983) approximation to O'Brien-Fleming's boundary, as gsDesign's `sfLDOF` defines it:

    f(t; a) = 2 - 2 Phi(Phi^-1(1 - a / 2) / sqrt(t)),   f(1; a) = a,

with a the one-sided level of each side (`alpha / sides`). The boundary c_k of look k is the z that spends
exactly f(t_k) - f(t_(k-1)) there, given that no earlier look crossed: computed look by look from the joint normal
of the z statistics (Z_k = S_k / sqrt(t_k), S a Brownian motion in information time, so corr(Z_i, Z_j) =
sqrt(t_i / t_j)) by the recursive numerical integration of Armitage, McPherson and Rowe (1969; Jennison and
Turnbull 2000, ch. 19): the sub-density of S_k on the continuation region is carried from look to look on a grid
(Simpson's rule), and each boundary is the root (`scipy.optimize.brentq`) of its crossing probability. No
maintained Python package for Lan-DeMets boundaries is installed (gsDesign and rpact are R), so the computation is
this module's; the tests check it against scipy's multivariate normal CDF and the published values.

`sides=1` tests in the claimed direction (reject when Z_k >= c_k); `sides=2` is the symmetric two-sided test
(|Z_k| >= c_k), each side spending f(t; alpha / 2) (gsDesign's two-sided symmetric design): at alpha 0.05 it has
nearly the one-sided boundaries at 0.025.

A look's statistic is the one-sample t on the starts' means of their paired differences (`power.start_mean_interval`),
with C_k - 1 degrees of freedom. `t_to_z` maps it to the z with the same p: z = Phi^-1(1 - p), p = P(T_(C-1) >= t).
Each look's z is then exactly standard normal under the null whatever C_k (a t compared with a normal boundary at
C = 6 would not be: the level would inflate), and only the correlation between looks is the large-sample
sqrt(t_i / t_j); the tests measure the level this keeps by simulation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

REJECT, CONTINUE, STOP = "reject", "continue", "stop at the last look"
GRID = 801  # grid points per look for the recursive integration (odd: Simpson's rule); error well below 1e-6
FUTILITY_GRID = 201  # futility boundaries and repeated p-values, solved many times over: error below 1e-6
WIDTH = 10.0  # the grid spans the mean +- WIDTH standard deviations of S_k where no boundary cuts it


def information_fractions(looks: Sequence[float]) -> np.ndarray:
    """t_k = C_k / C_K for looks after C_1 < ... < C_K starts."""
    c = np.asarray(looks, dtype=float)
    if c.ndim != 1 or not len(c) or np.any(c <= 0) or np.any(np.diff(c) <= 0):
        raise ValueError(f"looks must be positive and strictly increasing, got {list(looks)}")
    return c / c[-1]


def obf_spending(t: float | Sequence[float] | np.ndarray, alpha: float = 0.025, sides: int = 1) -> np.ndarray:
    """The cumulative type-I error spent by information fraction t (Lan-DeMets O'Brien-Fleming type, gsDesign's
    `sfLDOF`): sides x (2 - 2 Phi(Phi^-1(1 - a / 2) / sqrt(t))) with a = alpha / sides the level of each side."""
    _check(alpha, sides)
    a = alpha / sides
    tt = np.asarray(t, dtype=float)
    with np.errstate(divide="ignore"):
        return sides * 2 * stats.norm.sf(stats.norm.isf(a / 2) / np.sqrt(tt))


def _check(alpha: float, sides: int) -> None:
    if sides not in (1, 2):
        raise ValueError(f"sides must be 1 or 2, got {sides}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


def _simpson(lo: float, hi: float, n: int = GRID) -> tuple[np.ndarray, np.ndarray]:
    """Grid points and Simpson weights on [lo, hi] (n odd); an empty grid where the interval is empty."""
    if not hi > lo:
        return np.zeros(0), np.zeros(0)
    x = np.linspace(lo, hi, n)
    w = np.full(n, 2.0)
    w[1::2] = 4.0
    w[0] = w[-1] = 1.0
    return x, w * (hi - lo) / (n - 1) / 3


class _Recursion:
    """The sub-density of S_k = Z_k sqrt(t_k) on look k's continuation region, carried from look to look, with
    drift theta (E[Z_k] = theta sqrt(t_k), E[Z_K] = theta)."""

    def __init__(self, t: np.ndarray, sides: int, drift: float = 0.0, grid: int = GRID) -> None:
        self.t, self.sides, self.drift, self.grid = t, sides, drift, grid
        self.x = self.w = self.f = np.zeros(0)
        self.k = 0  # looks already passed

    def _region(self, k: int, c: float, b: float = -np.inf) -> tuple[float, float]:
        """Look k's continuation region on the S scale (cut to where the density lives): below c, above -c
        (two-sided) or above a futility boundary b (one-sided)."""
        mean, sd = self.drift * self.t[k], np.sqrt(self.t[k])
        hi = min(c * sd, mean + WIDTH * sd) if np.isfinite(c) else mean + WIDTH * sd
        lo = max(-c * sd, mean - WIDTH * sd) if self.sides == 2 and np.isfinite(c) else mean - WIDTH * sd
        if np.isfinite(b):
            lo = max(lo, b * sd)
        return lo, hi

    def crossing_below(self, b: float) -> float:
        """P(no earlier look stopped, look k falls below b), k = the next look (one-sided designs)."""
        k, t = self.k, self.t
        if not np.isfinite(b):
            return 0.0 if b < 0 else 1.0
        if k == 0:
            return float(stats.norm.cdf(b - self.drift * np.sqrt(t[0])))
        dt = t[k] - t[k - 1]
        shift, sd = self.x + self.drift * dt, np.sqrt(dt)
        return float(np.sum(self.w * self.f * stats.norm.cdf((b * np.sqrt(t[k]) - shift) / sd)))

    def crossing(self, c: float) -> float:
        """P(no earlier look crossed, look k crosses at boundary c), k = the next look."""
        k, t = self.k, self.t
        if not np.isfinite(c):
            return 0.0
        if k == 0:
            mean = self.drift * np.sqrt(t[0])
            p = stats.norm.sf(c - mean)
            return float(p + (stats.norm.cdf(-c - mean) if self.sides == 2 else 0.0))
        dt = t[k] - t[k - 1]
        shift, sd = self.x + self.drift * dt, np.sqrt(dt)
        p = stats.norm.sf((c * np.sqrt(t[k]) - shift) / sd)
        if self.sides == 2:
            p = p + stats.norm.cdf((-c * np.sqrt(t[k]) - shift) / sd)
        return float(np.sum(self.w * self.f * p))

    def advance(self, c: float, b: float = -np.inf) -> None:
        """Pass look k with boundary c (and futility boundary b): the sub-density on its continuation region becomes
        the carried one."""
        k, t = self.k, self.t
        x, w = _simpson(*self._region(k, c, b), self.grid)
        if k == 0:
            f = stats.norm.pdf(x, loc=self.drift * t[0], scale=np.sqrt(t[0]))
        else:
            sd = np.sqrt(t[k] - t[k - 1])
            kernel = stats.norm.pdf((x[:, None] - self.x[None, :] - self.drift * (t[k] - t[k - 1])) / sd) / sd
            f = kernel @ (self.w * self.f)
        self.x, self.w, self.f = x, w, f
        self.k += 1


def boundaries(
    looks: Sequence[float], alpha: float = 0.025, sides: int = 1, upto: int | None = None, grid: int = GRID
) -> list[float]:
    """The z boundaries c_1..c_K of looks after C_1 < ... < C_K starts (Lan-DeMets O'Brien-Fleming-type spending,
    `obf_spending`), each solving P(first crossing at look k) = f(t_k) - f(t_(k-1)) under the null. One look gives
    Phi^-1(1 - alpha / sides); a look that spends nothing has boundary +inf. `upto`: the first that many only;
    `grid`: points per look of the recursive integration."""
    t = information_fractions(looks)
    spent = np.diff(np.concatenate([[0.0], obf_spending(t, alpha, sides)]))[:upto]
    rec = _Recursion(t, sides, grid=grid)
    out: list[float] = []
    for k, target in enumerate(spent):
        if target <= 0:
            c = np.inf
        elif k == 0:
            c = float(stats.norm.isf(target / sides))
        else:
            c = float(optimize.brentq(lambda z, p: rec.crossing(z) - p, 0.0, 40.0, args=(target,), xtol=1e-10))
        out.append(c)
        rec.advance(c)
    return out


def crossing_probabilities(
    looks: Sequence[float], bounds: Sequence[float], drift: float = 0.0, sides: int = 1
) -> list[float]:
    """P(the first crossing is at look k), k = 1..K, when E[Z_K] = drift (E[Z_k] = drift sqrt(t_k)); their sum is
    the design's type-I error at drift 0 and its power at a drift > 0. A fixed design of C_K starts with power
    1 - beta at level alpha has drift Phi^-1(1 - alpha / sides) + Phi^-1(1 - beta) (normal theory)."""
    t = information_fractions(looks)
    if len(bounds) != len(t):
        raise ValueError(f"{len(bounds)} boundaries for {len(t)} looks")
    rec = _Recursion(t, sides, drift)
    out = []
    for c in bounds:
        out.append(rec.crossing(float(c)))
        rec.advance(float(c))
    return out


def t_to_z(t: float | np.ndarray, df: float | np.ndarray, sides: int = 1) -> np.ndarray:
    """The z with the one-sample t's p: Phi^-1(1 - P(T_df >= t)) (sides=1: in the claimed, positive direction);
    sides=2: the same for |t|. Exactly standard normal (half-normal for sides=2) under the null at any df."""
    t = np.abs(t) if sides == 2 else np.asarray(t, dtype=float)
    return np.asarray(stats.norm.isf(stats.t.sf(t, df)))


def decide_look(stat: float, look: int, bounds: Sequence[float], *, df: float | None = None, sides: int = 1) -> str:
    """The decision at look `look` (0-based) of the boundaries `bounds`: REJECT where the look's z reaches its
    boundary (|z| for sides=2), else CONTINUE before the last look and STOP at it (the null is not rejected).
    `stat` is a z, or with `df` (the look's starts - 1) the one-sample t on start means, mapped by `t_to_z`."""
    if not 0 <= look < len(bounds):
        raise ValueError(f"look {look} outside 0..{len(bounds) - 1}")
    z = float(t_to_z(stat, df, sides)) if df is not None else (abs(stat) if sides == 2 else float(stat))
    if z >= bounds[look]:
        return REJECT
    return CONTINUE if look < len(bounds) - 1 else STOP


def futility_boundaries(
    looks: Sequence[float], efficacy: Sequence[float], drift: float, beta: float = 0.2
) -> list[float]:
    """Non-binding futility boundaries b_1..b_(K-1) of a one-sided design (gsDesign's test.type 4): b_k spends
    g(t_k) - g(t_(k-1)) of the type-II error under the alternative E[Z_K] = `drift`, with g the O'Brien-Fleming-type
    spending function at beta (`obf_spending(t, beta)`), given that no earlier look crossed either boundary
    (continuation b_i < Z_i < c_i, `efficacy` the c_i). A look stops for futility where Z_k < b_k; the efficacy
    boundaries are computed without them (non-binding: ignoring a futility stop keeps the level). The last look
    has none (-inf): there the repeated interval decides. b_k is capped at c_k; a drift <= 0 (no alternative to
    lose power under) gives no futility boundary."""
    t = information_fractions(looks)
    if len(efficacy) != len(t):
        raise ValueError(f"{len(efficacy)} efficacy boundaries for {len(t)} looks")
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    out = [-np.inf] * len(t)
    if not drift > 0:
        return out
    spent = np.diff(np.concatenate([[0.0], obf_spending(t, beta, 1)]))
    rec = _Recursion(t, 1, drift, FUTILITY_GRID)
    for k in range(len(t) - 1):
        c = float(efficacy[k])
        if spent[k] <= 0:
            b = -np.inf
        else:
            target = float(spent[k])
            below = rec.crossing_below(c)  # P(continue before, Z_k < c_k): the most look k can spend
            b = (
                c
                if below <= target
                else float(optimize.brentq(lambda z, p: rec.crossing_below(z) - p, -40.0, c, (target,)))
            )
        out[k] = b
        rec.advance(c, b)
    return out


def repeated_p_value(looks: Sequence[float], z: Sequence[float], alpha_max: float = 0.5) -> float:
    """The repeated p-value of a one-sided group-sequential test after looks with information `looks` and z values
    `z` (one per look read so far, the earlier ones first): the smallest alpha at which the O'Brien-Fleming-type
    boundaries spending alpha over `looks` (`boundaries`) are reached at some look read. It is valid at any look
    (P(p <= a) <= a under the null), so a family of contrasts can be corrected on it (Holm); `alpha_max` where no
    alpha below it is reached."""
    zs = [float(v) for v in z]
    if not zs or len(zs) > len(looks):
        raise ValueError(f"{len(zs)} z values for {len(looks)} looks")
    if any(math.isinf(v) and v > 0 for v in zs):
        return 0.0

    def crossed(a: float) -> float:
        c = boundaries(looks, a, 1, upto=len(zs), grid=FUTILITY_GRID)
        return max(v - ck for v, ck in zip(zs, c))  # > 0 where some look reaches its boundary at level a

    if crossed(alpha_max) < 0:
        return alpha_max
    lo = 1e-12
    if crossed(lo) >= 0:
        return lo
    return float(optimize.brentq(crossed, lo, alpha_max, xtol=1e-10, rtol=1e-6))


EFFICACY, EXCLUDED, FUTILITY, GO_ON, END = "efficacy", "excluded", "futility", "continue", "end"


@dataclass(frozen=True)
class Look:
    """One look of a contrast read by `read_looks`, in the claimed direction's units where it says so."""

    starts: int
    mean: float  # the mean of start means (the contrast's own sign)
    se: float
    z: float  # the one-sided t in the claimed direction, read as a z (`t_to_z`)
    efficacy: float  # its efficacy boundary c_k
    futility: float  # its futility boundary b_k (-inf: none)
    lo: float  # the repeated confidence interval at the level c_k spends (it clears 0 exactly when z >= c_k)
    hi: float
    bound: float  # the repeated one-sided bound on the effect in the claimed direction (sign x effect <= bound)
    decision: str  # EFFICACY, EXCLUDED (bound < margin), FUTILITY (z < b_k), GO_ON, END (last look, none of these)


def information(counts: Sequence[int], planned: int, final: bool) -> tuple[float, ...]:
    """The information the alpha is spent over after looks read at `counts` starts: those looks, and the planned
    last look (`planned` starts) where the last one read is not it (`final` false)."""
    info = tuple(float(c) for c in counts)
    return info if final or counts[-1] >= planned else (*info, float(planned))


@functools.lru_cache(maxsize=256)
def _efficacy(info: tuple[float, ...], alpha: float) -> tuple[float, ...]:
    return tuple(boundaries(info, alpha, 1))


@functools.lru_cache(maxsize=4096)
def _futility(info: tuple[float, ...], alpha: float, drift: float, beta: float) -> tuple[float, ...]:
    return tuple(futility_boundaries(info, _efficacy(info, alpha), drift, beta))


def read_looks(
    samples: Sequence[np.ndarray],
    planned: int,
    final: bool,
    *,
    sign: float,
    alpha: float,
    beta: float,
    mde: float,
    margin: float,
    futility: bool = True,
) -> list[Look]:
    """Read a one-sided claim's looks in order until one stops it (the rule of docs/statistics.md). `samples[k]`:
    the start means of the paired contrast at the k-th look read (cumulative); `planned`: the starts of the last
    declared look; `final`: whether the last sample is that last look (then the looks read are the information
    the alpha is spent over; else the planned last look is added). At each look, with z the one-sided t read as a
    z and c, b its efficacy and futility boundaries:
    - EFFICACY where z >= c (the claim is reproduced);
    - EXCLUDED where the repeated one-sided bound in the claimed direction is below `margin` (an effect of the
      claimed sign as large as the margin is excluded: not reproduced);
    - FUTILITY before the last look where z < b (`futility_boundaries` under the alternative at `mde`, its drift
      mde / (sd / sqrt(planned)) at the look's own SD of start means, rounded to 0.001): the study stops there
      (not reproduced); where its later looks were run all the same they are read and decide, as a non-binding
      boundary allows;
    - else GO_ON, or END at the last look (inconclusive).
    The reading ends at an efficacy or exclusion; `stop_of` names the look that decides it."""
    info = information([len(s) for s in samples], planned, final)
    eff = _efficacy(info, alpha)
    out: list[Look] = []
    for k, means in enumerate(samples):
        C, mean = len(means), float(np.mean(means))
        sd = float(np.std(means, ddof=1))
        se = sd / math.sqrt(C)
        if se > 0:
            z = float(t_to_z(sign * mean / se, C - 1))
        else:
            z = 0.0 if mean == 0 else math.copysign(math.inf, sign * mean)
        c = eff[k]
        spent = float(stats.norm.sf(c))
        half = float(stats.t.isf(spent, C - 1)) * se
        b = -math.inf
        if futility and k < len(info) - 1 and sd > 0:
            b = _futility(info, alpha, round(mde * math.sqrt(info[-1]) / sd, 3), beta)[k]
        last = k == len(samples) - 1
        bound = sign * mean + half
        if z >= c:
            decision = EFFICACY
        elif bound < margin:
            decision = EXCLUDED
        elif z < b:
            decision = FUTILITY
        else:
            decision = END if last and final else GO_ON
        out.append(Look(C, mean, se, z, c, b, mean - half, mean + half, bound, decision))
        if decision in (EFFICACY, EXCLUDED):
            break
    return out


def stop_of(looks: Sequence[Look]) -> Look:
    """The look that decides a reading (`read_looks`): the last look read. It ends the reading at an efficacy or an
    exclusion; a futility crossing decides where it is the last look run (the study stopped there). A study that ran
    on past a futility crossing (non-binding) is decided by its later looks."""
    return looks[-1]


@dataclass(frozen=True)
class OperatingCharacteristics:
    """How a design decides, by simulation (`operating_characteristics`): shares of simulated studies."""

    effect: float  # the true effect, in SDs of a start's paired difference
    reproduced: float  # efficacy at some look
    futility: float  # stopped at a futility boundary
    excluded: float  # the claimed effect as large as the margin excluded
    inconclusive: float  # the last look reached, none of these
    expected_starts: float  # mean starts run (a study stops at its first stop)


def operating_characteristics(
    looks: Sequence[int],
    effect: float,
    *,
    mde: float,
    margin: float,
    alpha: float = 0.025,
    beta: float = 0.2,
    sims: int = 2000,
    seed: int = 0,
) -> OperatingCharacteristics:
    """Simulate `sims` studies of paired start differences ~ N(effect, 1) read by `read_looks` look by look, each
    stopping at its first stop (efficacy, exclusion or futility; a futility stop is taken): the share of each
    outcome and the mean starts run. `mde` and `margin` in the same units (SDs of a start's difference)."""
    rng = np.random.default_rng(seed)
    counts = {EFFICACY: 0, FUTILITY: 0, EXCLUDED: 0, END: 0}
    starts = 0
    for _ in range(sims):
        x = rng.normal(effect, 1.0, looks[-1])
        decision, used = END, looks[-1]
        for k in range(len(looks)):
            read = read_looks(
                [x[:c] for c in looks[: k + 1]],
                looks[-1],
                k == len(looks) - 1,
                sign=1.0,
                alpha=alpha,
                beta=beta,
                mde=mde,
                margin=margin,
            )
            if read[-1].decision != GO_ON:
                decision, used = read[-1].decision, looks[k]
                break
        counts[decision] += 1
        starts += used
    return OperatingCharacteristics(
        effect,
        counts[EFFICACY] / sims,
        counts[FUTILITY] / sims,
        counts[EXCLUDED] / sims,
        counts[END] / sims,
        starts / sims,
    )
