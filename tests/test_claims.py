"""Claims verdicts on synthetic result folders, one world per outcome; collapse definitions and the phase map."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fake_results import make_fake_grid, write_fake_fit
from helpers import PRESETS, ROOT

from moe_rl import analysis, studies
from moe_rl.analysis import claims as C
from moe_rl.analysis.claims import paired
from moe_rl.analysis.collapse_definitions import collapse_definitions_markdown, collapse_events
from moe_rl.analysis.phase import format_phase_markdown, phase_table, phase_tests, run_outcomes
from moe_rl.studies import drift_claims, engine_claim, mechanism_claims, phase_claims, shift_claim

DECLARATIONS = PRESETS.parent / "study"  # the registry, read with presets that have no declarations beside them

STEPS = 30
STARTS = 6  # the planted worlds' runs begin from 6 cold starts: one sign per start, smallest one-sided p 1/64


def _dense_control(
    root: Path,
    moe_acc,
    dense_acc,
    *,
    arms=("grpo+none", "gspo+none"),
    seeds=tuple(range(8)),
    lrs=(3e-4,),
    Ns=(8,),
    starts=STARTS,
) -> None:
    """dense_control runs: the MoE model and its dense control in the same cells, paired by seed, each model
    from `starts` cold starts of its own."""
    for family, acc in (("qwen3_moe", moe_acc), ("qwen3_dense", dense_acc)):
        make_fake_grid(
            root,
            experiment="dense_control",
            arms=arms,
            lrs=lrs,
            Ns=Ns,
            seeds=seeds,
            steps=STEPS,
            log_shift=False,
            family=family,
            final_acc=acc,
            starts=starts,
        )


def _const(value: float):
    return lambda *_: value


# What differs between the worlds: each claim's planted effect (the sweeps around them are the same).
WORLDS = {
    # the MoE model ends below its cold start (0.4), the dense control above it
    "reproduced": {
        "dense": dict(moe_acc=_const(0.2), dense_acc=_const(0.5)),
        "fit": dict(predicted=0.1, ci=(0.06, 0.15)),
        "phase": dict(
            Ns=(1, 4), shift_lag=2, n_collapse=lambda a, lr, N, L: WORLD_PHASE["reproduced"][a] if N > 1 else 0
        ),
        "drift": dict(seeds=tuple(range(6)), flip=lambda a, lr, N, L, s: 0.002 * L * (1 + 0.05 * s)),
        "engine": dict(n_collapse=lambda a, lr, N, L: 6 if a == "grpo+r2" else 0),
    },
    # both models end below their cold start, alike: the degradation needs no routing; N=2: GRPO+R2
    # collapses, GRPO without replay does not; N=4: GSPO collapses where GRPO+R2 does not
    "not reproduced": {
        "dense": dict(moe_acc=_const(0.2), dense_acc=_const(0.2)),
        "fit": dict(predicted=0.005, ci=(0.002, 0.01)),
        "phase": dict(Ns=(2, 4), shift_lag=-2, n_collapse=lambda a, lr, N, L: WORLD_PHASE["not reproduced"][N, a]),
        "drift": dict(seeds=tuple(range(6)), flip=lambda a, lr, N, L, s: 0.02 / L * (1 + 0.05 * s)),
        "engine": dict(n_collapse=lambda a, lr, N, L: 6 if a == "grpo+r3" else 0),
    },
    # two pairs: the dense control ends 10 and 35 points above the MoE model, -10 and +15 from its start; the
    # drift and engine sweeps (3 seeds) and these 2 pairs rest on fewer than 5 starts: descriptive, inconclusive
    "inconclusive": {
        "dense": dict(
            moe_acc=_const(0.2),
            dense_acc=lambda a, lr, N, L, s: 0.3 + 0.25 * (s % 2),
            arms=("grpo+none",),
            seeds=(0, 1),
        ),
        "fit": dict(predicted=0.03, ci=(0.001, 0.5)),
        # shift unrelated to clipping
        "phase": dict(Ns=(4,), shift_lag=None, n_collapse=lambda a, lr, N, L: WORLD_PHASE["inconclusive"][a]),
        "drift": dict(seeds=(0, 1, 2), flip=lambda a, lr, N, L, s: 0.02 + (0.015 * (-1) ** s if L == 8 else 0.0)),
        "engine": dict(
            seeds=(0, 1, 2),
            n_collapse=lambda a, lr, N, L: 1 if a == "grpo+r2" else 0,
            final_acc=lambda a, lr, N, L, s: 0.45 + (0.1 * (-1) ** s if a == "grpo+r3" else 0.0),
        ),
    },
}
WORLD_PHASE: dict[str, dict] = {  # collapsed seeds (of 8) per phase cell
    "reproduced": {"grpo+none": 6, "grpo+r2": 0, "gspo+none": 0},
    "not reproduced": {
        (2, "grpo+none"): 0,
        (2, "grpo+r2"): 8,
        (2, "gspo+none"): 0,
        (4, "grpo+none"): 1,
        (4, "grpo+r2"): 0,
        (4, "gspo+none"): 8,
    },
    "inconclusive": {"grpo+none": 2, "grpo+r2": 1, "gspo+none": 1},
}


# the sweeps of the drift-scaling and engine-mismatch claims
DRIFT_GRID = dict(
    experiment="drift_scaling",
    arms=("grpo+none",),
    lrs=(1e-4,),
    Ns=(4,),
    layers=(2, 8),
    steps=STEPS,
    log_shift=False,
    starts=STARTS,
)
MISMATCH_GRID = dict(
    arms=("grpo+r2", "grpo+r3"),
    lrs=(1e-4,),
    Ns=(8,),
    steps=STEPS,
    rollout_dtype="bfloat16",
    log_shift=False,
    starts=STARTS,
)


def _world(root: Path, kind: str) -> Path:
    """Result folders in which every claim should come out `kind`."""
    world = WORLDS[kind]
    dense = dict(world["dense"])
    _dense_control(root, dense.pop("moe_acc"), dense.pop("dense_acc"), **dense)
    write_fake_fit(root, r2_holdout=0.9, **world["fit"])
    make_fake_grid(root, lrs=(1e-3,), steps=STEPS, starts=STARTS, **world["phase"])
    make_fake_grid(root, **DRIFT_GRID, **world["drift"])
    make_fake_grid(root, experiment="engine_mismatch", **MISMATCH_GRID, **world["engine"])
    return root


@pytest.fixture(scope="module", params=["reproduced", "not reproduced", "inconclusive"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[C.Claim]]:
    root = _world(tmp_path_factory.mktemp(request.param.replace(" ", "_")), request.param)
    return request.param, studies.claims(root, root / "no_declarations", DECLARATIONS)


def test_every_claim_gets_the_expected_verdict(world: tuple[str, list[C.Claim]]) -> None:
    kind, claims = world
    got = {c.id: (c.verdict, c.reason) for c in claims}
    assert [c.id for c in claims] == list(range(1, 16))
    # the planted world holds no mechanism ladder, no frontier and no causal study: claims 8 and 9 (judged on planted
    # ladders in test_ladder_claims_...), 10 and 11 (planted edges in test_staleness_study.py) and 7, 14 and 15
    # (test_causal_study.py), 12 and 13 (test_length_study.py) have nothing to judge here; claim 7's first look, the
    # dense control, is in its notes
    expected = {i: kind for i in got if i <= 6} | {8: "untestable here", 9: "untestable here"}
    if kind == "not reproduced":  # the clip fraction leads there, but the forward excess's interval (few planted
        # runs) reaches past the 1% margin: the one rule cannot call it not reproduced, and says why
        expected[6] = "inconclusive"
        assert "the clip fraction leads the shift more than the shift leads it" in got[6][1]
    if kind == "inconclusive":  # no lead planted: the forward excess's interval reaches far below 0, its upper end
        # under the 1% margin, so the one-sided rule excludes the claimed lead
        expected[6] = "not reproduced"
        assert "an effect of +0.01 in the claimed direction excluded" in got[6][1]
    undecided = {i: "inconclusive" for i in (7, 10, 11, 12, 13, 14, 15)}
    assert {i: v for i, (v, _) in got.items()} == expected | undecided, got
    assert got[8][1] == got[9][1] == "no runs of mechanism"
    assert all(got[i][1] == "no data" for i in undecided)
    assert f"first look, the dense control at a fixed lr (`dense_control`): {kind} (" in " ".join(claims[6].notes)
    assert all("failed" not in r for _, r in got.values())


@pytest.mark.parametrize("world", ["reproduced"], indirect=True)
def test_depth_claim_reports_the_token_share_on_the_same_pairs(world: tuple[str, list[C.Claim]]) -> None:
    _, claims = world
    # per-layer flip 0.002 L (1 + 0.05 s): tokens 1 - (1 - f)^L; seeds 0..5 each from a start of its own (6 starts):
    # the mean of the starts' means is the seed mean, and p one sign per start, 1 / 2^6
    f = {L: 0.002 * L * (1 + 0.05 * np.arange(6)) for L in (2, 8)}
    diff = 100 * np.mean((1 - (1 - f[8]) ** 8) - (1 - (1 - f[2]) ** 2))
    note = next(n for n in claims[3].notes if n.startswith("support: tokens"))
    assert "(8 layers) vs " in note and f": {diff:+.1f} pp [" in note and "6 pairs, one-sided p = 0.0156" in note


def test_shift_lead_claim_counts_cold_starts(tmp_path: Path) -> None:
    """Claim 6 on the reproduced world's phase grid (the shift leads the clip fraction by 2 steps), its runs from 2
    cold starts, then 5: the lead is the same test on the same runs; from 2 starts it is descriptive (no interval,
    the seed-level reading in the reason), from 5 it decides, its interval over starts."""
    for n in (2, 5):
        make_fake_grid(tmp_path / str(n), lrs=(1e-3,), steps=STEPS, starts=n, **WORLDS["reproduced"]["phase"])
    two, five = (shift_claim.claim_shift_leads(tmp_path / str(n), ("phase",)) for n in (2, 5))
    assert (five.verdict, two.verdict) == ("reproduced", "inconclusive")
    assert two.reason == (
        f"descriptive: 2 independent starts (an interval needs 5); by seed pairs it reads: reproduced ({five.reason})"
    )
    assert "runs from 5 cold starts" in five.cells and "runs from 2 cold starts" in two.cells
    assert "% [" in five.statistic and "% [" not in two.statistic
    assert two.plain.endswith("a verdict needs 5 (runs from new cold starts, not more seeds).")


def test_depth_claim_from_fewer_than_5_starts_is_descriptive(tmp_path: Path) -> None:
    """Claim 4 on the reproduced world's drift sweep (6 seed pairs, the deeper model flipping more), each depth's
    runs from 2 cold starts, then 5: descriptive, then reproduced, the seed-level reading in the reason."""
    for n in (2, 5):
        make_fake_grid(tmp_path / str(n), **{**DRIFT_GRID, "starts": n}, **WORLDS["reproduced"]["drift"])
    two, five = (drift_claims.claim_depth(tmp_path / str(n), tmp_path / "no_declarations") for n in (2, 5))
    assert (five.verdict, two.verdict) == ("reproduced", "inconclusive")
    # from 5 starts the test has one sign per start (smallest one-sided p 1 / 2^5); from 2 the reason quotes the
    # reading by the 6 seed pairs (1 / 2^6), and the statistic no interval
    assert five.p_value == 1 / 32 and "p = 0.0312" in five.reason and np.isnan(two.p_value)
    assert two.reason == (
        "descriptive: 2 independent starts (an interval needs 5); by seed pairs it reads: reproduced "
        f"({five.reason.replace('0.0312', '0.0156')})"
    )
    assert " pp [" in five.statistic and " pp [" not in two.statistic
    assert (
        two.plain.endswith(
            " Descriptive: 2 independent starts; a verdict needs 5 (runs from new cold starts, not more seeds)."
        )
        and "Descriptive" not in five.plain
    )


def _pairs_frame(
    n_cells: int,
    seeds: int,
    *,
    acc_gain: float,
    collapse_w: dict[str, int],
    arms: tuple[str, str] = ("grpo+none", "grpo+r2"),
    start: float = 0.4,
    starts: int = STARTS,
) -> pd.DataFrame:
    """Outcomes of arms[0] (w, default grpo+none) and arms[1] (b, default grpo+r2) in `n_cells` off-policy
    cells, each starting at accuracy `start`: b ends `acc_gain` above w in every pair (final and late
    accuracy alike); under each definition d the first collapse_w[d] pairs (over cells) see w collapse at
    step 10 and b never. Both arms of a seed share its cold start, one of `starts` (the seed modulo `starts`)."""
    rows, pair = [], 0
    for cell in range(n_cells):
        for seed in range(seeds):
            for arm, gain in ((arms[0], 0.0), (arms[1], acc_gain)):
                row = {
                    "arm": arm,
                    "lr": 1e-3 * (cell + 1),
                    "N": 8,
                    "seed": seed,
                    "start": f"start{seed % starts}",
                    "start_accuracy": start,
                    "late_accuracy": 0.2 + 0.01 * seed + gain,
                    "final_accuracy": 0.2 + 0.01 * seed + gain,
                    "reward_auc": 0.1 + 0.01 * seed,
                    "last_step": 200,
                }
                for d, k in collapse_w.items():
                    hit = arm == arms[0] and pair < k
                    row[f"collapsed_{d}"], row[f"collapse_step_{d}"] = hit, 10.0 if hit else np.nan
                rows.append(row)
            pair += 1
    return pd.DataFrame(rows)


def test_compare_arms_by_hand() -> None:
    """12 pairs from 6 cold starts (2 per start), r2 ends 0.1 higher in each: sign-flip with one sign per start p =
    1/64 exactly; reward AUC equal (p = 1); in 5 pairs only grpo+none collapses: log-rank on pairs Z = (5/2) /
    sqrt(5/4) = sqrt(5), McNemar 1/32."""
    from scipy import stats as sps

    out = _pairs_frame(2, 6, acc_gain=0.1, collapse_w={"relative": 5, "absolute": 0})
    cmp = C.compare_arms(out, "grpo+none", "grpo+r2", ["lr", "N"])
    assert cmp.cont["late_accuracy"]["p_value"] == pytest.approx(1 / 64)
    assert cmp.cont["late_accuracy"]["mean_diff"] == pytest.approx(0.1)
    assert cmp.cont["reward_auc"]["p_value"] == 1.0
    assert cmp.surv["p_more"] == pytest.approx(sps.norm.sf(np.sqrt(5)))
    assert cmp.surv["mcnemar_more"] == pytest.approx(1 / 32) and (cmp.surv["kw"], cmp.surv["kb"]) == (5, 0)
    assert cmp.surv["km_w"] == pytest.approx(7 / 12) and cmp.surv["km_b"] == 1.0
    holm = analysis.stats.holm([1 / 64, 1.0, sps.norm.sf(np.sqrt(5))])
    assert cmp.verdict == "reproduced" and cmp.p == pytest.approx(holm.min())
    # three looks: every p times 3
    assert C.compare_arms(out, "grpo+none", "grpo+r2", ["lr", "N"], looks=3).p == pytest.approx(3 * holm.min())
    # no difference at all: the intervals sit inside the margins
    same = C.compare_arms(
        _pairs_frame(2, 6, acc_gain=0.0, collapse_w={"relative": 0}), "grpo+none", "grpo+r2", ["lr", "N"]
    )
    assert same.verdict == "not reproduced" and "no difference" in same.reason


# A claim declared only for these tests: the engine judges any record, not just the shipped claims.
PLANTED = C.PairedClaim(
    8,
    "moe+aux is more stable than moe",
    "planted",
    "moe+aux vs moe, paired by seed in the cells where moe degrades",
    experiment="planted",
    worse="moe",
    better="moe+aux",
    degrading=("moe",),
)


@pytest.mark.parametrize("outcomes", [C.ARMS_OUTCOMES, C.COLLAPSE_OUTCOMES])
def test_a_declared_record_finds_the_planted_effect(outcomes: tuple[str, ...]) -> None:
    """12 pairs in 2 cells where moe degrades: moe+aux ends 10 points higher in every pair and moe alone
    collapses in 5. Either test reproduces the claim, at the p the statistics give by hand."""
    from dataclasses import replace

    from scipy import stats as sps

    record = replace(PLANTED, outcomes=outcomes)
    out = _pairs_frame(2, 6, acc_gain=0.1, collapse_w={"relative": 5}, arms=("moe", "moe+aux"))
    c = C.judge_paired(record, Path("unused"), runs=out)
    assert (c.id, c.verdict, c.experiment) == (8, "reproduced", "planted")
    assert c.cells == "2 cell(s) where moe degrades: lr=0.001, N=8; lr=0.002, N=8"
    if outcomes == C.ARMS_OUTCOMES:  # sign-flip 1/64 (accuracy, one sign per start), 1 (reward AUC), log-rank sqrt(5)
        assert c.p_value == pytest.approx(analysis.stats.holm([1 / 64, 1.0, sps.norm.sf(np.sqrt(5))]).min())
        assert c.statistic.startswith("moe+aux - moe: final accuracy +10.0 pp") and "(12 pairs)" in c.statistic
        assert c.robustness == {"relative": "reproduced"} and "**reproduced**" in c.plain
    else:  # the CMH p (cell 1: 5 of 6 vs 0 of 6, C(6,5) / C(12,5) = 6/792) beats final accuracy's 1/64; Holm doubles it
        assert c.p_value == pytest.approx(12 / 792) and c.reason == f"moe+aux better at Holm p = {12 / 792:.3g}"
        assert c.statistic.startswith("collapsed moe 5 of 12 vs moe+aux 0 of 12; final accuracy moe+aux - moe")
    # pooled over two cells: the same rule on each cell alone beside it (6 pairs, sign-flip 1/64 per cell)
    cells = [n for n in c.notes if n.startswith("cell ")]
    assert [n.split(" alone:")[0] for n in cells] == ["cell lr=0.001, N=8", "cell lr=0.002, N=8"]
    assert all(n.endswith("the rule on this cell alone: reproduced") for n in cells)
    assert "moe 40.0% -> 22.5% (6 of 6 below the start, 5 collapsed); moe+aux 40.0% -> 32.5% (6 of 6" in cells[0]
    assert "moe+aux - moe final accuracy +10.0 pp [+10.0, +10.0] (6 pairs)" in cells[1]


@pytest.mark.parametrize("outcomes", [C.ARMS_OUTCOMES, C.COLLAPSE_OUTCOMES])
def test_a_declared_record_rejects_the_opposite_effect(outcomes: tuple[str, ...]) -> None:
    """The same pairs with moe+aux 10 points lower: not reproduced. Where moe does not degrade (it ends above
    its start), no cell counts and the claim is untestable here."""
    from dataclasses import replace

    record = replace(PLANTED, outcomes=outcomes)
    out = _pairs_frame(2, 6, acc_gain=-0.1, collapse_w={"relative": 0}, arms=("moe", "moe+aux"))
    c = C.judge_paired(record, Path("unused"), runs=out)
    assert c.verdict == "not reproduced"
    if outcomes == C.ARMS_OUTCOMES:
        assert c.reason.startswith("final accuracy favours the other arm (Holm p = ")
    else:
        assert c.reason.startswith("moe better at Holm p = ")
    held = _pairs_frame(2, 6, acc_gain=0.1, collapse_w={"relative": 5}, arms=("moe", "moe+aux"), start=0.1)
    c = C.judge_paired(record, Path("unused"), runs=held)
    assert (c.verdict, c.reason, c.cells) == (
        "untestable here",
        "moe end above their cold start's accuracy in every cell (lr=0.001, N=8; lr=0.002, N=8)",
        "none of lr=0.001, N=8; lr=0.002, N=8 degrades",
    )
    assert C.judge_paired(record, Path("unused"), runs=out[out["arm"] == "moe"]).reason == (
        "no runs of ['moe+aux'] in planted"
    )


def test_a_rival_that_beats_the_claimed_arm_overturns_it() -> None:
    """moe+aux beats moe, but a rival (moe+r2) beats moe+aux in turn: not reproduced, with both reasons."""
    from dataclasses import replace

    out = _pairs_frame(2, 6, acc_gain=0.1, collapse_w={"relative": 0}, arms=("moe", "moe+aux"))
    rival = out[out["arm"] == "moe+aux"].assign(arm="moe+r2", late_accuracy=lambda f: f["late_accuracy"] + 0.1)
    record = replace(PLANTED, rivals=(("moe+aux", "moe+r2"),))
    c = C.judge_paired(record, Path("unused"), runs=pd.concat([out, rival], ignore_index=True))
    assert c.verdict == "not reproduced"
    assert c.reason.startswith("moe+aux vs moe: reproduced (") and "; moe+r2 vs moe+aux: reproduced (" in c.reason
    assert C.combine("reproduced", [False]) == "reproduced" and C.combine("inconclusive", []) == "inconclusive"


@pytest.mark.parametrize("outcomes", [C.ARMS_OUTCOMES, C.COLLAPSE_OUTCOMES])
def test_pairs_from_fewer_than_5_starts_are_descriptive(outcomes: tuple[str, ...]) -> None:
    """The planted effect of `test_a_declared_record_finds_the_planted_effect` (12 pairs, moe+aux 10 points
    ahead in each), its seeds from 2 cold starts: no verdict, the seed-level reading in the reason; the same
    pairs from 6 starts: reproduced, one sign per start."""
    from dataclasses import replace

    record = replace(PLANTED, outcomes=outcomes)
    out = {
        n: _pairs_frame(2, 6, acc_gain=0.1, collapse_w={"relative": 5}, arms=("moe", "moe+aux"), starts=n)
        for n in (2, 6)
    }
    two, five = (C.judge_paired(record, Path("unused"), runs=out[n]) for n in (2, 6))
    assert (five.verdict, two.verdict) == ("reproduced", "inconclusive")
    assert C.independent_starts(out[2], ("moe", "moe+aux")) == 2
    assert two.reason.startswith(
        "descriptive: 2 independent starts (an interval needs 5); by seed pairs it reads: reproduced ("
    )
    assert np.isnan(two.p_value) and 0 < five.p_value < 0.05
    # they describe the same runs, the descriptive one without its seed-level intervals
    assert (two.statistic, two.cells) == (paired.INTERVAL.sub("", five.statistic), five.cells)
    assert "[" in five.statistic and "[" not in two.statistic
    counts = [n for n in two.notes if n.startswith("secondary, collapse counts")]  # no Wilson interval, no test
    assert all("descriptive (counts only, no test)" in n and "[" not in n and "McNemar" not in n for n in counts)
    assert len(counts) == sum(n.startswith("secondary, collapse counts") for n in five.notes)
    if outcomes == C.ARMS_OUTCOMES:
        assert counts and counts[0].endswith("where only moe+aux did")  # the counts and discordant pairs stay
    if outcomes == C.ARMS_OUTCOMES:  # the grid cannot decide either; the paragraph says why
        assert two.robustness == {"relative": "inconclusive"} and five.robustness == {"relative": "reproduced"}
        assert two.notes[0] == f"by seed pairs, descriptive: {five.notes[0]}"
        assert "Verdict: **inconclusive**" in two.plain
        assert two.plain.endswith(
            " Descriptive: 2 independent starts; a verdict needs 5 (runs from new cold starts, not more seeds)."
        )
        assert "Descriptive" not in five.plain


def test_the_starts_are_read_from_the_run_folders(tmp_path: Path) -> None:
    """Claim 5 on engine runs whose meta.json records 2 cold starts, then 6: the engine reads each run's start from
    its folder (`configs.run_starts`). R2 collapses in 6 of 8 seeds, R3 never."""
    claims = {}
    for n in (2, 6):
        grid = {**MISMATCH_GRID, "starts": n}
        make_fake_grid(
            tmp_path / str(n), experiment="engine_mismatch", **grid, n_collapse=lambda a, *_: 6 * (a == "grpo+r2")
        )
        claims[n] = C.judge_paired(engine_claim.R3_VS_R2, tmp_path / str(n))
    assert (claims[6].verdict, claims[2].verdict) == (C.REPRODUCED, C.INCONCLUSIVE)
    assert claims[2].reason.startswith(
        "descriptive: 2 independent starts (an interval needs 5); by seed pairs it reads: reproduced ("
    )
    assert "[" not in claims[2].statistic and "[" in claims[6].statistic  # no seed-level interval
    assert all("collapsed r2 6 of 8 vs r3 0 of 8" in claims[n].statistic for n in (2, 6))


def test_a_verdict_that_changes_inside_the_grid_is_fragile() -> None:
    """Equal accuracy and reward: the verdict hangs on time to collapse. Under one grid definition grpo+none
    collapses first in all 12 pairs (reproduced), under another nobody collapses (not reproduced)."""
    grid = {"relative": 12, "absolute": 0, "relative:d0.5:p2": 12, "absolute:d0.5": 0}
    out = _pairs_frame(2, 6, acc_gain=0.0, collapse_w=grid)
    ext = C.Declared(
        "phase",
        "phase.yaml",
        {"primary": ["late_accuracy"]},
        [{"name": "more_seeds", "look": 2, "runs": {"seed": [3, 4, 5]}}],
    )
    c = C.judge_paired(phase_claims.OFFPOLICY_GRPO, Path("unused"), {"phase": ext}, runs=out)
    assert c.verdict == "fragile" and c.robustness == {
        "relative:d0.5:p2": "reproduced",
        "absolute:d0.5": "not reproduced",
    }
    assert "reproduced 50%, not reproduced 50%" in c.notes[0]
    looks = next(n for n in c.notes if n.startswith("declared in phase.yaml"))
    assert "more_seeds (look 2, 12 runs)" in looks and "counts 2 looks" in looks and "(12 declared runs" in looks
    assert "**fragile**" in c.plain and "after 1 look(s)" in c.plain
    assert "declares the primary outcomes ['late_accuracy']; this report computes" in " ".join(c.notes)
    kappa = next(n for n in c.notes if n.startswith("agreement"))
    # per cell: relative fires on the 6 grpo+none runs, absolute on none: 6 of 12 alike, kappa (1/2 - 1/2) / (1/2)
    assert "lr=0.001, N=8: 6 of 12 runs alike, kappa +0.00" in kappa
    # the same pairs from 2 cold starts: the grid describes, it decides nothing, not even "fragile"
    two = C.judge_paired(
        phase_claims.OFFPOLICY_GRPO, Path("unused"), {"phase": ext}, runs=out.assign(start=out["seed"] % 2)
    )
    assert two.verdict == "inconclusive" and two.robustness == dict.fromkeys(c.robustness, "inconclusive")
    assert two.reason == (
        f"descriptive: 2 independent starts (an interval needs 5); by seed pairs it reads: fragile ({c.reason})"
    )
    assert two.notes[0] == f"by seed pairs, descriptive: {c.notes[0]}"
    looks = next(n for n in two.notes if n.startswith("declared in phase.yaml")).split("(12 declared runs, one look): ")
    assert looks[1].startswith(
        "inconclusive (descriptive: 2 independent starts (an interval needs 5); by seed pairs it reads: reproduced "
        "(time to collapse favours the predicted arm (Holm p = "
    )


def test_declared_analyses_and_extensions(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(
        "experiment: base\nanalysis:\n  claims: [2]\n  primary: [late_accuracy]\n"
        "hydra:\n  sweeper:\n    params:\n      seed: 0,1\n"
    )
    (tmp_path / "more.yaml").write_text(
        "defaults:\n  - base\nanalysis:\n  extends: base\n  look: 2\nhydra:\n"
        "  sweeper:\n    params:\n      seed: 2,3\n      optim.lr: 0.0003\n"
        "      arm: grpo_r2\n"
    )
    d = C.declared_analyses(tmp_path)["base"]
    assert d.analysis["primary"] == ["late_accuracy"]
    assert d.extensions == [{"name": "more", "look": 2, "runs": {"seed": [2.0, 3.0], "lr": [3e-4], "arm": ["grpo+r2"]}}]
    runs = pd.DataFrame({"seed": [0, 2, 2, 3], "lr": [3e-4, 3e-4, 1e-4, 0.0003], "arm": ["grpo+r2"] * 4})
    assert C.extension_of(runs, d).tolist() == ["", "more", "", "more"]
    (tmp_path / "orphan.yaml").write_text("analysis:\n  extends: nothing\n  look: 2\n")
    with pytest.raises(ValueError, match="orphan.yaml extends 'nothing'"):
        C.declared_analyses(tmp_path)
    # the shipped experiment files: phase with its two extensions, added at looks 2 and 3
    phase = C.declared_analyses(PRESETS)["phase"]
    assert {e["name"]: e["look"] for e in phase.extensions} == {"phase_edge": 2, "phase_band": 3}
    edge = next(e for e in phase.extensions if e["name"] == "phase_edge")["runs"]
    assert edge == {"seed": [float(s) for s in range(8, 24)], "lr": [3e-4], "N": [8.0]}
    depth = C.declared_analyses(PRESETS)["drift_scaling"].extensions
    assert [(e["name"], e["look"], e["runs"]) for e in depth] == [
        ("drift_scaling_depth", 2, {"seed": [3.0, 4.0, 5.0, 6.0, 7.0]})
    ]


def test_no_data_is_inconclusive_never_a_crash(tmp_path: Path) -> None:
    claims = studies.claims(tmp_path / "nothing", PRESETS)
    assert [(c.verdict, c.reason) for c in claims] == [("inconclusive", "no data")] * 7 + [
        ("untestable here", "no runs of mechanism"),
        ("untestable here", "no runs of mechanism"),
    ] + [("inconclusive", "no data")] * 6
    (tmp_path / "drift_scaling").mkdir()
    (tmp_path / "drift_scaling" / "fit.json").write_text("{not json")
    first = studies.claims(tmp_path, PRESETS)[0]
    assert first.verdict == "inconclusive" and "unreadable" in first.reason


def test_moe_specific_needs_a_dense_control_that_holds_its_cold_start(tmp_path: Path) -> None:
    """The dense control beating the MoE model is not enough: one that also ends below its own cold start
    (here 40% -> 33%, against the MoE model's 40% -> 15%) says the degradation needs no routing. Where the
    MoE model does not degrade there is nothing to explain."""
    _dense_control(tmp_path / "less", lambda a, lr, N, L, s: 0.1, lambda a, lr, N, L, s: 0.32)
    c = C.judge_paired(mechanism_claims.MOE_SPECIFIC, tmp_path / "less")
    assert c.verdict == "not reproduced" and c.reason.startswith("dense vs MoE: reproduced")
    assert (
        "ends below its cold start: yes (p = 0.0156)" in c.reason
    )  # 16 of 16 runs below, from 6 starts: one sign per start, 1 / 2^6
    assert "qwen3_dense final - its cold start -6.7 pp" in c.statistic and "accuracy change +18.3 pp" in c.statistic
    _dense_control(tmp_path / "stable", lambda a, lr, N, L, s: 0.5, lambda a, lr, N, L, s: 0.5)
    c = C.judge_paired(mechanism_claims.MOE_SPECIFIC, tmp_path / "stable")
    assert (c.verdict, c.reason) == (
        "untestable here",
        "qwen3_moe ends below its cold start in no cell with paired runs",
    )


def test_moe_specific_per_cell_notes_separate_a_cell_where_the_dense_control_breaks_too(tmp_path: Path) -> None:
    """The MoE model degrades in all four cells; the dense control holds at lr 3e-4 and degrades alike at lr 1e-3.
    Pooled, the dense runs end below their cold start (not specific to MoE); each cell alone says where."""
    _dense_control(
        tmp_path,
        lambda a, lr, N, L, s: 0.2,
        lambda a, lr, N, L, s: 0.5 if lr < 5e-4 else 0.2,
        lrs=(3e-4, 1e-3),
        Ns=(2, 8),
    )
    c = C.judge_paired(mechanism_claims.MOE_SPECIFIC, tmp_path)
    assert c.verdict == "not reproduced" and c.cells.startswith("8 cell(s) where qwen3_moe degrades")
    cells = [n for n in c.notes if n.startswith("cell ")]
    assert [n.split(" alone:")[0] for n in cells] == [
        f"cell lr={lr}, N={n}" for lr in ("0.0003", "0.001") for n in (2, 8)
    ]
    assert [n.rsplit(": ", 1)[1] for n in cells] == ["reproduced"] * 2 + ["not reproduced"] * 2
    assert (
        "qwen3_dense 40.0% -> 48.3% (0 of 16 below the start, 0 collapsed); dense - MoE accuracy change +25.0 pp"
        in (cells[0])
    )
    lead = c.notes.index(next(n for n in c.notes if n.startswith("per cell, descriptive")))
    assert c.notes[lead + 1 : lead + 5] == cells  # the cells follow their lead, beside the pooled verdict


def test_claims_2_and_3_per_family_and_pooled_within_families(tmp_path: Path) -> None:
    """phase (qwen3_moe): GRPO without replay collapses in 6 of 8 seeds, R2 and GSPO never; phase_mixtral
    (mixtral): R2 collapses in 8 of 8, the others never. Claim 2's verdict stays phase's; the notes give
    mixtral alone and the pool, whose pairs stay within a family (8 + 8, not 8 x 2 x 2 cross-family joins)."""
    for experiment, family, k in (
        ("phase", "qwen3_moe", {"grpo+none": 6}),
        ("phase_mixtral", "mixtral", {"grpo+r2": 8}),
    ):
        make_fake_grid(
            tmp_path,
            experiment=experiment,
            family=family,
            Ns=(4,),
            lrs=(1e-3,),
            steps=STEPS,
            log_shift=False,
            n_collapse=lambda a, lr, N, L, k=k: k.get(a, 0),
            starts=STARTS,
        )
    claims = {c.id: c for c in studies.claims(tmp_path, tmp_path / "none", DECLARATIONS)}
    assert claims[2].verdict == "reproduced"
    alone = next(n for n in claims[2].notes if n.startswith("mixtral alone (phase_mixtral): "))
    pooled = next(n for n in claims[2].notes if n.startswith("qwen3_moe and mixtral pooled"))
    assert alone.startswith("mixtral alone (phase_mixtral): **not reproduced**") and "(8 pairs)" in alone
    assert "(16 pairs)" in pooled and "family=mixtral" not in claims[2].cells
    assert any(n.startswith("mixtral alone (phase_mixtral): ") for n in claims[3].notes)


def test_fit_rules_at_their_edges(tmp_path: Path) -> None:
    cases = [
        ((0.01, 0.05), 0.9, "reproduced"),
        ((0.21, 0.5), 0.9, "not reproduced"),
        ((0.06, 0.15), 0.4, "inconclusive"),
        ((0.01, 0.11), 0.9, "inconclusive"),
    ]  # 11x wide
    for ci, r2, verdict in cases:
        write_fake_fit(tmp_path, ci=ci, r2_holdout=r2)
        assert drift_claims.claim_expert_drift(tmp_path).verdict == verdict, (ci, r2)


def test_token_share_is_never_reported_above_one(tmp_path: Path) -> None:
    """A power law in L extrapolates the share of tokens with a changed layer past 100%; the claim then
    shows the per-layer rate under independent layers, and says why."""
    import json

    path = write_fake_fit(tmp_path)
    doc = json.loads(path.read_text())
    doc["metrics"]["route/old_vs_new/token_flip_rate/offpolicy"].update(predicted=1.173, ci=[1.031, 1.387])
    doc["token_flip_from_layer_rate"] = {"predicted": 0.88, "ci": [0.85, 0.92]}
    path.write_text(json.dumps(doc))
    notes = " ".join(drift_claims.claim_expert_drift(tmp_path).notes)
    assert "token_flip_rate: 88.0% [85.0%, 92.0%] from the per-layer rate" in notes
    assert "power law in L alone gives 117.3%" in notes


def test_reward_auc_by_hand() -> None:
    from moe_rl.analysis.phase import reward_auc

    # trapezoid over steps 0, 1, 3 of 0, 1, 1 = 0.5 + 2 = 2.5, over a span of 3
    assert reward_auc(np.array([0, 1, 3]), np.array([0.0, 1.0, 1.0])) == pytest.approx(2.5 / 3)
    assert reward_auc(np.array([3, 0, 1]), np.array([1.0, 0.0, 1.0])) == pytest.approx(2.5 / 3)  # unsorted input
    assert reward_auc(np.array([5]), np.array([0.4])) == 0.4


def test_claims_markdown_and_cli(tmp_path: Path) -> None:
    root = _world(tmp_path / "results", "reproduced")
    proc = subprocess.run(
        [sys.executable, "-m", "moe_rl.report", "--claims", str(root)],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    text = (root / "CLAIMS.md").read_text()
    assert text.count("**reproduced**") >= 6 and "| # | claim |" in text and "rule:" in text
    assert (
        "## In plain words" in text and "robustness over 150 collapse definitions" in text
    )  # 3 x 2 entropy rules x 5 fractions x (4 + 1)


# --- collapse definitions and the phase map -----------------------------------------------------------


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("grid")
    make_fake_grid(
        root,
        Ns=(1, 4),
        lrs=(1e-4, 1e-3),
        steps=STEPS,
        seeds=tuple(range(8)),
        n_collapse=lambda a, lr, N, L: {"grpo+none": 7, "grpo+r2": 1, "gspo+none": 0}[a] if N > 1 else 0,
    )
    return analysis.load_results(root / "phase" / "runs")


def test_post_hoc_absolute_reproduces_the_loop(grid) -> None:
    events = collapse_events(grid).set_index(["run", "definition"])
    info = analysis.runs(grid).set_index("run")
    for run, row in info.iterrows():
        assert events.loc[(run, "absolute"), "collapsed"] == (row["n_collapse_events"] > 0)
        if row["n_collapse_events"]:
            assert events.loc[(run, "absolute"), "step"] == row["first_collapse_step"]


def test_phase_table_and_tests(grid) -> None:
    out = run_outcomes(grid)
    assert len(out) == 3 * 2 * 2 * 8 and out["collapsed_relative"].sum() == 2 * 8
    table = phase_table(out).set_index(["lr", "N", "arm"])
    row = table.loc[(1e-3, 4, "grpo+none")]
    assert (row["k"], row["n"]) == (7, 8) and row["p_collapse"] == 7 / 8
    assert (row["p_lo"], row["p_hi"]) == pytest.approx(analysis.stats.wilson_interval(7, 8))
    assert row["final_accuracy_lo"] <= row["final_accuracy"] <= row["final_accuracy_hi"]
    tests = phase_tests(out)
    assert len(tests) == 2 * 2 * 2  # cells x non-reference arms
    n1 = tests[tests["N"] == 1]
    assert n1["p_value"].isna().all() and not n1["significant"].any()  # nothing collapsed: untestable
    t = tests.set_index(["lr", "N", "arm"]).loc[(1e-3, 4, "gspo+none")]
    p = analysis.stats.collapse_test(7, 8, 0, 8)
    assert t["p_value"] == pytest.approx(p) and t["p_holm"] == pytest.approx(min(1, 4 * p)) and t["significant"]
    text = format_phase_markdown(phase_table(out), tests)
    assert "untestable" in text and "7 of 8" in text and " *" in text


def test_phase_map_from_fewer_than_5_starts_is_descriptive(grid) -> None:
    """The same runs, each cell's 8 seeds from 2 cold starts: counts and means stay, intervals and tests go."""
    out = run_outcomes(grid)
    two = out.assign(start=out["seed"] % 2)
    row = phase_table(two).set_index(["lr", "N", "arm"]).loc[(1e-3, 4, "grpo+none")]
    assert (row["k"], row["n"], row["starts"]) == (7, 8, 2) and row["p_collapse"] == 7 / 8
    assert math.isnan(row["p_lo"]) and math.isnan(row["final_accuracy_lo"]) and math.isnan(row["reward_auc_hi"])
    tests = phase_tests(two)
    assert tests["descriptive"].all() and tests["p_value"].isna().all() and not tests["significant"].any()
    text = format_phase_markdown(phase_table(two), tests)
    assert "| 2 × 4 | 7 of 8 | 0.88 (descriptive) |" in text and "| descriptive |" in text and " *" not in text
    five = out.assign(start=out["seed"] % 5)  # 5 starts: decided again, the interval over starts
    row = phase_table(five).set_index(["lr", "N", "arm"]).loc[(1e-3, 4, "grpo+none")]
    assert row["starts"] == 5 and row["final_accuracy_lo"] <= row["final_accuracy"] <= row["final_accuracy_hi"]
    assert not phase_tests(five)["descriptive"].any()


def test_survival_curves_end_at_the_share_not_collapsed(grid) -> None:
    out = run_outcomes(grid)
    fig = analysis.plot_survival(out, definition="relative")
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.lines]
    assert len(panels) == 2  # the two off-policy cells where runs collapse (N = 4, lr 1e-4 and 1e-3)
    ends = {line.get_label(): line.get_ydata()[-1] for line in panels[0].lines}
    assert ends == {"grpo+none (7 of 8)": 1 / 8, "grpo+r2 (1 of 8)": 7 / 8, "gspo+none (0 of 8)": 1.0}
    with pytest.raises(ValueError, match="nothing to draw"):
        analysis.plot_survival(out[out["N"] == 1], definition="relative")


