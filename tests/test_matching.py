"""Divergence matched per start (`moe_rl.studies.matching`, `match.reference` in a declaration): planted data on
which an arm whose only effect is its divergence reads 0 once matched per start and not under one pilot lr for the
pool, the interpolation by hand, the declaration's refusals, the launch plan, and a matched study with its placebo end
to end on the tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import TRAIN_ENV, launcher, run_study, study_dry_run, tiny_overrides, train_in_process
from scipy import stats

from moe_rl.analysis.dose import matched_lr
from moe_rl.metrics.names import KL_UPDATE_K3
from moe_rl.studies import matching
from moe_rl.studies.design import POOL, load_study

BRACKET = (0.8, 1.0, 1.25)


def _study_raw(**changes: object) -> dict:
    """A tiny matched study: `none` the reference, `r2` another method, `placebo` the reference at 1.3x its lr."""
    raw = {
        "name": "tiny_matched",
        "question": "Does r2 change the gain at the reference's divergence?",
        "preset": "staleness",
        "overrides": [*tiny_overrides("steps=14", "eval_every=7"), "numerics=native"],
        "arms": {
            "none": {"overrides": ["replay=none"], "ref": "moe"},
            "r2": {"overrides": ["replay=r2"], "ref": "moe"},
            "placebo": {"overrides": ["replay=none"], "ref": "moe", "lr_scale": 1.3},
        },
        "levels": {"hi": {"lr": {"moe": 2e-3}}},
        "unit": {"members": "310..312", "seeds_per_start": 1},
        "outcome": "change",
        "contrasts": [
            {"name": "r2_minus_none", "claim": "x", "cells": {"r2@hi": 1, "none@hi": -1}},
            {"name": "placebo_minus_none", "claim": "exploratory", "cells": {"placebo@hi": 1, "none@hi": -1}},
        ],
        "design": {"mde": 0.05, "looks": [3], "sized_from": "a test"},
        "match": {
            "reference": "none",
            "placebo": "placebo_minus_none",
            "tolerance": 1.5,
            "probe_steps": 2,
            "bracket": [0.8, 1.25],
        },
    }
    return {**raw, **changes}


def _write(folder: Path, raw: dict) -> Path:
    path = folder / f"{raw['name']}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# --- planted data ----------------------------------------------------------------------------------------------


def _planted(reps: int = 300, n: int = 24, pilot: int = 6, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """`reps` planted studies of `n` starts: per start m, the reference's early KL at lr is a_m lr^b and the arm's
    e^{d_m} a_m lr^b (a member-specific lr offset of the arm: its only effect), each probe and run read with
    multiplicative noise; the outcome is -gamma log KL + noise (and the start's own level, which cancels in the pair),
    so at equal KL the arm and the reference end alike. The arm's declared lr_scale is today's pool match:
    `dose.matched_lr` on a 6-member pilot (the arm at the bracket, the reference at its lr) of each study's own. Per
    way of matching ("start": each seed at the lr its probes give, `matching.solve_lrs`; "pool": every seed at the
    declared lr), each study's contrast (arm - reference, mean over starts), its standard error, the realised KL
    ratio (geometric mean over starts), and the share of seeds clamped."""
    rng = np.random.default_rng(seed)
    lr0, b, mu, sd_arm, sd_kl, gamma, sd_out = 4e-4, 1.3, 0.4, 0.25, 0.08, 0.3, 0.03
    # today's pilot: one lr_scale per study for its whole pool
    a = rng.normal(math.log(0.009), 0.3, (reps, pilot))
    d = rng.normal(mu, sd_arm, (reps, pilot))
    member = np.arange(reps * pilot).reshape(reps, pilot)
    ref = pd.DataFrame(
        {"arm": "ref", "lr": lr0, "member": member.ravel(), "kl": np.exp(a + rng.normal(0, sd_kl, a.shape)).ravel()}
    )
    arm = pd.concat(
        pd.DataFrame(
            {
                "arm": np.repeat([f"a{r}" for r in range(reps)], pilot),
                "lr": lr0 * k,
                "member": member.ravel(),
                "kl": np.exp(a + d + b * math.log(k) + rng.normal(0, sd_kl, a.shape)).ravel(),
            }
        )
        for k in BRACKET
    )
    read = matched_lr(pd.concat([ref, arm]), "ref").drop_duplicates("arm").set_index("arm")["lr_matched"]
    scale = read.reindex([f"a{r}" for r in range(reps)]).to_numpy() / lr0
    assert np.isfinite(scale).all()
    # the studies' own starts: probes, then each full run
    a = rng.normal(math.log(0.009), 0.3, (reps, n))
    d = rng.normal(mu, sd_arm, (reps, n))
    log_ref = a + rng.normal(0, sd_kl, a.shape)  # the reference's probe is its run's own early window
    seeds = np.arange(reps * n).reshape(reps, n)
    levels = np.repeat([f"s{r}" for r in range(reps)], n)
    probes = [
        pd.DataFrame(
            {
                "seed": seeds.ravel(),
                "arm": "ref",
                "level": levels,
                "multiplier": 1.0,
                "lr": lr0,
                "kl": np.exp(log_ref).ravel(),
            }
        )
    ]
    for k in BRACKET:
        lr = lr0 * scale[:, None] * k
        kl = np.exp(a + d + b * np.log(lr / lr0) + rng.normal(0, sd_kl, a.shape))
        probes.append(
            pd.DataFrame(
                {
                    "seed": seeds.ravel(),
                    "arm": "arm",
                    "level": levels,
                    "multiplier": k,
                    "lr": np.broadcast_to(lr, a.shape).ravel(),
                    "kl": kl.ravel(),
                }
            )
        )
    declared = {("arm", f"s{r}"): lr0 * scale[r] for r in range(reps)}
    lrs = matching.solve_lrs(pd.concat(probes), "ref", BRACKET, declared, pool=POOL**2).set_index("seed")
    assert lrs["status"].isin(matching.MATCHED + ("clamped",)).all()
    out = {}
    for way, lr in (
        ("start", lrs.loc[seeds.ravel(), "lr"].to_numpy().reshape(reps, n)),
        ("pool", lr0 * scale[:, None] * np.ones((1, n))),
    ):
        log_arm = a + d + b * np.log(lr / lr0) + rng.normal(0, sd_kl, a.shape)
        diff = (-gamma * log_arm + rng.normal(0, sd_out, a.shape)) - (-gamma * log_ref + rng.normal(0, sd_out, a.shape))
        out[way] = {
            "estimate": diff.mean(1),
            "se": diff.std(1, ddof=1) / math.sqrt(n),
            "ratio": np.exp((log_arm - log_ref).mean(1)),
            "clamped": (lrs["status"] == "clamped").mean() if way == "start" else 0.0,
        }
    return out


def test_an_arm_whose_only_effect_is_its_divergence_reads_zero_matched_per_start_and_not_by_one_pool_lr() -> None:
    """On 300 planted studies of 24 starts: matched per start, the arm's contrast is 0 (the mean estimate within 3
    standard errors of the mean, and a two-sided 5% t test rejecting 0 no more often than 5% + 3 binomial standard
    errors), and the realised KL ratio inside 1.05 in most studies. Matched by today's one pilot lr for the pool, the
    pilot's error is common to every start of a study, which no count of starts averages out: the same test rejects
    the true 0 far more often than 5% (and the ratio misses 1.05 in most studies)."""
    reps, n, alpha = 300, 24, 0.05
    out = _planted(reps, n)
    tcrit = stats.t.isf(alpha / 2, n - 1)
    slack = 3 * math.sqrt(alpha * (1 - alpha) / reps)  # three binomial standard errors of a rejection rate
    start = out["start"]
    rejects = {way: float((np.abs(o["estimate"] / o["se"]) > tcrit).mean()) for way, o in out.items()}
    assert abs(start["estimate"].mean()) <= 3 * start["estimate"].std(ddof=1) / math.sqrt(reps)
    assert rejects["start"] <= alpha + slack, rejects
    assert rejects["pool"] > alpha + slack, rejects  # today's: a planted 0 read as an effect
    outside = {way: float((np.abs(np.log(o["ratio"])) > math.log(1.05)).mean()) for way, o in out.items()}
    assert outside["start"] <= 0.1 < 0.5 <= outside["pool"], outside
    assert start["clamped"] < 0.1  # the bracket around today's lr_scale reaches most starts' matches
    # and per start the arm's own spread of KL offsets over starts leaves the pairs: planted SD of a pair 0.058 per
    # start against 0.093 under one lr (gamma^2 (sd_arm^2 + 2 sd_kl^2) + 2 sd_out^2)
    assert np.median(start["se"]) < 0.75 * np.median(out["pool"]["se"])


# --- the solve by hand -------------------------------------------------------------------------------------------


def _probes(rows: list[tuple[int, str, float, float, float]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["seed", "arm", "multiplier", "lr", "kl"]).assign(level="hi")


def test_the_lr_between_two_probes_by_hand() -> None:
    """An arm's probes at lr 1e-3 (KL 0.01) and 2e-3 (KL 0.04): log KL = log 0.01 + 2 log(lr / 1e-3). The reference's
    probe reads 0.02 on seed 1, so the lr is 1e-3 sqrt(2) (x1.414 of the declared 1e-3, inside the bracket [1, 2]);
    0.05 on seed 2 gives sqrt(5) = x2.236, past the bracket but within 1.25x of its end (extrapolated); 0.09 on seed 3
    gives x3, clamped at 2 x 1.25 = 2.5; seed 4 has one probe, so it takes the arm's slope over the seeds with two
    (2, within seed); seed 5 has no reference probe and is not matched."""
    arm = [(s, "arm", m, 1e-3 * m, 0.01 * m**2) for s in (1, 2, 3) for m in (1.0, 2.0)]
    ref = [
        (1, "ref", 1.0, 5e-4, 0.02),
        (2, "ref", 1.0, 5e-4, 0.05),
        (3, "ref", 1.0, 5e-4, 0.09),
        (4, "ref", 1.0, 5e-4, 0.02),
    ]
    probes = _probes(
        [*arm, *ref, (4, "arm", 1.0, 1e-3, 0.005), (5, "arm", 1.0, 1e-3, 0.01), (5, "arm", 2.0, 2e-3, 0.04)]
    )
    lrs = matching.solve_lrs(
        probes, "ref", (1.0, 2.0), {("arm", "hi"): 1e-3, ("ref", "hi"): 5e-4}, pool=1000
    ).set_index("seed")
    assert list(lrs.index) == [1, 2, 3, 4, 5] and set(lrs["arm"]) == {"arm"}  # the reference is not matched
    assert lrs.loc[1, "lr"] == pytest.approx(1e-3 * math.sqrt(2), rel=1e-5) and lrs.loc[1, "status"] == "interpolated"
    assert lrs.loc[1, "slope"] == pytest.approx(2.0) and lrs.loc[1, "slope_from"] == "own"
    assert lrs.loc[1, "probe_multipliers"] == "1;2" and lrs.loc[1, "probe_kls"] == "0.01;0.04"
    assert lrs.loc[2, "multiplier"] == pytest.approx(math.sqrt(5)) and lrs.loc[2, "status"] == "extrapolated"
    assert lrs.loc[3, "multiplier"] == pytest.approx(2.5) and lrs.loc[3, "status"] == "clamped"
    # seed 4: KL 0.005 at 1e-3 and slope 2: 0.02 = 0.005 (lr / 1e-3)^2 at lr 2e-3
    assert lrs.loc[4, "slope_from"] == "arm" and lrs.loc[4, "lr"] == pytest.approx(2e-3, rel=1e-5)
    assert lrs.loc[5, "status"] == "no reference probe" and math.isnan(lrs.loc[5, "lr"])
    assert lrs.loc[1, "kl_reference"] == pytest.approx(0.02) and lrs.loc[1, "member"] == 1


def test_a_flat_seed_takes_its_arm_s_slope_and_a_flat_arm_is_not_matched() -> None:
    """A seed whose own line does not rise takes the arm's within-seed slope; where every seed is flat, no slope."""
    rising = [(s, "arm", m, 1e-3 * m, 0.01 * m) for s in (1, 2) for m in (1.0, 2.0)]  # slope 1
    flat = [(3, "arm", 1.0, 1e-3, 0.02), (3, "arm", 2.0, 2e-3, 0.019)]
    ref = [(s, "ref", 1.0, 1e-3, 0.015) for s in (1, 2, 3)]
    lrs = matching.solve_lrs(_probes([*rising, *flat, *ref]), "ref", (1.0, 2.0), {("arm", "hi"): 1e-3}, 1000)
    row = lrs.set_index("seed").loc[3]
    assert row["slope_from"] == "arm" and 0 < row["slope"] < 1  # pooled within seed: the flat seed pulls it down
    none = matching.solve_lrs(_probes([*flat, ref[2]]), "ref", (1.0, 2.0), {("arm", "hi"): 1e-3}, 1000)
    assert none["status"].tolist() == ["no slope"] and none["lr"].isna().all()


