"""One definition per accuracy name (moe_rl.analysis.accuracy), used by the phase outcomes and the summary."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from moe_rl.analysis import accuracy
from moe_rl.metrics.names import REWARD_MEAN, TASK_ACCURACY


def _frame() -> pd.DataFrame:
    rows = [("a", s, TASK_ACCURACY, v) for s, v in ((10, 0.5), (0, 0.2), (20, 0.6), (30, 0.9), (40, 0.3))]
    rows += [("b", 0, TASK_ACCURACY, 0.4), ("b", 5, TASK_ACCURACY, 0.8), ("b", 5, REWARD_MEAN, 0.1)]
    rows += [("c", 0, TASK_ACCURACY, float("nan")), ("c", 3, TASK_ACCURACY, 0.7)]
    return pd.DataFrame(rows, columns=["run", "step", "key", "value"])


def test_start_final_and_late_accuracy() -> None:
    df = _frame()
    assert accuracy.start_accuracy(df).to_dict() == {"a": 0.2, "b": 0.4, "c": 0.7}  # step order; NaN skipped
    assert accuracy.final_accuracy(df).to_dict() == {"a": 0.3, "b": 0.8, "c": 0.7}  # the last evaluation
    late = accuracy.late_accuracy(df)  # the mean of the last 3 evaluations (fewer where a run has fewer)
    assert late["a"] == pytest.approx((0.6 + 0.9 + 0.3) / 3) and late["b"] == pytest.approx(0.6) and late["c"] == 0.7
    assert accuracy.LATE_EVALS == 3


def test_phase_outcomes_and_summary_use_the_one_definition() -> None:
    from moe_rl.analysis import phase, tables

    src = {m: Path(str(m.__file__)).read_text() for m in (phase, tables)}
    assert all("TASK_ACCURACY" not in s and "iloc[-" not in s for s in src.values())
    assert "final_accuracy(df)" in src[tables] and "late_accuracy(df)" in src[phase]
    df = _frame()
    assert accuracy.final_accuracy(df)["a"] != accuracy.late_accuracy(df)["a"]  # two names, two concepts