def test_collapse_definitions_markdown(grid) -> None:
    text = collapse_definitions_markdown({"fake": grid})
    assert "| grpo+none | 32 | 14 of 32 | 14 of 32 | 14 of 32 |" in text
    assert "reward_below_start" in text or "accuracy_below_start" in text


@pytest.mark.slow
def test_report_all_writes_every_page(tmp_path: Path) -> None:
    from fake_results import make_fake_results

    from moe_rl.report import main

    root = tmp_path / "results"
    make_fake_grid(
        root,
        Ns=(1, 4),
        lrs=(1e-4, 1e-3),
        seeds=(0, 1, 2),
        steps=25,
        n_collapse=lambda a, lr, N, L: 3 if a == "grpo+none" and N > 1 and lr > 5e-4 else 0,
    )
    make_fake_results(root / "stress", experiment="runs", seeds=(0, 1), steps=12)
    assert main(["--all", str(root)]) == 0
    for name in (
        "phase/summary.md",
        "phase/phase_map.png",
        "phase/phase_difference.png",
        "phase/phase_map.csv",
        "phase/phase_map_absolute.png",
        "phase/survival.png",
        "stress/summary.md",
        "collapse_definitions.md",
        "CLAIMS.md",
    ):
        assert (root / name).is_file(), name
    text = (root / "phase" / "summary.md").read_text()
    assert "## Phase map" in text and "Does anything depend on the definition?" in text
    assert "| 0.001 | 4 | grpo+none | 1 × 3 | 3 of 3 | 1.00 (descriptive) |" in text  # one cold start: no interval
    assert "grpo+none" in (root / "collapse_definitions.md").read_text()
    claims = (root / "CLAIMS.md").read_text()
    assert "no data" in claims  # no drift_scaling / phase_mismatch folders here