def test_lrs_once_written_are_kept_and_the_unmatched_retried(tmp_path) -> None:
    """A seed's lr, once written, is the one its run was launched at: a later solve (here on other probes) keeps it;
    a seed not matched is not written, so the next look solves it again."""
    study = load_study(_write(tmp_path, _study_raw()))
    probes = pd.DataFrame(
        [
            (s, a, "hi", m, matching.probe_lr(study, a, "hi", m), 0.01 * m**1.5)
            for s in (310, 311)
            for a in ("r2", "placebo")
            for m in (0.8, 1.25)
        ]
        + [(s, "none", "hi", 1.0, 2e-3, 0.01) for s in (310, 311)],
        columns=["seed", "arm", "level", "multiplier", "lr", "kl"],
    )
    first = matching.study_lrs(study, probes)
    path = matching.lrs_path(tmp_path, study)
    matching.write_lrs(first, path)
    kept = matching.read_lrs(path)
    assert kept is not None and len(kept) == 4 and kept["lr"].notna().all()
    assert np.allclose(kept["lr"], first["lr"], rtol=1e-5)
    moved = probes.assign(kl=probes["kl"] * np.where(probes["arm"] == "none", 1.2, 1.0))  # slope 1.5: x1.2^(2/3)
    again = matching.study_lrs(study, pd.concat([moved, moved.assign(seed=312)]), kept)
    assert len(again) == 6 and np.allclose(again[again["seed"] < 312]["lr"], kept["lr"], rtol=1e-5)
    assert np.allclose(again[again["seed"] == 312]["multiplier"], 1.2 ** (2 / 3))


