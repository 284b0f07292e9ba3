"""The stability frontier: the declared rule at a point, bisection, edges and their bootstrap, claims 10 and 11."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from helpers import PRESETS

from moe_rl.studies import frontier as fr_

AXIS = fr_.Axis("N", {"lr": 3e-4}, (1.0, 2.0, 4.0, 8.0, 16.0, 32.0), 8.0)
FR = fr_.Frontier(rows=(("qwen3_moe", "grpo_none"),), axes=(AXIS,), seeds=(0, 1, 2, 3), edge_seeds=tuple(range(8)))


def planted(row: tuple[str, str], changes: dict[float, list[float]], collapsed: dict[float, list[bool]] | None = None):
    """Runs of one row on the N axis: per N, one run per listed accuracy change (seeds 0, 1, ...)."""
    rows = []
    for n, values in changes.items():
        for seed, change in enumerate(values):
            down = (collapsed or {}).get(n, [False] * len(values))[seed]
            rows.append(
                {"run": f"arm={row[1]},n={n},seed={seed}", "family": row[0], "arm_file": row[1], "arm": row[1],
                 "lr": 3e-4, "N": int(n), "seed": seed, "change": change, "collapsed": down, "reward_auc": 0.1,
                 "token_ratio_var": 0.01 * n, "status": "completed", "start": f"start{seed}"}
            )  # fmt: skip
    cols = [
        "run",
        "family",
        "arm_file",
        "arm",
        "lr",
        "N",
        "seed",
        "change",
        "collapsed",
        "reward_auc",
        "token_ratio_var",
    ]
    return pd.DataFrame(rows, columns=[*cols, "status", "start"])  # each seed its own cold start


def test_rule_at_a_point_is_the_declared_one():
    assert fr_.is_stable(np.array([-0.05, -0.05]), np.array([False, False]))  # mean change exactly -5 pp: stable
    assert not fr_.is_stable(np.array([-0.04, -0.07]), np.array([False, False]))  # mean -5.5 pp
    assert fr_.is_stable(np.zeros(4), np.array([True, False, False, False]))  # a quarter collapsed
    assert not fr_.is_stable(np.zeros(4), np.array([True, True, False, False]))


def test_bisection_starts_at_start_fills_partial_points_then_halves():
    row = FR.rows[0]
    assert fr_.next_probe(AXIS, fr_.points(fr_.on_axis(planted(row, {}), AXIS, row)), FR) == (3, (0, 1, 2, 3))
    partial = planted(row, {8: [0.0, 0.0]})
    assert fr_.next_probe(AXIS, fr_.points(fr_.on_axis(partial, AXIS, row)), FR) == (3, (2, 3))
    unstable_at_8 = planted(row, {8: [-0.2] * 4})  # lo = -1, hi = 3: the middle of (-1, 3) is index 1 (N = 2)
    assert fr_.next_probe(AXIS, fr_.points(fr_.on_axis(unstable_at_8, AXIS, row)), FR) == (1, (0, 1, 2, 3))
    stable_at_8 = planted(row, {8: [0.0] * 4})  # lo = 3, hi = 6 (past the grid): index 4 (N = 16)
    assert fr_.next_probe(AXIS, fr_.points(fr_.on_axis(stable_at_8, AXIS, row)), FR)[0] == 4


def test_a_bracket_takes_every_edge_seed_at_both_points_then_is_located():
    row = FR.rows[0]
    runs = planted(row, {2: [0.0] * 4, 4: [-0.2] * 4, 8: [-0.3] * 4})
    assert fr_.next_probe(AXIS, fr_.points(fr_.on_axis(runs, AXIS, row)), FR) == (1, (4, 5, 6, 7))
    runs = planted(row, {2: [0.0] * 8, 4: [-0.2] * 4, 8: [-0.3] * 4})
    assert fr_.next_probe(AXIS, fr_.points(fr_.on_axis(runs, AXIS, row)), FR) == (2, (4, 5, 6, 7))
    runs = planted(row, {2: [0.0] * 8, 4: [-0.2] * 8, 8: [-0.3] * 4})
    assert fr_.next_probe(AXIS, fr_.points(fr_.on_axis(runs, AXIS, row)), FR) is None
    below = planted(row, {1: [-0.2] * 8, 8: [-0.3] * 4})  # unstable at the grid's first point: below the grid
    assert fr_.next_probe(AXIS, fr_.points(fr_.on_axis(below, AXIS, row)), FR) is None
    assert fr_.edge_index(fr_.on_axis(below, AXIS, row), 6) == -1


def test_edge_bootstrap_resamples_seeds_within_points():
    row = FR.rows[0]
    sure = fr_.on_axis(planted(row, {2: [0.0] * 8, 4: [-0.2] * 8}), AXIS, row)
    assert set(fr_.edge_draws(sure, 6, draws=200)) == {1}  # no spread: every draw keeps the edge at N = 2
    # at N = 4 one seed in eight loses 45 pp, the rest hold: mean -5.6 pp, unstable; draws without it are stable
    split = fr_.on_axis(planted(row, {2: [0.0] * 8, 4: [0.0] * 7 + [-0.45], 8: [-0.3] * 8}), AXIS, row)
    assert fr_.edge_index(split, 6) == 1
    draws = fr_.edge_draws(split, 6, draws=4000, seed=1)
    assert set(draws) == {1, 2}
    # P(the resampled N = 4 point holds no copy of the bad seed) = (7/8)^8 = 0.344; with one copy the mean is
    # -5.6 pp (unstable); so P(edge at N = 4) = 0.344, within 3 standard errors of 4000 draws
    assert abs(np.mean(draws == 2) - (7 / 8) ** 8) < 3 * np.sqrt(0.344 * 0.656 / 4000)


def test_edge_ratio_and_values():
    assert fr_.edge_value(AXIS, -1) == 0.5 and fr_.edge_value(AXIS, 6) == 64.0 and fr_.edge_value(AXIS, 2) == 4.0
    a = fr_.Edge(("m", "a"), AXIS, 3, True, np.array([3, 3, 4]), pd.DataFrame())
    b = fr_.Edge(("m", "b"), AXIS, 1, True, np.array([1, 1, 1]), pd.DataFrame())
    ratio, lo, hi = fr_.edge_ratio(a, b)
    assert (
        ratio == 4.0 and lo == pytest.approx(4.0) and hi == pytest.approx(4 + 4 * 0.95)
    )  # numpy linear percentile of (4, 4, 8)
    assert fr_.share_above(a, b, 2) == 1.0 and fr_.share_above(a, b, 3) == pytest.approx(1 / 3)


def test_jobs_merge_the_shared_point_and_rows_first_come_first():
    lr_axis = fr_.Axis("lr", {"N": 8}, (1e-4, 3e-4, 1e-3), 3e-4)
    n_axis = fr_.Axis("N", {"lr": 3e-4}, (2.0, 8.0, 32.0), 8.0, rows_first=("b",))
    fr = fr_.Frontier((("qwen3_moe", "a"), ("qwen3_moe", "b")), (lr_axis, n_axis), (0, 1), (0, 1, 2))
    jobs = fr_.next_jobs(planted(("qwen3_moe", "a"), {}).iloc[:0], fr)
    edge_jobs = [(j["arm"], j["lr"], j["N"]) for j in jobs if j["axis"] != "price"]
    assert edge_jobs == [("b", 3e-4, 8), ("a", 3e-4, 8)]  # one job per point
    lr_first = fr_.Axis("lr", {"N": 8}, (1e-4, 3e-4, 1e-3), 3e-4, rows_first=("b", "qwen3_dense:a"))
    assert fr_.first_rows(lr_first) == [("qwen3_moe", "b"), ("qwen3_dense", "a")]
    assert [(j["arm"], j["lr"], j["N"], j["seeds"]) for j in jobs if j["axis"] == "price"] == [
        ("a", 1e-4, 8, (0, 1)),
        ("b", 1e-4, 8, (0, 1)),
    ]


def test_preset_declares_a_valid_frontier():
    fr = fr_.load_frontier(PRESETS)
    assert fr_.REFERENCE in fr.rows and len(set(fr.rows)) == len(fr.rows)
    assert ("qwen3_moe", "grpo_r3_threshold") not in fr.rows  # the same computation as r2_threshold: listed once
    assert set(fr.seeds) < set(fr.edge_seeds) and len(fr.seeds) >= 4 and len(fr.edge_seeds) >= 8
    assert fr_.arm_file("arm=vespo_none,optim.lr=0.0003,optim.updates_per_rollout=8,seed=0") == "vespo_none"


def _edges(draws: dict[tuple[str, str], list[int]]) -> dict:
    return {(row, "N"): fr_.Edge(row, AXIS, d[0], True, np.array(d), pd.DataFrame()) for row, d in draws.items()}


def test_the_frontier_section_gives_edges_brackets_and_a_figure():
    import matplotlib

    matplotlib.use("Agg")
    from moe_rl.studies.frontier_report import frontier_section

    other = ("qwen3_moe", "vespo_none")
    fr = fr_.Frontier((fr_.REFERENCE, other), (AXIS,), (0, 1, 2, 3), tuple(range(8)))
    runs = pd.concat(
        [planted(fr_.REFERENCE, {2: [0.0] * 8, 4: [-0.2] * 8}), planted(other, {8: [0.0] * 8, 16: [-0.3] * 8})]
    )
    table, text, fig, interp = frontier_section(runs, fr)
    rows = table.set_index("arm_file")
    assert rows.loc["grpo_none", "N_edge"] == "2 (< 4)" and rows.loc["vespo_none", "N_edge"] == "8 (< 16)"
    assert rows.loc["vespo_none", "N_headroom"] == 4.0  # 8 / 2, every draw the same
    assert "| vespo_none | 8 (< 16) | [8, 8] | 4x [4, 4] | 16 |" in text and "2 of 2 edges located" in text
    assert len(fig.axes) == 1
    one = runs.assign(start="bench")  # every run from one cold start: the edges' intervals are descriptive
    _, text, _, interp = frontier_section(one, fr)
    assert "| vespo_none | 8 (< 16) | (1 start) | 4x | 16 |" in text
    # interpolated: -5 pp a quarter of the way (0.05 / 0.2) from N = 2 to 4 in log N, a sixth (0.05 / 0.3) from 8 to 16
    edges = interp.set_index("arm_file")["edge"]
    assert edges["grpo_none"] == pytest.approx(2**1.25) and edges["vespo_none"] == pytest.approx(8 * 2 ** (1 / 6))
    assert f"| vespo_none | {8 * 2 ** (1 / 6):.3g} (1 start) |" in text
    _, text, _, _ = frontier_section(one[one["N"] >= 4], fr)  # grpo+none probed at N = 4 only, below -5 pp there
    assert "| grpo_none | < 4 (1 start) |" in text


def test_the_claims_page_reads_the_frontier_table_back(tmp_path, monkeypatch):
    from moe_rl.studies import frontier_report as fr_report

    assert fr_report.claims_section(tmp_path, PRESETS) == []
    other = ("qwen3_moe", "vespo_none")
    fr = fr_.Frontier((fr_.REFERENCE, other), (AXIS,), (0, 1, 2, 3), tuple(range(8)))
    runs = pd.concat([planted(fr_.REFERENCE, {2: [0.0] * 8, 4: [-0.2] * 8}), planted(other, {8: [0.0] * 4})])
    (tmp_path / "frontier").mkdir()
    fr_report.frontier_table(runs, fr).to_csv(tmp_path / "frontier" / "frontier.csv", index=False)
    monkeypatch.setattr(fr_, "load_frontier", lambda presets: fr)
    text = "\n".join(fr_report.claims_section(tmp_path, PRESETS))
    assert (
        "| grpo_none | 2 (< 4) | [2, 2] | ref | 16 |" in text
        and "| vespo_none | open: >= 8 | (4 starts) | — | 4 |" in text
    )