def test_claim_5_is_decided_by_the_engine_runs_and_reports_the_emulated_ones_and_the_gap(tmp_path) -> None:
    """engine_mismatch (R3 better) decides; phase_mismatch (R2 better) is a note; the measured gap is a note."""
    runs = make_fake_grid(
        tmp_path,
        experiment="engine_mismatch",
        **MISMATCH_GRID,
        n_collapse=lambda a, lr, N, L: 6 if a == "grpo+r2" else 0,
    )
    make_fake_grid(
        tmp_path,
        experiment="phase_mismatch",
        **MISMATCH_GRID,
        n_collapse=lambda a, lr, N, L: 6 if a == "grpo+r3" else 0,
    )
    for i, run in enumerate(runs):  # logp gap 0.01 and 0.03 in alternate runs: mean 0.02
        frame = pd.read_parquet(run / "metrics.parquet")
        gap = frame[frame["key"] == frame["key"].iloc[0]].copy()
        gap["key"], gap["value"] = "rollout/logp_gap", 0.01 if i % 2 == 0 else 0.03
        pd.concat([frame, gap]).to_parquet(run / "metrics.parquet", index=False)
    claim = C.judge_paired(engine_claim.R3_VS_R2, tmp_path)
    assert (claim.verdict, claim.experiment) == (C.REPRODUCED, "engine_mismatch")
    assert "collapsed r2 6 of 8 vs r3 0 of 8" in claim.statistic
    emulated = next(n for n in claim.notes if n.startswith("emulated gap"))
    assert "not reproduced" in emulated and "collapsed r2 0 of 8 vs r3 6 of 8" in emulated
    gap = next(n for n in claim.notes if n.startswith("measured engine"))
    assert "logp_gap 0.02." in gap  # the only key logged here
    assert "94% of tokens" in gap