def test_one_lr_per_arm_over_the_pool_by_hand() -> None:
    """`match.per: pool`. Seeds 1 and 2 probe at x0.5, x1 and x2 of 1e-3; their log KL ratios to the reference's probe
    on the same seed are (-0.6, -0.2, +0.2) and (-0.4, 0.0, +0.4): means -0.5, -0.1, +0.3, which cross 0 between x1 and
    x2, on the line of slope 0.4 / ln 2 through (ln 1, -0.1): x = exp(0.1 ln 2 / 0.4) = 2^0.25. Seed 3 (a later look)
    was not probed and runs at that lr too; seed 1's row lists its own probes."""
    d = {1: (-0.6, -0.2, 0.2), 2: (-0.4, 0.0, 0.4)}
    ref = {1: 0.01, 2: 0.02}
    rows = [
        (s, "arm", m, 1e-3 * m, ref[s] * math.exp(v)) for s in d for m, v in zip((0.5, 1.0, 2.0), d[s], strict=True)
    ]
    rows += [(s, "ref", 1.0, 5e-4, ref[s]) for s in ref]
    cell, B = ("arm", "hi"), (0.5, 1.0, 2.0)
    lrs = matching.pooled_lrs(_probes(rows), "ref", B, {cell: 1e-3}, {cell: [1, 2]}, {cell: [1, 2, 3]}, pool=1000)
    lrs = lrs.set_index("seed")
    assert list(lrs.index) == [1, 2, 3] and (lrs["status"] == "pooled").all()
    assert np.allclose(lrs["multiplier"], 2**0.25, rtol=1e-5) and lrs["lr"].nunique() == 1
    assert lrs.loc[1, "slope"] == pytest.approx(0.4 / math.log(2)) and lrs.loc[1, "slope_from"] == "pool"
    assert lrs.loc[1, "probe_multipliers"] == "0.5;1;2" and lrs.loc[1, "kl_reference"] == pytest.approx(0.01)
    assert lrs.loc[3, "probe_kls"] == "" and math.isnan(lrs.loc[3, "kl_reference"])
    # every mean above 0: the lowest pair's line, beyond the bracket (0.5 / 1.25 at most), else clamped there
    high = [(s, a, m, lr, kl * math.exp(0.55 if a == "arm" else 0.0)) for s, a, m, lr, kl in rows]
    ext = matching.pooled_lrs(_probes(high), "ref", B, {cell: 1e-3}, {cell: [1, 2]}, {cell: [1]}, pool=1000).iloc[0]
    # means +0.05, +0.45: slope 0.4 / ln 2, x = 0.5 exp(-0.05 ln 2 / 0.4) = 0.5 * 2^-0.125
    assert ext["status"] == "pooled_extrapolated" and ext["multiplier"] == pytest.approx(0.5 * 2**-0.125, rel=1e-5)
    higher = [(s, a, m, lr, kl * math.exp(0.8 if a == "arm" else 0.0)) for s, a, m, lr, kl in rows]
    clamped = matching.pooled_lrs(_probes(higher), "ref", B, {cell: 1e-3}, {cell: [1, 2]}, {cell: [1]}, pool=1000)
    assert clamped["status"].tolist() == ["clamped"] and clamped["multiplier"].iloc[0] == pytest.approx(0.4)
    # a probed seed without its x2 probe: nothing is solved until it has one
    missing = matching.pooled_lrs(
        _probes(rows[:-3] + rows[-2:]), "ref", B, {cell: 1e-3}, {cell: [1, 2]}, {cell: [1, 2]}, 1000
    )
    assert (missing["status"] == "probes missing").all() and missing["lr"].isna().all()
    # every mean below 0 (-0.85, -0.45, -0.05): the highest pair's line, x = 2 * 2^(0.05 / 0.4), beyond the bracket
    low = [(s, a, m, lr, kl * math.exp(-0.35 if a == "arm" else 0.0)) for s, a, m, lr, kl in rows]
    up = matching.pooled_lrs(_probes(low), "ref", B, {cell: 1e-3}, {cell: [1, 2]}, {cell: [1]}, pool=1000).iloc[0]
    assert up["status"] == "pooled_extrapolated" and up["multiplier"] == pytest.approx(2 * 2**0.125, rel=1e-5)
    # a finished probe without a KL leaves its seed out; with one seed left there is no pool
    nan_kl = [(s, a, m, lr, math.nan if (s, a, m) == (2, "arm", 2.0) else kl) for s, a, m, lr, kl in rows]
    alone = matching.pooled_lrs(_probes(nan_kl), "ref", B, {cell: 1e-3}, {cell: [1, 2]}, {cell: [1]}, pool=1000)
    assert alone["status"].tolist() == ["no probe KL"]
    third = [(3, a, m, lr, kl) for s, a, m, lr, kl in rows if s == 2]  # seed 3 reads what seed 2 read
    kept = matching.pooled_lrs(_probes(nan_kl + third), "ref", B, {cell: 1e-3}, {cell: [1, 2, 3]}, {cell: [1]}, 1000)
    assert kept["status"].tolist() == ["pooled"] and kept["multiplier"].iloc[0] == pytest.approx(2**0.25, rel=1e-5)


