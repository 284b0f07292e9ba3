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

from collections.abc import Sequence

import numpy as np
from scipy import optimize, stats

REJECT, CONTINUE, STOP = "reject", "continue", "stop at the last look"
GRID = 801  # grid points per look for the recursive integration (odd: Simpson's rule); error well below 1e-6
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

    def __init__(self, t: np.ndarray, sides: int, drift: float = 0.0) -> None:
        self.t, self.sides, self.drift = t, sides, drift
        self.x = self.w = self.f = np.zeros(0)
        self.k = 0  # looks already passed

    def _region(self, k: int, c: float) -> tuple[float, float]:
        """Look k's continuation region on the S scale (cut to where the density lives)."""
        mean, sd = self.drift * self.t[k], np.sqrt(self.t[k])
        hi = min(c * sd, mean + WIDTH * sd) if np.isfinite(c) else mean + WIDTH * sd
        lo = max(-c * sd, mean - WIDTH * sd) if self.sides == 2 and np.isfinite(c) else mean - WIDTH * sd
        return lo, hi

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

    def advance(self, c: float) -> None:
        """Pass look k with boundary c: the sub-density on its continuation region becomes the carried one."""
        k, t = self.k, self.t
        x, w = _simpson(*self._region(k, c))
        if k == 0:
            f = stats.norm.pdf(x, loc=self.drift * t[0], scale=np.sqrt(t[0]))
        else:
            sd = np.sqrt(t[k] - t[k - 1])
            kernel = stats.norm.pdf((x[:, None] - self.x[None, :] - self.drift * (t[k] - t[k - 1])) / sd) / sd
            f = kernel @ (self.w * self.f)
        self.x, self.w, self.f = x, w, f
        self.k += 1


def boundaries(looks: Sequence[float], alpha: float = 0.025, sides: int = 1) -> list[float]:
    """The z boundaries c_1..c_K of looks after C_1 < ... < C_K starts (Lan-DeMets O'Brien-Fleming-type spending,
    `obf_spending`), each solving P(first crossing at look k) = f(t_k) - f(t_(k-1)) under the null. One look gives
    Phi^-1(1 - alpha / sides); a look that spends nothing has boundary +inf."""
    t = information_fractions(looks)
    spent = np.diff(np.concatenate([[0.0], obf_spending(t, alpha, sides)]))
    rec = _Recursion(t, sides)
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