def test_claim_5_is_untestable_here_where_no_cell_degrades(tmp_path) -> None:
    """A stability claim needs cells where training breaks: runs that all end above their start decide nothing."""
    make_fake_grid(tmp_path, experiment="engine_mismatch", **MISMATCH_GRID, final_acc=lambda *_: 0.6)
    claim = C.judge_paired(engine_claim.R3_VS_R2, tmp_path)
    assert claim.verdict == C.UNTESTABLE_HERE
    assert claim.reason == "grpo+r2 and grpo+r3 end above their cold start's accuracy in every cell (lr=0.0001, N=8)"
    # one cell that degrades (both arms collapse in 6 of 8 seeds) is tested, the one that holds is not
    make_fake_grid(
        tmp_path / "mixed",
        experiment="engine_mismatch",
        **{**MISMATCH_GRID, "lrs": (1e-4, 1e-3)},
        n_collapse=lambda a, lr, N, L: 6 if lr == 1e-3 else 0,
        final_acc=lambda *_: 0.6,
    )
    claim = C.judge_paired(engine_claim.R3_VS_R2, tmp_path / "mixed")
    assert claim.verdict != C.UNTESTABLE_HERE and claim.cells == "1 cell(s): lr=0.001, N=8"


def test_claim_5_reads_final_accuracy_as_the_mean_of_the_last_3_evaluations() -> None:
    """One engine cell, 8 seed pairs, evaluations at steps 0-40. R2 dips and recovers at its last evaluation
    (0.4, 0.3, 0.1, 0.1, 0.25: last 0.25, mean of the last 3 0.15); R3 levels off (0.4, 0.3, 0.2, 0.2, 0.2: 0.20
    and 0.20); in seeds 6 and 7 both arms run R3's course (ties). By the last evaluation R2 ends 5 points ahead in
    6 pairs; by the claims' final accuracy R3 does: +5 points in 6 pairs, 0 in 2, from 6 starts (seed mod 6), each
    start ahead, sign-flip p = 1/64 with one sign per start; no run collapses, so the CMH test has no p and Holm
    leaves 1/64 alone: reproduced."""
    from moe_rl.analysis.accuracy import final_accuracy, late_accuracy, start_accuracy

    course = {"grpo+r2": (0.4, 0.3, 0.1, 0.1, 0.25), "grpo+r3": (0.4, 0.3, 0.2, 0.2, 0.2)}
    runs = [(arm, seed) for arm in course for seed in range(8)]
    evals = pd.DataFrame(
        [
            (f"{arm}_{seed}", 10 * i, "task/accuracy", v)
            for arm, seed in runs
            for i, v in enumerate(course["grpo+r3" if seed >= 6 else arm])
        ],
        columns=["run", "step", "key", "value"],
    )
    late, final = late_accuracy(evals), final_accuracy(evals)
    assert late["grpo+r2_0"] == pytest.approx(0.15) and final["grpo+r2_0"] == 0.25
    assert late["grpo+r3_0"] == pytest.approx(0.2) and final["grpo+r3_0"] == 0.2
    outcomes = pd.DataFrame(
        [
            {
                "run": f"{a}_{s}",
                "arm": a,
                "lr": 1e-3,
                "N": 8,
                "seed": s,
                "start": s % STARTS,
                "rollout_dtype": "bfloat16",
            }
            for a, s in runs
        ]
    )
    outcomes = outcomes.assign(
        start_accuracy=outcomes["run"].map(start_accuracy(evals)),
        late_accuracy=outcomes["run"].map(late),
        final_accuracy=outcomes["run"].map(final),
        collapsed_relative=False,
    )
    c = C.judge_paired(engine_claim.R3_VS_R2, Path("unused"), runs=outcomes)
    assert (c.verdict, c.cells) == (C.REPRODUCED, "1 cell(s): lr=0.001, N=8")
    assert c.p_value == pytest.approx(1 / 64) and c.reason == f"R3 better at Holm p = {1 / 64:.3g}"
    # 6 starts (seed mod 6): starts 0 and 1 hold a +5 pair and a tie (+2.5 each), starts 2-5 +5: mean 25/6, every
    # start ahead (P = 1), one sign per start
    assert "final accuracy r3 - r2 = +4.2 pp" in c.statistic and "(8 pairs, P(r3 > r2) = 1.00)" in c.statistic
    # the last evaluation alone would have read the other way: R2 ahead in the same 6 pairs
    by_last = C.judge_paired(
        engine_claim.R3_VS_R2, Path("unused"), runs=outcomes.assign(late_accuracy=outcomes["final_accuracy"])
    )
    assert by_last.verdict == C.NOT_REPRODUCED and by_last.reason.startswith("R2 better at Holm p = ")


