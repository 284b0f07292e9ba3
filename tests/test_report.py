"""Report text that is computed, not typed: checked on hand-built tables."""

from __future__ import annotations

import pandas as pd


def test_counts_that_move_between_collapse_definitions_are_listed() -> None:
    from moe_rl.report import _moved_counts

    main = pd.DataFrame({"lr": [1e-3, 3e-4], "arm": ["a", "a"], "k": [8, 5], "n": [8, 24], "p_collapse": [1.0, 5 / 24]})
    alt = main.assign(k=[0, 6], p_collapse=[0.0, 6 / 24])
    text = _moved_counts([main, alt], ["lr"])
    assert text.startswith("Counts: 1 cell(s)") and "lr=0.001, arm=a: 8/8 vs 0/8" in text and "5/24" not in text
    assert "no cell and arm moves by 25%" in _moved_counts([main, main], ["lr"])
