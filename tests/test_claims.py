"""Claims verdicts on synthetic result folders, one world per outcome; collapse definitions and the phase map."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fake_results import make_fake_grid, write_fake_fit

from moe_rl import analysis
from moe_rl.analysis import claims as C
from moe_rl.analysis.collapse import collapse_definitions_markdown, collapse_events
from moe_rl.analysis.phase import format_phase_markdown, phase_table, phase_tests, run_outcomes

REPO = Path(__file__).resolve().parents[1]
STEPS = 30


def _world(root: Path, kind: str) -> Path:
    """Result folders in which every claim should come out `kind`."""
    if kind == "reproduced":
        write_fake_fit(root, predicted=0.1, ci=(0.06, 0.15), r2_holdout=0.9)
        phase = {"grpo+none": 6, "grpo+r2": 0, "gspo+none": 0}
        make_fake_grid(root, Ns=(1, 4), lrs=(1e-3,), steps=STEPS, shift_lag=2,
                       n_collapse=lambda a, lr, N, L: phase[a] if N > 1 else 0)
        make_fake_grid(root, experiment="drift_scaling", arms=("grpo+none",), lrs=(1e-4,), Ns=(4,), layers=(2, 8),
                       seeds=tuple(range(6)), steps=STEPS, log_shift=False,
                       flip=lambda a, lr, N, L, s: 0.002 * L * (1 + 0.05 * s))
        make_fake_grid(root, experiment="engine_mismatch", arms=("grpo+r2", "grpo+r3"), lrs=(1e-4,), Ns=(8,),
                       steps=STEPS, rollout_dtype="bfloat16", log_shift=False,
                       n_collapse=lambda a, lr, N, L: 6 if a == "grpo+r2" else 0)
    elif kind == "not reproduced":
        write_fake_fit(root, predicted=0.005, ci=(0.002, 0.01), r2_holdout=0.9)
        # N=2: GRPO+R2 collapses, GRPO without replay does not; N=4: GSPO collapses where GRPO+R2 does not
        phase = {(2, "grpo+none"): 0, (2, "grpo+r2"): 8, (2, "gspo+none"): 0,
                 (4, "grpo+none"): 1, (4, "grpo+r2"): 0, (4, "gspo+none"): 8}
        make_fake_grid(root, Ns=(2, 4), lrs=(1e-3,), steps=STEPS, shift_lag=-2,
                       n_collapse=lambda a, lr, N, L: phase[N, a])
        make_fake_grid(root, experiment="drift_scaling", arms=("grpo+none",), lrs=(1e-4,), Ns=(4,), layers=(2, 8),
                       seeds=tuple(range(6)), steps=STEPS, log_shift=False,
                       flip=lambda a, lr, N, L, s: 0.02 / L * (1 + 0.05 * s))
        make_fake_grid(root, experiment="engine_mismatch", arms=("grpo+r2", "grpo+r3"), lrs=(1e-4,), Ns=(8,),
                       steps=STEPS, rollout_dtype="bfloat16", log_shift=False,
                       n_collapse=lambda a, lr, N, L: 6 if a == "grpo+r3" else 0)
    elif kind == "inconclusive":
        write_fake_fit(root, predicted=0.03, ci=(0.001, 0.5), r2_holdout=0.9)
        phase = {"grpo+none": 2, "grpo+r2": 1, "gspo+none": 1}
        make_fake_grid(root, Ns=(4,), lrs=(1e-3,), steps=STEPS, shift_lag=None,  # shift unrelated to clipping
                       n_collapse=lambda a, lr, N, L: phase[a])
        make_fake_grid(root, experiment="drift_scaling", arms=("grpo+none",), lrs=(1e-4,), Ns=(4,), layers=(2, 8),
                       seeds=(0, 1, 2), steps=STEPS, log_shift=False,
                       flip=lambda a, lr, N, L, s: 0.02 + (0.015 * (-1) ** s if L == 8 else 0.0))
        make_fake_grid(root, experiment="engine_mismatch", arms=("grpo+r2", "grpo+r3"), lrs=(1e-4,), Ns=(8,),
                       seeds=(0, 1, 2), steps=STEPS, rollout_dtype="bfloat16", log_shift=False,
                       n_collapse=lambda a, lr, N, L: 1 if a == "grpo+r2" else 0,
                       final_acc=lambda a, lr, N, L, s: 0.45 + (0.1 * (-1) ** s if a == "grpo+r3" else 0.0))
    return root


@pytest.fixture(scope="module", params=["reproduced", "not reproduced", "inconclusive"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[C.Claim]]:
    root = _world(tmp_path_factory.mktemp(request.param.replace(" ", "_")), request.param)
    return request.param, C.evaluate_claims(root)


def test_every_claim_gets_the_expected_verdict(world: tuple[str, list[C.Claim]]) -> None:
    kind, claims = world
    got = {c.id: (c.verdict, c.reason) for c in claims}
    assert [c.id for c in claims] == [1, 2, 3, 4, 5, 6]
    expected = {i: kind for i in got}
    assert {i: v for i, (v, _) in got.items()} == expected, got
    assert all("failed" not in r for _, r in got.values())


@pytest.mark.parametrize("world", ["reproduced"], indirect=True)
def test_depth_claim_reports_the_token_share_on_the_same_pairs(world: tuple[str, list[C.Claim]]) -> None:
    _, claims = world
    # per-layer flip 0.002 L (1 + 0.05 s): tokens 1 - (1 - f)^L, seed means over s = 0..5
    f = {L: 0.002 * L * (1 + 0.05 * np.arange(6)) for L in (2, 8)}
    diff = 100 * np.mean((1 - (1 - f[8]) ** 8) - (1 - (1 - f[2]) ** 2))
    note = next(n for n in claims[3].notes if n.startswith("support: tokens"))
    assert "(8 layers) vs " in note and f": {diff:+.1f} pp [" in note and "6 pairs, one-sided p = 0.0156" in note


def _outcomes(cells: dict) -> pd.DataFrame:
    rows = []
    for (lr, N), arms in cells.items():
        for arm, (k, n) in arms.items():
            rows += [{"arm": arm, "lr": lr, "N": N, "seed": i, "collapsed_relative": i < k, "collapsed_absolute": i < k}
                     for i in range(n)]
    return pd.DataFrame(rows)


def test_cells_at_the_floor_or_ceiling_do_not_dilute_the_effect_interval() -> None:
    """One cell where outcomes vary (20/24 vs 23/24) next to cells where every run of both arms is stable
    or collapsed: the effect interval is that cell's alone, too wide to call equivalence (inconclusive),
    whereas averaging in the five exact zeros would have shrunk it inside the margin."""
    edge = {"grpo+none": (20, 24), "grpo+r2": (23, 24), "gspo+none": (20, 24)}
    cells = {(3e-4, 8): edge}
    for lr, N in [(1e-4, 2), (1e-4, 8), (3e-4, 2)]:
        cells[lr, N] = {arm: (0, 8) for arm in edge}
    for lr, N in [(1e-3, 2), (1e-3, 8)]:
        cells[lr, N] = {arm: (8, 8) for arm in edge}
    out = _outcomes(cells)
    c2 = C.claim_offpolicy_grpo(Path("unused"), outcomes=out)
    assert c2.verdict == "inconclusive" and "over the 1 cell(s) where outcomes vary -0.12 [" in c2.statistic
    c3 = C.claim_gspo_stable(Path("unused"), outcomes=out)
    assert c3.verdict == "inconclusive", c3.reason
    # with every cell informative and equal rates, equivalence is still reachable
    same = _outcomes({(lr, 8): {"grpo+none": (100, 200), "grpo+r2": (100, 200)} for lr in (1e-4, 3e-4, 1e-3)})
    assert C.claim_offpolicy_grpo(Path("unused"), outcomes=same).verdict == "not reproduced"


def test_no_data_is_inconclusive_never_a_crash(tmp_path: Path) -> None:
    claims = C.evaluate_claims(tmp_path / "nothing")
    assert [(c.verdict, c.reason) for c in claims] == [("inconclusive", "no data")] * 6
    (tmp_path / "drift_scaling").mkdir()
    (tmp_path / "drift_scaling" / "fit.json").write_text("{not json")
    first = C.evaluate_claims(tmp_path)[0]
    assert first.verdict == "inconclusive" and "unreadable" in first.reason


def test_fit_rules_at_their_edges(tmp_path: Path) -> None:
    cases = [((0.01, 0.05), 0.9, "reproduced"), ((0.21, 0.5), 0.9, "not reproduced"),
             ((0.06, 0.15), 0.4, "inconclusive"), ((0.01, 0.11), 0.9, "inconclusive")]  # 11x wide
    for ci, r2, verdict in cases:
        write_fake_fit(tmp_path, ci=ci, r2_holdout=r2)
        assert C.claim_expert_drift(tmp_path).verdict == verdict, (ci, r2)


def test_token_share_is_never_reported_above_one(tmp_path: Path) -> None:
    """A power law in L extrapolates the share of tokens with a changed layer past 100%; the claim then
    shows the per-layer rate under independent layers, and says why."""
    import json

    path = write_fake_fit(tmp_path)
    doc = json.loads(path.read_text())
    doc["metrics"]["route/old_vs_new/token_flip_rate/offpolicy"].update(predicted=1.173, ci=[1.031, 1.387])
    doc["token_flip_from_layer_rate"] = {"predicted": 0.88, "ci": [0.85, 0.92]}
    path.write_text(json.dumps(doc))
    notes = " ".join(C.claim_expert_drift(tmp_path).notes)
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
    proc = subprocess.run([sys.executable, "-m", "moe_rl.report", "--claims", str(root)], check=False,
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = (root / "CLAIMS.md").read_text()
    assert text.count("**reproduced**") >= 6 and "| # | claim |" in text and "rule:" in text
    assert "same verdict" in text  # the collapse claims are checked under the alternative definition


def test_lead_contrast_sign() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for run in range(6):
        x = rng.normal(size=80)
        y = np.roll(x, 2) + 0.5 * rng.normal(size=80)
        rows.append(analysis.stats.lagged_xcorr(x, y, 4).assign(run=run))
    import pandas as pd

    res = C.lead_contrast(pd.concat(rows))
    assert res["peak_lag"] == 2 and res["lo"] > 0.5
    back = C.lead_contrast(pd.concat(rows).assign(lag=lambda f: -f["lag"]))
    assert back["peak_lag"] == -2 and back["hi"] < 0


# --- collapse definitions and the phase map -----------------------------------------------------------

@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("grid")
    make_fake_grid(root, Ns=(1, 4), lrs=(1e-4, 1e-3), steps=STEPS, seeds=tuple(range(8)),
                   n_collapse=lambda a, lr, N, L: {"grpo+none": 7, "grpo+r2": 1, "gspo+none": 0}[a] if N > 1 else 0)
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


def test_collapse_definitions_markdown(grid) -> None:
    text = collapse_definitions_markdown({"fake": grid})
    assert "| grpo+none | 32 | 14 of 32 | 14 of 32 | 14 of 32 |" in text
    assert "reward_below_start" in text or "accuracy_below_start" in text


@pytest.mark.slow
def test_report_all_writes_every_page(tmp_path: Path) -> None:
    from fake_results import make_fake_results

    from moe_rl.report import main

    root = tmp_path / "results"
    make_fake_grid(root, Ns=(1, 4), lrs=(1e-4, 1e-3), seeds=(0, 1, 2), steps=25,
                   n_collapse=lambda a, lr, N, L: 3 if a == "grpo+none" and N > 1 and lr > 5e-4 else 0)
    make_fake_results(root / "stress", experiment="runs", seeds=(0, 1), steps=12)
    assert main(["--all", str(root)]) == 0
    for name in ("phase/summary.md", "phase/phase_map.png", "phase/phase_difference.png", "phase/phase_map.csv",
                 "phase/phase_map_absolute.png", "stress/summary.md", "collapse_definitions.md", "CLAIMS.md"):
        assert (root / name).is_file(), name
    text = (root / "phase" / "summary.md").read_text()
    assert "## Phase map" in text and "Does anything depend on the definition?" in text
    assert "| 0.001 | 4 | grpo+none | 3 | 3 of 3 |" in text
    assert "grpo+none" in (root / "collapse_definitions.md").read_text()
    claims = (root / "CLAIMS.md").read_text()
    assert "no data" in claims  # no drift_scaling / phase_mismatch folders here


def test_claim_5_is_decided_by_the_engine_runs_and_reports_the_emulated_ones_and_the_gap(tmp_path) -> None:
    """engine_mismatch (R3 better) decides; phase_mismatch (R2 better) is a note; the measured gap is a note."""
    runs = make_fake_grid(tmp_path, experiment="engine_mismatch", arms=("grpo+r2", "grpo+r3"), lrs=(1e-4,), Ns=(8,),
                          steps=STEPS, rollout_dtype="bfloat16", log_shift=False,
                          n_collapse=lambda a, lr, N, L: 6 if a == "grpo+r2" else 0)
    make_fake_grid(tmp_path, experiment="phase_mismatch", arms=("grpo+r2", "grpo+r3"), lrs=(1e-4,), Ns=(8,),
                   steps=STEPS, rollout_dtype="bfloat16", log_shift=False,
                   n_collapse=lambda a, lr, N, L: 6 if a == "grpo+r3" else 0)
    for i, run in enumerate(runs):  # logp gap 0.01 and 0.03 in alternate runs: mean 0.02
        frame = pd.read_parquet(run / "metrics.parquet")
        gap = frame[frame["key"] == frame["key"].iloc[0]].copy()
        gap["key"], gap["value"] = "rollout/logp_gap", 0.01 if i % 2 == 0 else 0.03
        pd.concat([frame, gap]).to_parquet(run / "metrics.parquet", index=False)
    claim = C.claim_r3_vs_r2(tmp_path)
    assert (claim.verdict, claim.experiment) == (C.REPRODUCED, "engine_mismatch")
    assert "collapsed r2 6 of 8 vs r3 0 of 8" in claim.statistic
    emulated = next(n for n in claim.notes if n.startswith("emulated gap"))
    assert "not reproduced" in emulated and "collapsed r2 0 of 8 vs r3 6 of 8" in emulated
    gap = next(n for n in claim.notes if n.startswith("measured engine"))
    assert "logp_gap 0.02." in gap  # the only key logged here
    assert "94% of tokens" in gap