def test_claim_5_counts_the_looks_of_a_cell_added_by_an_extension(tmp_path) -> None:
    """A cell added after looking at claim 5 (an extension at look 2) doubles its p-values (Bonferroni), and
    the note says what the declared runs alone give."""
    make_fake_grid(
        tmp_path,
        experiment="engine_mismatch",
        **{**MISMATCH_GRID, "lrs": (1e-3, 6.5e-4)},
        n_collapse=lambda a, lr, N, L: (6 if a == "grpo+r2" else 1) if lr == 6.5e-4 else 8,
        final_acc=lambda *_: 0.1,
    )
    declared = C.Declared(
        "engine_mismatch",
        "engine_mismatch.yaml",
        {"primary": ["late_accuracy", "collapse"]},
        [{"name": "engine_mismatch_gentle", "look": 2, "runs": {"lr": [6.5e-4]}}],
    )
    once, twice = (
        C.judge_paired(engine_claim.R3_VS_R2, tmp_path),
        C.judge_paired(engine_claim.R3_VS_R2, tmp_path, {"engine_mismatch": declared}),
    )
    assert once.cells == twice.cells == "2 cell(s): lr=0.00065, N=8; lr=0.001, N=8"
    assert 0 < once.p_value < 0.5 and twice.p_value == pytest.approx(2 * once.p_value)
    assert twice.test.endswith("(one-sided, Holm below, x 2 looks)") and "looks" not in once.test
    note = next(n for n in twice.notes if n.startswith("declared in engine_mismatch.yaml"))
    assert "engine_mismatch_gentle (look 2, 16 runs)" in note and "the verdict counts 2 looks (p x 2)" in note
    # the declared cell alone: both arms collapse in 8 of 8 seeds, so no difference
    assert "(16 declared runs, one look): inconclusive" in note