def test_the_pool_lr_follows_the_pair_of_multipliers_around_its_crossing() -> None:
    """Means -0.5, -0.1, +0.1, +0.15 at x0.5, x1, x2, x4 (the early KL flattening at high lr): the line between x1
    and x2 crosses 0 at 2^0.5; a least-squares line through all four (slope 0.31, -0.195 at ln 1) crosses at 1.88x,
    past the flattening: the overshoot of a line through a wide bracket."""
    d = (-0.5, -0.1, 0.1, 0.15)
    mults = (0.5, 1.0, 2.0, 4.0)
    rows = [(s, "arm", m, 1e-3 * m, 0.01 * s * math.exp(v)) for s in (1, 2) for m, v in zip(mults, d, strict=True)]
    rows += [(s, "ref", 1.0, 1e-3, 0.01 * s) for s in (1, 2)]
    cell = ("arm", "hi")
    got = matching.pooled_lrs(_probes(rows), "ref", mults, {cell: 1e-3}, {cell: [1, 2]}, {cell: [1]}, 1000).iloc[0]
    assert got["status"] == "pooled" and got["multiplier"] == pytest.approx(2**0.5, rel=1e-5)
    x = np.log(mults)
    fit = np.polyfit(x, d, 1)
    assert math.exp(-fit[1] / fit[0]) > 1.5 > 2**0.5


def test_the_pool_lr_puts_a_placebo_back_at_its_reference_s_lr_where_each_start_s_own_probe_does_not() -> None:
    """Planted: each start's early KL is c_s lr (slope 1) times a probe's own noise (SD 0.3 in log), the reference
    read once at lr 1. A placebo (the reference itself) probes at x0.8, x1, x1.25 of lr 1 and at x0.95, x1, x1.05 of
    its own solved lr. Per start, the probe nearest the reference's KL is chosen for its noise as much as for its lr:
    the chosen lrs spread by about the noise (log SD > 0.2 over 400 starts; at slope 1 that is each run's expected KL
    ratio), while the chosen probes' own ratios spread less (the selection: they look better matched than the runs
    will be). Over the pool, one lr: the mean log ratio at each multiplier has SD 0.3 sqrt(2 / 400)
    = 0.021, so the pool's lr lies within 4 of those (0.085 in log at slope 1) of the reference's own."""
    rng = np.random.default_rng(0)
    n = 400
    c = rng.normal(0, 0.5, n)
    rows = [(s, "ref", 1.0, 1.0, math.exp(c[s] + rng.normal(0, 0.3))) for s in range(n)]
    rows += [(s, "placebo", m, m, math.exp(c[s] + math.log(m) + rng.normal(0, 0.3))) for s in range(n) for m in BRACKET]
    cell = ("placebo", "hi")
    probes = _probes(rows)
    pooled = matching.pooled_lrs(probes, "ref", BRACKET, {cell: 1.0}, {cell: list(range(n))}, {cell: list(range(n))}, n)
    assert pooled["lr"].nunique() == 1 and abs(math.log(pooled["lr"].iloc[0])) < 4 * 0.3 * math.sqrt(2 / n)
    solved = matching.solve_lrs(probes, "ref", BRACKET, {cell: 1.0}, n)
    confirm = matching.confirm_probes(solved, (0.95, 1.0, 1.05))
    noise = rng.normal(0, 0.3, len(confirm))
    confirm = confirm.assign(kl=np.exp(c[confirm["seed"]] + np.log(confirm["lr"]) + noise), confirm=True)
    every = pd.concat([probes.assign(confirm=False), confirm.drop(columns="multiplier").assign(multiplier=1.0)])
    chosen = matching.nearest_lrs(solved, every, 3, 1.05)
    assert np.log(chosen["lr"]).std() > 0.2
    picked = every[every["confirm"]].merge(chosen[["seed", "lr"]], on=["seed", "lr"])
    ref = chosen.set_index("seed").loc[picked["seed"], "kl_reference"].to_numpy()
    ratio = np.log(picked["kl"].to_numpy()) - np.log(ref)
    assert ratio.std() < 0.75 * np.log(chosen["lr"]).std()  # measured: 0.17 against 0.28


