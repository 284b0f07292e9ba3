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


def test_futility_boundaries_spend_beta_under_the_alternative_by_monte_carlo() -> None:
    """Looks at 8, 16, 24 starts, alpha 0.025, beta 0.2 at the drift of a fixed design with 80% power: the futility
    boundaries stop a share g(2/3; 0.2) = 0.1165 of studies under that drift by look 2 (Lan-DeMets OBF spending of
    beta), checked on 400,000 Brownian paths (standard error 5e-4); the last look has none."""
    looks, drift = (8, 16, 24), float(stats.norm.isf(0.025) + stats.norm.isf(0.2))
    c = sq.boundaries(looks, 0.025)
    b = sq.futility_boundaries(looks, c, drift, 0.2)
    assert b[-1] == -math.inf and b[0] < b[1] < c[1]
    t = np.array(looks) / looks[-1]
    rng = np.random.default_rng(0)
    steps = rng.normal(size=(400_000, 3)) * np.sqrt(np.diff(np.concatenate([[0.0], t])))
    z = (np.cumsum(steps, axis=1) + drift * t) / np.sqrt(t)
    alive, stopped = np.ones(len(z), bool), 0
    for k in range(2):
        stopped += int((alive & (z[:, k] < b[k]) & (z[:, k] < c[k])).sum())
        alive &= (z[:, k] >= b[k]) & (z[:, k] < c[k])
    assert stopped / len(z) == pytest.approx(float(sq.obf_spending(2 / 3, 0.2)), abs=0.002)


def test_a_repeated_p_value_is_the_level_at_which_a_boundary_is_just_reached() -> None:
    """A one-look design: the one-sided normal p. The first of three looks: the level whose first boundary is z.
    Two of three looks read: the boundaries spending alpha = p put the larger crossing exactly on its look's
    boundary, and no look's z exceeds its boundary there."""
    assert sq.repeated_p_value((8,), [2.0]) == pytest.approx(float(stats.norm.sf(2.0)), rel=1e-5)
    assert sq.boundaries((8, 16, 24), sq.repeated_p_value((8, 16, 24), [2.0]))[0] == pytest.approx(2.0, abs=1e-5)
    p = sq.repeated_p_value((8, 16, 24), [1.0, 2.5])
    c = sq.boundaries((8, 16, 24), p)
    assert c[1] == pytest.approx(2.5, abs=1e-5) and c[0] > 1.0
    assert sq.repeated_p_value((8, 16, 24), [-1.0, -0.5]) == 0.5  # nothing below the cap is reached


def test_the_one_sided_reading_stops_at_efficacy_exclusion_or_futility() -> None:
    """Three reading paths, by hand: start means with z past the first boundary (efficacy); an upper repeated bound
    below the margin (exclusion, at any look); a look-1 z under the futility boundary (the study stops there). A
    study that ran on past that crossing (non-binding) is decided by its last look."""
    rng = np.random.default_rng(1)
    base = rng.normal(0.0, 1.0, 24)
    base = (base - base.mean()) / base.std(ddof=1)  # mean 0, sd 1 exactly
    kw = dict(sign=1.0, alpha=0.025, beta=0.2, mde=0.6, margin=0.05)
    eff = sq.read_looks([base[:8] + 5.0], 24, False, **kw)
    assert [r.decision for r in eff] == [sq.EFFICACY]
    narrow = sq.read_looks([0.01 * base[:8] - 0.1], 24, False, **kw)  # bound ~ -0.08 < 0.05
    assert narrow[-1].decision == sq.EXCLUDED and narrow[-1].bound < 0.05
    futile = sq.read_looks([base[:8] - 0.5], 24, False, **{**kw, "margin": 0.0})
    assert futile[0].decision == sq.FUTILITY and futile[0].z < futile[0].futility
    ran_on = sq.read_looks([base[:8] - 0.5, base[:16] - 0.3, base - 0.2], 24, True, **{**kw, "margin": 0.0})
    assert [r.decision for r in ran_on] == [sq.FUTILITY, sq.FUTILITY, sq.END]  # read on past them: the last decides
    assert sq.stop_of(ran_on) is ran_on[-1]


@pytest.mark.slow
def test_operating_characteristics_of_a_three_look_design_by_simulation() -> None:
    """Looks at 8, 16, 24 starts sized for 80% power at one-sided 0.025 (mde = (z_0.975 + z_0.8) / sqrt(24) SDs),
    margin = mde, 1000 simulated studies each (binomial standard error <= 0.016): under the null the level stays
    at most 0.025 (+3 SE) and most studies stop for futility, at about half the starts; at the MDE the power stays
    at least 0.8 less the interim beta spent (0.1165) less 3 SE, and futility stops at most that spend + 3 SE + the
    t's extra spread."""
    mde = float(stats.norm.isf(0.025) + stats.norm.isf(0.2)) / math.sqrt(24)
    null = sq.operating_characteristics((8, 16, 24), 0.0, mde=mde, margin=mde, sims=1000)
    alt = sq.operating_characteristics((8, 16, 24), mde, mde=mde, margin=mde, sims=1000)
    assert null.reproduced <= 0.025 + 3 * 0.005
    assert null.futility + null.excluded >= 0.6 and null.expected_starts <= 0.7 * 24
    assert alt.reproduced >= 0.8 - 0.1165 - 3 * 0.015
    assert alt.futility <= 0.1165 + 3 * 0.011 + 0.03
