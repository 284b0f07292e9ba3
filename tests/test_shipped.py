"""The main job's comparison of its table with the shipped one (`moe_rl.analysis.shipped`), by hand."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from moe_rl.analysis.shipped import OUTSIDE, SAME, WITHIN, compare_summaries, main, verdict

SHIPPED = pd.DataFrame(
    {
        "arm": ["grpo+none", "gspo+none"],
        "final_accuracy_mean": [0.5, 0.25],
        "final_accuracy_ci95": [0.1, 0.05],
        "flip_rate_mean": [0.01, 0.02],
        "flip_rate_ci95": [0.002, 0.004],
    }
)


def test_same_bits_within_and_outside_the_shipped_interval() -> None:
    assert (
        verdict(compare_summaries(SHIPPED, SHIPPED.copy())) == "SAME BITS as the shipped table (4 arm x outcome means)"
    )
    # 0.5 -> 0.59 is inside +-0.1; 0.25 -> 0.31 is outside +-0.05 (0.0625 and 0.25 are exact in binary)
    moved = SHIPPED.assign(final_accuracy_mean=[0.59, 0.3125])
    table = compare_summaries(SHIPPED, moved)
    assert table["status"].tolist() == [WITHIN, SAME, OUTSIDE, SAME]
    assert verdict(table) == (
        "NOT ALL WITHIN: 2 of 4 means with the same bits, 1 within the shipped 95% interval; 1 outside or missing: "
        "gspo+none final_accuracy (outside)"
    )
    within = compare_summaries(SHIPPED, SHIPPED.assign(flip_rate_mean=[0.011, 0.019]))
    assert verdict(within).startswith("WITHIN THE SHIPPED INTERVALS: 2 of 4 means with the same bits, 2 within")


def test_an_arm_the_rerun_lacks_is_missing() -> None:
    table = compare_summaries(SHIPPED, SHIPPED.iloc[:1])
    assert table.loc[table["arm"] == "gspo+none", "status"].tolist() == ["missing", "missing"]
    assert math.isnan(table["this run"].iloc[-1]) and verdict(table).startswith("NOT ALL WITHIN")


def test_the_command_names_a_missing_table(tmp_path) -> None:
    SHIPPED.to_csv(tmp_path / "shipped.csv", index=False)
    with pytest.raises(SystemExit, match="no such summary table"):
        main([str(tmp_path / "shipped.csv"), str(tmp_path / "nope.csv")])