def test_a_pooled_study_probes_its_first_look_and_gives_later_seeds_that_lr(tmp_path) -> None:
    """`match.per: pool` in a declaration with looks [3, 4]: the first look's 3 members probe, a look of 4 probes the
    same 3; both arms' lrs are solved on them, written, and member 313 (look 2) gets its arm's written lr, even where
    new probes (here the reference's KL x1.2) would now solve another."""
    raw = _study_raw(design={"mde": 0.05, "looks": [3, 4], "sized_from": "a test"})
    raw["match"] = {**raw["match"], "per": "pool"}
    raw["unit"] = {**raw["unit"], "members": "310..313"}
    study = load_study(_write(tmp_path, raw))
    assert study.match is not None and study.match.per == "pool"
    assert matching.probe_starts(study, 3) == 3 and matching.probe_starts(study, 4) == 3
    kl = {310: 0.01, 311: 0.03, 312: 0.02}
    rows = [
        (s, a, "hi", m, matching.probe_lr(study, a, "hi", m), kl[s] * m**2)
        for s in kl
        for a in ("r2", "placebo")
        for m in (0.8, 1.25)
    ]
    rows += [(s, "none", "hi", 1.0, 2e-3, kl[s]) for s in kl]
    probes = pd.DataFrame(rows, columns=["seed", "arm", "level", "multiplier", "lr", "kl"])
    first = matching.study_lrs(study, probes, None, starts=3)
    assert len(first) == 6 and (first["status"] == "pooled").all()
    assert np.allclose(first["multiplier"], 1.0, rtol=1e-5)  # every seed reads the reference's KL at x1 exactly
    path = matching.lrs_path(tmp_path, study)
    matching.write_lrs(first, path)
    moved = probes.assign(kl=probes["kl"] * np.where(probes["arm"] == "none", 1.2, 1.0))
    later = matching.study_lrs(study, moved, matching.read_lrs(path), starts=4)
    assert len(later) == 8 and later["lr"].notna().all()
    for arm, rows_ in later.groupby("arm"):
        assert rows_["lr"].nunique() == 1 and rows_["lr"].iloc[0] == pytest.approx(
            first.set_index("arm").loc[arm, "lr"].iloc[0]
        )


def test_what_one_pool_lr_would_have_been_for_a_study_matched_per_start(tmp_path) -> None:
    """`pooled_reading` from match/lrs.csv alone: the tiny study's placebo (declared at 1.3x the reference's 2e-3,
    bracket [0.8, 1.25]) reads KL = its reference's x (m / 0.9)^2 on both seeds at the bracket's multipliers, and a
    confirm probe at x1.0 that is no bracket point (left out): the pool crosses 0 at m = 0.9 exactly (a power law is a
    line in log-log), 1.17x the reference's lr; its runs went at x0.95 and x1.05 of 1.3x, a geometric mean of
    1.3 sqrt(0.95 x 1.05)."""
    study = load_study(_write(tmp_path, _study_raw()))
    ref_kl = {310: 0.01, 311: 0.02}
    lrs = pd.DataFrame(
        [
            {
                "seed": s,
                "member": s,
                "arm": "placebo",
                "level": "hi",
                "lr_declared": 2.6e-3,
                "lr": 2.6e-3 * f,
                "multiplier": f,
                "kl_reference": ref_kl[s],
                "probe_multipliers": "0.8;1;1.25",
                "probe_kls": ";".join(
                    f"{ref_kl[s] * (m / 0.9) ** 2 * (3 if m == 1 else 1):.12g}" for m in (0.8, 1, 1.25)
                ),
                "slope": 2.0,
                "slope_from": "own",
                "status": "confirmed",
            }
            for s, f in ((310, 0.95), (311, 1.05))
        ]
    )
    read = matching.pooled_reading(study, lrs).set_index("arm").loc["placebo"]
    assert read["n"] == 2 and read["status"] == "pooled"
    assert read["pooled"] == pytest.approx(0.9 * 1.3, rel=1e-6)
    assert read["ran"] == pytest.approx(1.3 * math.sqrt(0.95 * 1.05), rel=1e-9)


def test_the_nearest_probe_by_hand() -> None:
    """Seed 1 solved at 1.2e-3 (the reference's KL 0.02) and confirmed at x0.9 and x1.1 of it: its probes read 0.01
    (1e-3), 0.04 (2e-3), 0.026 (1.08e-3) and 0.0205 (1.32e-3); of its confirm probes |log(KL / 0.02)| is least at
    1.32e-3 (0.0247, inside log 1.05 = 0.0488): confirmed there. Seed 2's bracket probe at 1e-3 reads 0.0109, nearer
    its reference's 0.0105 than either confirm probe (0.03 at 0.99e-3, 0.009 at 1.21e-3), but only confirm probes are
    candidates: 1.21e-3, whose gap log(0.0105 / 0.009) = 0.154 lies beyond the tolerance (`nearest`). Seed 3 has one of
    its two confirm probes: no lr yet (`unconfirmed`)."""
    solved = pd.DataFrame(
        {
            "seed": [1, 2, 3],
            "member": [1, 2, 3],
            "arm": "arm",
            "level": "hi",
            "lr_declared": 1e-3,
            "lr": [1.2e-3, 1.1e-3, 1.5e-3],
            "multiplier": [1.2, 1.1, 1.5],
            "kl_reference": [0.02, 0.0105, 0.02],
            "probe_multipliers": "1;2",
            "probe_kls": "",
            "slope": 2.0,
            "slope_from": "own",
            "status": ["interpolated", "interpolated", "extrapolated"],
        }
    )
    rows = [
        (1, 1e-3, 0.01, False),
        (1, 2e-3, 0.04, False),
        (1, 1.08e-3, 0.026, True),
        (1, 1.32e-3, 0.0205, True),
        (2, 1e-3, 0.0109, False),
        (2, 2e-3, 0.05, False),
        (2, 0.99e-3, 0.03, True),
        (2, 1.21e-3, 0.009, True),
        (3, 1e-3, 0.01, False),
        (3, 1.35e-3, 0.02, True),
    ]
    probes = pd.DataFrame(rows, columns=["seed", "lr", "kl", "confirm"]).assign(arm="arm", level="hi")
    out = matching.nearest_lrs(solved, probes, 2, 1.05).set_index("seed")
    assert out.loc[1, "lr"] == 1.32e-3 and out.loc[1, "status"] == "confirmed"
    assert out.loc[1, "multiplier"] == pytest.approx(1.32)
    assert out.loc[1, "probe_multipliers"] == "1;1.08;1.32;2" and out.loc[1, "probe_kls"] == "0.01;0.026;0.0205;0.04"
    assert out.loc[2, "lr"] == 1.21e-3 and out.loc[2, "status"] == "nearest"
    assert matching.nearest_lrs(solved, probes, 2, 1.2).set_index("seed").loc[2, "status"] == "confirmed"
    assert out.loc[3, "status"] == "unconfirmed" and math.isnan(out.loc[3, "lr"]) and out.loc[3, "slope_from"] == ""
    assert out.loc[1, "slope"] == 2.0 and out.loc[1, "kl_reference"] == 0.02
    wanted = matching.confirm_probes(solved, (0.9, 1.1))
    assert wanted["lr"].tolist() == pytest.approx([1.08e-3, 1.32e-3, 0.99e-3, 1.21e-3, 1.35e-3, 1.65e-3])


