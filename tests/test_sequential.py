"""Group-sequential looks (`moe_rl.analysis.sequential`): Lan-DeMets O'Brien-Fleming-type boundaries, checked against
the published values, scipy's multivariate normal, and by simulation of the t-based looks on planted data."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from moe_rl.analysis import power as pw
from moe_rl.analysis import sequential as sq


def test_obf_boundaries_match_the_published_values() -> None:
    """Lan-DeMets O'Brien-Fleming-type spending, f(t) = 2 - 2 Phi(Phi^-1(1 - alpha / 2) / sqrt(t)) (Lan and DeMets,
    Biometrika 70 (1983) 659-663; gsDesign's `sfLDOF` page writes it so), one-sided alpha 0.025, three equally
    spaced looks: the published boundaries 3.7103, 2.5114, 1.9930 (gsDesign's `gsDesign(k = 3, test.type = 1,
    alpha = 0.025, sfu = sfLDOF)`; rpact's `getDesignGroupSequential(kMax = 3, alpha = 0.025, typeOfDesign =
    "asOF")` prints 3.710, 2.511, 1.993). K = 2 and 4 are this module's values (regression), which the multivariate
    normal test below checks independently of the recursion."""
    assert sq.boundaries([1, 2, 3], alpha=0.025) == pytest.approx([3.7103, 2.5114, 1.9930], abs=1e-4)
    # the looks' scale does not matter, only the fractions: 12, 24, 36 starts are the same design
    assert sq.boundaries([12, 24, 36]) == pytest.approx([3.7103, 2.5114, 1.9930], abs=1e-4)
    assert sq.boundaries([1, 2]) == pytest.approx([2.9626, 1.9686], abs=1e-4)
    assert sq.boundaries([1, 2, 3, 4]) == pytest.approx([4.3326, 2.9631, 2.3590, 2.0141], abs=1e-4)


def test_a_single_look_is_the_fixed_test() -> None:
    for alpha in (0.025, 0.05, 0.01):
        assert sq.boundaries([20], alpha=alpha) == pytest.approx([stats.norm.isf(alpha)], abs=1e-12)
        assert sq.boundaries([20], alpha=2 * alpha, sides=2) == pytest.approx([stats.norm.isf(alpha)], abs=1e-12)
    assert sq.obf_spending(1.0, 0.025) == pytest.approx(0.025, abs=1e-15)


def test_boundaries_spend_alpha_by_scipys_multivariate_normal() -> None:
    """Independent of the recursive integration: with corr(Z_i, Z_j) = sqrt(t_i / t_j), P(no crossing by look k) from
    scipy's multivariate normal CDF equals 1 - f(t_k) at every look (QMC error below 1e-6 at abseps 1e-7)."""
    looks = [5, 9, 14, 20]  # unequal spacing
    b = np.array(sq.boundaries(looks))
    t = sq.information_fractions(looks)
    spent = sq.obf_spending(t)
    for k in range(1, len(looks) + 1):
        tk = t[:k]
        cov = np.sqrt(np.minimum.outer(tk, tk) / np.maximum.outer(tk, tk))
        p = stats.multivariate_normal.cdf(
            b[:k], mean=np.zeros(k), cov=cov, abseps=1e-7, releps=1e-7, rng=np.random.default_rng(0)
        )
        assert 1 - p == pytest.approx(spent[k - 1], abs=1e-6)
    # the recursion's own sum agrees, and two-sided boundaries at 0.05 nearly equal one-sided ones at 0.025
    assert sum(sq.crossing_probabilities(looks, b)) == pytest.approx(0.025, abs=1e-9)
    two = sq.boundaries(looks, alpha=0.05, sides=2)
    assert two == pytest.approx(list(b), abs=1e-4)
    assert sum(sq.crossing_probabilities(looks, two, sides=2)) == pytest.approx(0.05, abs=1e-9)


def test_power_of_the_design_at_the_fixed_designs_drift() -> None:
    # a fixed design with 80% power at one-sided 0.025 has drift z_0.975 + z_0.8 = 2.8016; three OBF looks lose
    # a little of it to the early spending: 0.795
    drift = stats.norm.isf(0.025) + stats.norm.isf(0.2)
    b = sq.boundaries([1, 2, 3])
    gsd = sum(sq.crossing_probabilities([1, 2, 3], b, drift))
    assert 0.79 < gsd < 0.8
    assert sum(sq.crossing_probabilities([1], [stats.norm.isf(0.025)], drift)) == pytest.approx(0.8, abs=1e-9)


def test_decide_look() -> None:
    b = sq.boundaries([12, 24, 36])
    assert sq.decide_look(3.8, 0, b) == sq.REJECT
    assert sq.decide_look(3.0, 0, b) == sq.CONTINUE
    assert sq.decide_look(2.0, 2, b) == sq.REJECT
    assert sq.decide_look(1.9, 2, b) == sq.STOP
    # a t at 12 starts (df 11) of 3.8 has p 0.0015 -> z 2.97 < 3.71: continue; the z of a t is below the t
    assert sq.decide_look(3.8, 0, b, df=11) == sq.CONTINUE
    z = float(sq.t_to_z(3.8, 11))
    assert z == pytest.approx(stats.norm.isf(stats.t.sf(3.8, 11)))
    assert 2.9 < z < 3.8
    assert sq.decide_look(-2.1, 2, sq.boundaries([12, 24, 36], 0.05, sides=2), sides=2) == sq.REJECT
    with pytest.raises(ValueError):
        sq.decide_look(1.0, 3, b)


SB, SW, M = 0.04, 0.03, 2  # planted between- and within-start SDs (ICC 0.64) and seeds per start
LOOKS = [12, 24, 36]
R = 20_000  # Monte Carlo replicates: SE of a rate p is sqrt(p (1 - p) / R) (0.0011 at 0.025, 0.0028 at 0.8)


def _looks_reject(mu: float, seed: int, *, mapped: bool = True) -> np.ndarray:
    """Per replicate, whether the sequential test rejects at some look: start means of paired differences (between
    draw + mean of M within draws), at each look the one-sample t on the first C_k start means, mapped to z."""
    rng = np.random.default_rng(seed)
    x = mu + rng.normal(0, SB, (R, LOOKS[-1])) + rng.normal(0, SW, (R, LOOKS[-1], M)).mean(-1)
    b = sq.boundaries(LOOKS)
    rejected = np.zeros(R, dtype=bool)
    for k, c in enumerate(LOOKS):
        xs = x[:, :c]
        t = xs.mean(1) / (xs.std(1, ddof=1) / math.sqrt(c))
        z = sq.t_to_z(t, c - 1) if mapped else t
        rejected |= z >= b[k]
    return rejected


def test_sequential_t_looks_keep_the_level() -> None:
    """Null (true mean 0): the type-I error of three looks at 12, 24, 36 starts, each look's t mapped to z by its p,
    is at most alpha + 3 Monte Carlo SEs (0.025 + 3 x 0.0011). Comparing the raw t with the z boundaries instead
    inflates it (about 0.031 here: the t's tails are heavier at 11 df)."""
    se = math.sqrt(0.025 * 0.975 / R)
    level = _looks_reject(0.0, seed=1).mean()
    assert level <= 0.025 + 3 * se
    assert level >= 0.025 - 4 * se  # and does not waste it
    assert _looks_reject(0.0, seed=1, mapped=False).mean() > 0.025 + 3 * se


def test_sequential_power_at_the_mde_sized_for_the_last_look() -> None:
    """At the MDE for which `starts_needed` gives exactly 36 starts (one-sided 0.025, power 0.8, 2 seeds), the fixed
    t test at 36 starts has power 0.8 exactly. The sequential design spends some alpha early, so its power sits below:
    by normal theory 0.795 (`crossing_probabilities` at drift z_0.975 + z_0.8). Tolerance: the simulated power is
    within 3 Monte Carlo SEs (3 x 0.0028) of that, and that is within 0.01 of the declared 0.8."""
    mde = pw.detectable_difference(SB, SW, LOOKS[-1], M, power=0.8, alpha=0.025, sides=1)
    assert pw.starts_needed(SB, SW, mde, M, power=0.8, alpha=0.025, sides=1) == LOOKS[-1]
    drift = stats.norm.isf(0.025) + stats.norm.isf(0.2)
    expected = sum(sq.crossing_probabilities(LOOKS, sq.boundaries(LOOKS), drift))
    assert 0.8 - 0.01 < expected < 0.8
    se = math.sqrt(0.8 * 0.2 / R)
    got = _looks_reject(mde, seed=2).mean()
    assert abs(got - expected) <= 3 * se
    assert 0.8 - 0.01 - 3 * se <= got <= 0.8 + 3 * se