def _ladder(cold_seeds: int, seeds: int) -> pd.DataFrame:
    """Planted ladder runs of rungs aux1e-3 and moe, `cold_seeds` cold-start seeds x `seeds` seeds (no `start`:
    the cold-start seed names the start); moe (no aux loss) ends 10 points above aux1e-3 in every pair."""
    base = _pairs_frame(1, cold_seeds * seeds, acc_gain=0.1, collapse_w={"relative": 0}, arms=("aux1e-3", "moe"))
    return base.drop(columns="start").assign(
        rung=base["arm"],
        arm="grpo+none",
        cold_seed=base["seed"] // seeds,
        seed=base["seed"] % seeds,
        start_reward=0.1,
    )


def test_ladder_claims_pair_on_cold_seed_and_seed_and_find_a_planted_effect() -> None:
    """Claim 8 on planted ladder runs: 5 cold-start seeds x 2 seeds, the same seed under two cold starts is
    two pairs (folded into one pairing id); moe (no aux loss) ends 10 points above aux1e-3 in every pair:
    reproduced. Reversed: not reproduced."""
    base = _ladder(5, 2)
    folded = C.ladder_pairs(base, ("moe", "aux1e-3"))
    assert sorted(folded["seed"].unique()) == [0, 1, 1000, 1001, 2000, 2001, 3000, 3001, 4000, 4001]
    assert len(C.ladder_pairs(base, ("moe",))) == 10 and C.ladder_pairs(base.drop(columns="rung")).equals(
        base.drop(columns="rung")
    )
    c = C.judge_paired(mechanism_claims.AUX_HURTS, Path("unused"), runs=base)
    assert (c.id, c.verdict) == (8, "reproduced") and "(10 pairs)" in c.statistic
    assert not any(n.startswith(("per cell", "cell ")) for n in c.notes)  # one cell: nothing per cell
    flipped = base.assign(rung=base["rung"].map({"moe": "aux1e-3", "aux1e-3": "moe"}))
    assert C.judge_paired(mechanism_claims.AUX_HURTS, Path("unused"), runs=flipped).verdict == "not reproduced"
    frozen = C.judge_paired(mechanism_claims.FROZEN_ROUTER, Path("unused"), runs=base)
    assert (frozen.id, frozen.verdict) == (9, "inconclusive") and "router_frozen" in frozen.reason


def test_ladder_claims_from_two_cold_starts_are_descriptive() -> None:
    """The shipped ladder's design, 2 cold-start seeds x 4 seeds: 8 pairs, but two starts behind them. The
    seed-level reading (reproduced) stays in the reason; the verdict is inconclusive."""
    runs = _ladder(2, 4)
    c = C.judge_paired(mechanism_claims.AUX_HURTS, Path("unused"), runs=runs)
    # the same runs, as if each seed pair had a start of its own: the seed-level reading
    apart = runs.assign(start=runs["cold_seed"].astype(str) + "-" + runs["seed"].astype(str))
    apart = C.judge_paired(mechanism_claims.AUX_HURTS, Path("unused"), runs=apart)
    assert (apart.verdict, c.verdict) == ("reproduced", "inconclusive")
    assert c.statistic == paired.INTERVAL.sub("", apart.statistic) != apart.statistic
    assert c.reason == (
        f"descriptive: 2 independent starts (an interval needs 5); by seed pairs it reads: reproduced ({apart.reason})"
    )