def test_confirm_probes_bound_each_start_where_the_kl_is_a_noisy_function_of_the_lr() -> None:
    """Planted starts whose early KL at an lr is a_m lr^1.3 times its own noise at every lr (SD 0.25 in log: a start's
    run is chaotic in its lr, as the shipped studies' probes show), 2000 starts: solved from a bracket of 3 probes, a
    run's realised log ratio to the reference has an SD near the noise's (>= 0.25); with 3 confirm probes at x0.95,
    x1.0, x1.05 of the solved lr and the nearest of them taken, the run's ratio is its probe's, known before it
    runs. The nearest of 3 independent N(0, s) draws (about the line's own error, small beside s) has E|.| about 0.34 s
    (the least of three half-normals: 0.335 s by quadrature), so the mean absolute log ratio falls below half of
    the solved one's and the share within log 1.05 at least doubles."""
    rng = np.random.default_rng(3)
    n, b, sd = 2000, 1.3, 0.25
    a = rng.normal(math.log(0.009), 0.3, n) + rng.normal(0.4, 0.4, n)  # the arm's offset from the reference
    seeds = np.arange(n)

    def kl(lr: np.ndarray) -> np.ndarray:  # a fresh draw of the chaos at each lr
        return np.exp(a + b * np.log(lr / 4e-4) + rng.normal(0, sd, n))

    log_ref = rng.normal(math.log(0.009), 0.3, n)
    probes = [pd.DataFrame({"seed": seeds, "arm": "ref", "multiplier": 1.0, "lr": 4e-4, "kl": np.exp(log_ref)})]
    for k in (0.6, 1.0, 1.6):
        lr = np.full(n, 4e-4 * k)
        probes.append(pd.DataFrame({"seed": seeds, "arm": "arm", "multiplier": k, "lr": lr, "kl": kl(lr)}))
    bracket = pd.concat(probes).assign(level="hi", confirm=False)
    solved = matching.solve_lrs(bracket, "ref", (0.6, 1.0, 1.6), {("arm", "hi"): 4e-4}, pool=10 * n)
    solved = solved.set_index("seed").loc[seeds].reset_index()
    plain = np.log(kl(solved["lr"].to_numpy())) - log_ref  # the run at the solved lr: one more draw
    wanted = matching.confirm_probes(solved, (0.95, 1.0, 1.05))
    confirm = [
        pd.DataFrame({"seed": g["seed"], "arm": "arm", "lr": g["lr"], "kl": kl(g["lr"].to_numpy())})
        for _, g in wanted.groupby("multiplier")
    ]
    every = pd.concat([bracket[bracket["arm"] == "arm"], *(c.assign(level="hi", confirm=True) for c in confirm)])
    chosen = matching.nearest_lrs(solved, every, 3, 1.05).set_index("seed").loc[seeds]
    assert chosen["status"].isin(matching.CONFIRMED).all()
    picked = every.set_index(["seed", "lr"])["kl"]
    near = np.log(picked.loc[list(zip(seeds, chosen["lr"], strict=True))].to_numpy()) - log_ref
    assert plain.std() >= sd * 0.9 and np.abs(near).mean() < 0.5 * np.abs(plain).mean()
    inside = math.log(1.05)
    assert (np.abs(near) <= inside).mean() >= 2 * (np.abs(plain) <= inside).mean()
    assert (chosen["status"] == "confirmed").mean() == pytest.approx((np.abs(near) <= inside + 1e-12).mean())


def test_the_placebo_s_lr_and_what_it_did_by_hand(tmp_path) -> None:
    """The placebo of the tiny matched study ran at 1x, 2x and 0.5x the reference's lr (2e-3) on members 310-312 and
    ended 0, -5 and +5 points from the reference: -5 points per doubling, exactly (a zero-width interval), at a median
    multiple of 1x. A start whose placebo run was not admitted is left out; with fewer than 3 starts, no reading."""
    study = load_study(_write(tmp_path, _study_raw()))
    lrs = pd.DataFrame(
        {"member": [310, 311, 312], "arm": "placebo", "level": "hi", "lr": [2e-3, 4e-3, 1e-3], "seed": [310, 311, 312]}
    )
    rows = [(s, "none", 0.1, True) for s in (310, 311, 312)]
    rows += [(310, "placebo", 0.1, True), (311, "placebo", 0.05, True), (312, "placebo", 0.15, True)]
    runs = pd.DataFrame(rows, columns=["seed", "arm", "change", "admitted"]).assign(level="hi")
    read = matching.placebo_lr(study, runs, lrs)
    assert read is not None and read["n"] == 3 and read["ratio"] == pytest.approx(1.0)
    assert read["slope"] == pytest.approx(-0.05) and read["lo"] == pytest.approx(-0.05) == read["hi"]
    runs.loc[(runs["seed"] == 312) & (runs["arm"] == "placebo"), "admitted"] = False
    assert matching.placebo_lr(study, runs, lrs) is None


