"""The routing-dominance ladder's table (`moe_rl.studies.ladder`): per rung and lr, by hand."""

from __future__ import annotations

import pandas as pd
from scipy import stats

from moe_rl.studies import ladder


def test_the_table_gives_each_rung_and_lr_its_means_with_t_intervals_over_starts() -> None:
    """Two starts at one lr: routing share 0.40 and 0.50, mean 45.0 with half-width t(0.975, 1) x sd / sqrt(2) x 100;
    a column constant over starts prints its mean alone; the floor counts runs at late accuracy 0."""
    runs = pd.DataFrame(
        {
            "rung": ["wide", "wide", "default"],
            "lr": [3e-4, 3e-4, 4e-4],
            "start": ["a", "b", "a"],
            "change": [-0.1, -0.2, -0.15],
            "floor": [False, True, False],
            "routing_share": [0.40, 0.50, 0.12],
            "flip_logp": [0.012, 0.018, float("nan")],
            "experts_changed": [0.03, 0.03, 0.02],
            "topk_changed": [0.06, 0.07, 0.04],
            "tokens_changed": [0.2, 0.3, 0.08],
        }
    )
    table = ladder.ladder_table(runs).set_index("rung")
    half = 100 * float(stats.t.isf(0.025, 1)) * pd.Series([0.40, 0.50]).std() / 2**0.5
    assert table.loc["wide", "routing_share (pp)"] == f"+45.0 [{45.0 - half:+.1f}, {45.0 + half:+.1f}]"
    assert table.loc["wide", "experts_changed (pp)"] == "+3.0"
    half = 1000 * float(stats.t.isf(0.025, 1)) * pd.Series([0.012, 0.018]).std() / 2**0.5
    assert table.loc["wide", "flip_logp (mnat)"] == f"+15.0 [{15.0 - half:+.1f}, {15.0 + half:+.1f}]"
    assert table.loc["default", "flip_logp (mnat)"] == "—"  # a run that did not log it
    assert table.loc["wide", "at the floor"] == "1 of 2" and table.loc["wide", "starts"] == 2
    assert table.loc["default", "change (pp)"] == "-15.0" and table.loc["default", "lr"] == "0.0004"
