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
from moe_rl.analysis.collapse_definitions import collapse_definitions_markdown, collapse_events
from moe_rl.analysis.phase import format_phase_markdown, phase_table, phase_tests, run_outcomes
from moe_rl.studies import drift_claims, shift_claim

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
    """Claims 1 and 6 carry statistics of their own and read the planted folders; every other claim is a declared
    study's contrast (its rule is tested in test_study.py and the studies' own tests), and the planted folders hold
    no cell a declaration names: each reads as its statement alone, inconclusive with no data, never a failure."""
    kind, claims = world
    got = {c.id: (c.verdict, c.reason) for c in claims}
    assert [c.id for c in claims] == list(range(1, 16))
    expected = {1: kind, 6: kind}
    if kind == "not reproduced":  # the clip fraction leads there, but the forward excess's interval (few planted
        # runs) reaches past the 1% margin: the one rule cannot call it not reproduced, and says why
        expected[6] = "inconclusive"
        assert "the clip fraction leads the shift more than the shift leads it" in got[6][1]
    if kind == "inconclusive":  # no lead planted: the forward excess's interval reaches far below 0, its upper end
        # under the 1% margin, so the one-sided rule excludes the claimed lead
        expected[6] = "not reproduced"
        assert "an effect of +0.01 in the claimed direction excluded" in got[6][1]
    declared = {i: ("inconclusive", "no data") for i in got if i not in expected}
    assert {i: got[i][0] for i in expected} == expected, got
    assert {i: got[i] for i in declared} == declared


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


def test_no_data_is_inconclusive_never_a_crash(tmp_path: Path) -> None:
    claims = studies.claims(tmp_path / "nothing", PRESETS)
    assert [(c.verdict, c.reason) for c in claims] == [("inconclusive", "no data")] * 15
    (tmp_path / "drift_scaling").mkdir()
    (tmp_path / "drift_scaling" / "fit.json").write_text("{not json")
    first = studies.claims(tmp_path, PRESETS)[0]
    assert first.verdict == "inconclusive" and "unreadable" in first.reason


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
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ") and " | **" in line}
    assert [k for k, line in rows.items() if "| **reproduced** |" in line] == ["| 1", "| 6"]  # their own statistics
    assert "| # | claim |" in text and "rule:" in text
    assert (
        "## In plain words" in text and "the grid of 150 collapse definitions" in text
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


def test_the_claims_page_writes_its_table_as_data_and_the_readme_table_reads_it(tmp_path) -> None:
    """`write_claims_page` writes claims.csv beside CLAIMS.md (one row per claim, every field as text); README.md's
    claim table is built from it alone: the claim, its verdict, the model it was read on ("—" where none) and what
    the runs show, a pipe in a field escaped, and its reading on the routing-dominant rung ("—" where none; the row's
    verdict alone in bold)."""
    from moe_rl.analysis.pages import read_claims, readme_claims_table, write_claims_page

    assert read_claims(tmp_path) is None and readme_claims_table(tmp_path) is None
    decided = C.Claim(
        id=2,
        claim="R2 | stabilises",
        source="s",
        rule="r",
        experiment="edge",
        cells="r2_minus_none: 24 starts",
        statistic="-1.8 pp [-7.0, +3.4]",
        verdict=C.NOT_REPRODUCED,
        reason="an effect of +0.05 excluded",
        read_on="qwen3_moe E=8 k=2 L=2",
        divergence="0.99 [0.92, 1.08]",
        on_rung="inconclusive: -2.2 pp [-10.7, +6.4], 24 starts, look 3 (wide: r2_minus_none); pool limit reached",
    )
    stated = C.Claim(id=9, claim="Freezing the router stabilises GRPO", source="s", rule="r")
    write_claims_page(tmp_path, [decided, stated], [], ())
    table = read_claims(tmp_path)
    assert table is not None and list(table["id"]) == ["2", "9"] and table.loc[1, "read_on"] == ""
    assert readme_claims_table(tmp_path) == (
        "| # | claim | verdict | read on | what the runs show | on the routing-dominant rung |\n"
        "|---:|:---|:---|:---|:---|:---|\n"
        "| 2 | R2 \\| stabilises | **not reproduced** | qwen3_moe E=8 k=2 L=2 | -1.8 pp [-7.0, +3.4] (edge: "
        "r2_minus_none: 24 starts); divergence ratio 0.99 [0.92, 1.08]; an effect of +0.05 excluded | "
        "inconclusive: -2.2 pp [-10.7, +6.4], 24 starts, look 3 (wide: r2_minus_none); pool limit reached |\n"
        "| 9 | Freezing the router stabilises GRPO | **inconclusive** | — | no statistic; no data | — |\n"
    )