# --- the declaration and the launch ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bracket": [1.25, 0.8]}, "must list 2 or more increasing"),
        ({"bracket": [1.0]}, "must list 2 or more increasing"),
        ({"probe_steps": 0}, "probe_steps 0 must be"),
        ({"confirm": [1.1, 0.9]}, "match.confirm .* must list increasing multipliers"),
        ({"per": "member"}, "match.per 'member' must be 'start'"),
        ({"per": "pool", "confirm": [0.95, 1.0]}, "declare one or the other"),
        ({"confirm": [0.0, 1.0]}, "match.confirm .* must list increasing multipliers"),
        ({"divergence": "kl_update"}, "probes read the early acting KL"),
        ({"reference": "dense"}, "match.reference 'dense' is not one of its arms"),
        ({"placebo": None}, "carries a placebo"),
        ({"placebo": "r2_minus_none"}, "placebo r2_minus_none must be one arm minus none"),
    ],
)
def test_a_matched_declaration_that_cannot_match_is_refused(tmp_path, change, message) -> None:
    raw = _study_raw()
    with pytest.raises(ValueError, match=message):
        load_study(_write(tmp_path, {**raw, "match": {**raw["match"], **change}}))


def test_a_placebo_at_its_reference_s_lr_or_with_other_overrides_is_refused(tmp_path) -> None:
    raw = _study_raw()
    for placebo in (
        {"overrides": ["replay=none"], "ref": "moe"},
        {"overrides": ["replay=r2"], "ref": "moe", "lr_scale": 1.3},
    ):
        with pytest.raises(ValueError, match="at another lr_scale|compose to the same run config"):
            load_study(_write(tmp_path, {**raw, "arms": {**raw["arms"], "placebo": placebo}}))
    arms = {k: {"overrides": v["overrides"]} for k, v in raw["arms"].items()}
    arms["placebo"]["overrides"] = ["replay=none", "optim.weight_decay=0.01"]  # not a duplicate of none
    no_lr = {**raw, "levels": {"hi": {"overrides": ["optim.lr=2e-3"]}}, "arms": arms}
    with pytest.raises(ValueError, match="set no lr per reference model"):
        load_study(_write(tmp_path, no_lr))


def test_the_probe_plan_and_its_cost() -> None:
    assert matching.check_probe_cost(20, 200, "c") == pytest.approx(0.1)
    assert matching.check_probe_cost(30, 200, "c") == pytest.approx(0.15)
    with pytest.raises(ValueError, match="at most 15% of a run"):
        matching.check_probe_cost(3, 14, "c")
    assert matching.with_override(["a=1", "optim.lr=1", "b=2", "optim.lr=3"], "optim.lr", "4") == [
        "a=1",
        "b=2",
        "optim.lr=4",
    ]
    assert matching.parse_folder(matching.probe_folder("r2", "hi", 1.25)) == ("r2", "hi", 1.25, False)
    assert matching.parse_folder(matching.confirm_folder("r2", "hi", 0.95)) == ("r2", "hi", 0.95, True)
    assert matching.parse_folder("r2@hi") is None


def test_the_dry_run_lists_the_probes_and_leaves_the_lrs_to_them(tmp_path) -> None:
    """Probes first (the reference's at its lr, each other arm's at the bracket, `probe_steps` steps), then the
    reference's multirun; the other cells' runs wait for their probes. A probe above 15% of its run is refused."""
    study = load_study(_write(tmp_path, _study_raw()))
    out = study_dry_run(tmp_path, study.name)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("[")]
    heads = [line.split("]")[0][1:] for line in lines]
    assert heads == [
        "probe none@hi@x1",
        "probe r2@hi@x0.8",
        "probe r2@hi@x1.25",
        "probe placebo@hi@x0.8",
        "probe placebo@hi@x1.25",
        "none@hi",
        "r2@hi",
        "placebo@hi",
    ]
    assert (
        "probes of 2 steps, 14%-14% of a run's steps each; hi: 5 probes per seed, 24% of its 42 run steps" in out.stdout
    )
    probe = lines[1]
    assert (
        "steps=2" in probe and "steps=14" not in probe and "optim.lr=0.0016 " in probe and "seed=310,311,312" in probe
    )
    assert "tiny_matched/probes/r2@hi@x0.8" in probe and "experiment=tiny_matched_probe" in probe
    assert "optim.lr=0.00208" in lines[3]  # the placebo's declared lr, 1.3 x 2e-3, x 0.8
    assert "optim.lr=0.002 " in lines[5] and "seed=310,311,312" in lines[5] and " steps=14 " in lines[5]
    assert all("each at the lr its seed's probes give" in line for line in lines[6:])
    raw = _study_raw()
    reuse = {**raw["unit"], "reuse": {"tiny_matched": "the same study with costlier probes"}}
    costly = {**raw, "name": "costly", "unit": reuse, "match": {**raw["match"], "probe_steps": 3}}
    _write(tmp_path, costly)
    refused = study_dry_run(tmp_path, "costly")
    assert refused.returncode != 0 and "a probe may cost at most 15% of a run" in refused.stderr
    reuse = {**raw["unit"], "reuse": {"tiny_matched": "the same", "costly": "the same, with confirm probes"}}
    confirmed = {**raw, "name": "confirmed", "unit": reuse, "match": {**raw["match"], "confirm": [0.9, 1.1]}}
    _write(tmp_path, confirmed)
    out = study_dry_run(tmp_path, "confirmed")
    assert out.returncode == 0, out.stderr
    assert "hi: 9 probes per seed" in out.stdout  # 1 + 2 x (2 of the bracket + 2 confirm)
    assert "[confirm r2@hi] each seed's probes at x0.9, x1.1 of its solved lr" in out.stdout
    assert "[confirm placebo@hi] each seed's probes at x0.9, x1.1 of its solved lr" in out.stdout


# --- end to end ----------------------------------------------------------------------------------------------------


