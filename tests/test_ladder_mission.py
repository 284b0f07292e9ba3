"""The mission's comparison per rung (`moe_rl.studies.ladder_mission`): the reference cell and a method's contrast,
by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from scipy import stats

from moe_rl.studies import ladder_mission
from moe_rl.studies.study_rule import StudyResult, routing_share_text


def _result() -> StudyResult:
    """Three starts of GRPO without replay (the third run not admitted), one R2 contrast read on two starts."""
    runs = pd.DataFrame(
        {
            "cell": ["grpo_none@edge"] * 3 + ["grpo_r2@edge"] * 2,
            "start": ["a", "b", "c", "a", "b"],
            "admitted": [True, True, False, True, True],
            "change": [-0.10, -0.30, 0.5, -0.1, -0.2],
            "collapsed": [1.0, 0.0, 1.0, 0.0, 0.0],
            "flip_acting": [0.04, 0.06, 0.9, 0.0, 0.0],
            "ratio_var_early": [0.1, 0.4, 9.0, 0.1, 0.1],
            "ratio_var": [0.2, 0.2, 9.0, 0.1, 0.1],
            "routing_share": [0.40, 0.50, 0.9, 0.1, 0.1],
        }
    )
    verdicts = pd.DataFrame(
        [{"contrast": "r2_minus_none", "claim": "2", "starts": 2, "estimate": 0.05, "lo": -0.05, "hi": 0.15}]
    ).assign(verdict="inconclusive")
    secondary = pd.DataFrame(
        [
            {"contrast": "r2_minus_none", "outcome": "collapsed", "estimate": -0.5, "lo": -1.0, "hi": 0.0}
            | {"first": "grpo_r2@edge", "second": "grpo_none@edge", "runs": 2, "k_first": 0, "k_second": 1},
            {"contrast": "r2_minus_none", "outcome": "flip_acting", "estimate": -0.05, "lo": -0.06, "hi": -0.04},
            {"contrast": "r2_minus_none", "outcome": "ratio_var_early", "estimate": 0.5, "lo": 0.25, "hi": 1.0},
        ]
    )
    empty = pd.DataFrame()
    return StudyResult(runs, empty, verdicts, empty, [], "", secondary=secondary)


def test_the_reference_cell_reads_its_admitted_starts_with_t_intervals_and_geometric_variances() -> None:
    """Starts a and b only: change -20.0 with half-width t(0.975, 1) x sd / sqrt(2); collapses 1 of 2 (50 pp);
    the early ratio variance's geometric mean sqrt(0.1 x 0.4) = 0.2, its interval exp(mean log +- half-width)."""
    cells = ladder_mission._cell_row(_result(), "grpo_none@edge")
    t = float(stats.t.isf(0.025, 1))
    half = 100 * t * pd.Series([-0.10, -0.30]).std() / 2**0.5
    assert cells[:2] == ["2", f"-20.0 [{-20.0 - half:+.1f}, {-20.0 + half:+.1f}]"]
    half = 100 * t * pd.Series([1.0, 0.0]).std() / 2**0.5
    assert cells[2] == f"+50.0 [{50.0 - half:+.1f}, {50.0 + half:+.1f}] pp (1 of 2)"
    logs = pd.Series([math.log(0.1), math.log(0.4)])
    half = t * logs.std() / 2**0.5
    assert cells[4] == f"0.200 [{math.exp(logs.mean() - half):.3f}, {math.exp(logs.mean() + half):.3f}]"
    assert cells[5] == "0.200"  # equal over starts: the mean alone
    admitted = _result().runs[_result().runs["admitted"]]
    assert routing_share_text(admitted, ["grpo_none@edge"]) == "routing's share of the ratio variance 45%"


def test_a_method_reads_its_verdict_and_paired_secondary_outcomes() -> None:
    cells = ladder_mission._contrast_row(_result(), "r2_minus_none")
    assert cells == [
        "2",
        "+5.0 [-5.0, +15.0], inconclusive (claim 2)",
        "-50.0 pp [-100.0, +0.0] (0 vs 1 of 2)",
        "-5.0 pp [-6.0, -4.0]",
        "0.50x [0.25, 1.00]",
        "—",  # not read
    ]


def test_a_rung_without_a_study_or_without_runs_says_so(tmp_path: Path) -> None:
    rows = ladder_mission.mission_rows(tmp_path, Path(__file__).parents[1] / "experiments" / "conf" / "preset")
    assert [r[3] for r in rows] == [
        "`offpolicy_edge` has no runs here",
        "`routing_dominant` has no runs here",
        ladder_mission.RUNGS[2].why_not,
    ]
    assert ladder_mission.RUNGS[2].why_not.startswith("no study: ")