def _config(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


@pytest.mark.slow
def test_a_matched_study_with_a_placebo_runs_end_to_end(tmp_path, cache, monkeypatch) -> None:
    """3 members of the tiny model, the reference and its placebo (the study's r2 arm left out: the placebo is matched
    back like any arm, at a third of the launches): probes of 2 steps (the reference at its lr, the placebo at x0.8
    and x1.25, then at each seed's solved lr: `match.confirm`), each seed's lr that of its probe nearest the
    reference's KL in match/lrs.csv, the full runs of 14 steps at those lrs, the look decided. A run's first steps
    are its chosen probe (the same KL, bitwise), from the member's one warm-up; the same
    command again launches nothing and moves no lr. The launcher runs in this process (`run_study`), and so does each
    `experiments/train.py` command it launches (`train_in_process`: the command it builds, run by the script's own
    entry point in a launched run's environment; no interpreter to start)."""
    studies = tmp_path / "studies"
    studies.mkdir()
    raw = _study_raw()
    raw["arms"] = {k: v for k, v in raw["arms"].items() if k != "r2"}
    raw["contrasts"] = [c for c in raw["contrasts"] if c["name"] != "r2_minus_none"]
    raw["overrides"] = [*raw["overrides"], f"cold_start.cache_dir={cache}"]
    raw["match"] = {**raw["match"], "confirm": [1.0]}  # a probe at each seed's solved lr; the nearest probe's lr wins
    # test_study's tiny study warms these members of the same tiny config: their warm-ups, kept in the session's
    # cold-start cache, are trained once for both end-to-end studies
    raw["unit"] = {**raw["unit"], "members": "300..302"}
    study = load_study(_write(studies, raw))
    for key, value in TRAIN_ENV.items():  # what the launched runs inherit
        monkeypatch.setenv(key, value)
    launched = train_in_process(monkeypatch, launcher())
    # one job: each multirun in one process, no joblib workers importing torch again (36% less CPU than two)
    command = [study.name, "--studies", str(studies), "--runs", str(tmp_path), "--jobs", "1"]
    out = run_study(*command)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # 3 probe multiruns (the reference's, the placebo's two), the placebo's 3 confirm probes (one per seed, at its
    # solved lr), the reference's multirun, the placebo's 3 single runs
    probe = f"experiment={study.name}_probe"
    assert [("-m" in cmd, probe in cmd) for cmd in launched] == [(True, True)] * 6 + [(True, False)] * 4
    root = tmp_path / study.name
    probes = matching.read_probes(root / "probes", study)
    assert len(probes) == 3 * 4 and probes["kl"].gt(0).all() and probes["confirm"].sum() == 3
    bracket = probes[~probes["confirm"]]
    assert sorted(set(zip(bracket["arm"], bracket["multiplier"], strict=True))) == [
        ("none", 1.0),
        ("placebo", 0.8),
        ("placebo", 1.25),
    ]
    assert all(_config(Path(r))["steps"] == 2 for r in probes["run_dir"])
    lrs = matching.read_lrs(matching.lrs_path(tmp_path, study))
    assert lrs is not None and len(lrs) == 3 and lrs["status"].isin(matching.CONFIRMED).all()
    assert np.allclose(lrs["lr"], lrs["lr_declared"] * lrs["multiplier"], rtol=1e-4)
    # each placebo seed runs at the lr of its confirm probe nearest the reference's KL: here its one confirm probe, at
    # the lr its bracket solved; its status says whether that probe came within the tolerance
    placebo = probes[(probes["arm"] == "placebo") & probes["confirm"]].set_index("seed")
    ref_kl = probes[probes["arm"] == "none"].set_index("seed")["kl"]
    for row in lrs.itertuples():
        assert float(row.lr) == pytest.approx(float(placebo.loc[row.seed, "lr"]), rel=1e-9)
        inside = abs(math.log(placebo.loc[row.seed, "kl"] / ref_kl[row.seed])) <= math.log(1.5)
        assert row.status == ("confirmed" if inside else "nearest")
    runs = pd.read_csv(root / "runs.csv")
    assert len(runs) == 6 and runs["start"].nunique() == 3
    chosen = {(r.arm, int(r.seed)): float(r.lr) for r in lrs.itertuples()}
    full = {
        (d.parent.name.split("@")[0], int(_config(d)["seed"])): d
        for d in (p.parent for p in root.glob("runs/*/*/config.yaml"))
    }
    assert len(full) == 6
    for (arm, seed), run_dir in full.items():
        cfg = _config(run_dir)
        assert cfg["steps"] == 14 and cfg["optim"]["lr"] == pytest.approx(chosen.get((arm, seed), 2e-3), rel=1e-9)
    # a run's first steps are its chosen probe (the same KL, bitwise): the reference's and each placebo seed's
    nearest = {("placebo", int(r.seed)): float(r.lr) for r in lrs.itertuples()}
    for p in probes.itertuples():
        key = (str(p.arm), int(p.seed))
        if p.arm == "placebo" and float(p.lr) != pytest.approx(nearest[key], rel=1e-9):
            continue
        kl = [
            pd.read_parquet(Path(d) / "metrics.parquet").query(f"key == '{KL_UPDATE_K3}' and step <= 2")["value"]
            for d in (p.run_dir, full[key])
        ]
        assert len(kl[0]) == 2 and kl[0].tolist() == kl[1].tolist()
    contrasts = pd.read_csv(root / "contrasts.csv")
    assert set(contrasts["contrast"]) == {"placebo_minus_none"} and (contrasts["starts"] == 3).all()
    k = int((lrs["status"] == "confirmed").sum())
    assert f" {k} of its 3 matched seeds were within the tolerance (`confirmed`)" in (root / "summary.md").read_text()
    # the same command again: every probe and matched run is found finished, and no seed's lr moves
    written = matching.lrs_path(tmp_path, study).read_text()
    again = run_study(*command)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert len(launched) == 10  # nothing launched again
    assert again.stdout.count("every probe of the look finished") == 3
    assert again.stdout.count("[none@hi] every run of the look finished") == 1 and "[none@hi] -m" not in again.stdout
    assert again.stdout.count("3 runs finished at their seeds' lrs") == 1 and "seed 300 at lr" not in again.stdout
    assert (
        matching.lrs_path(tmp_path, study).read_text() == written and len(list(root.glob("runs/*/*/config.yaml"))) == 6
    )
