"""The length study (experiments/conf/study/length.yaml, declared as it ran): its levels pin their lengths, its trends
over log L by hand (`moe_rl.studies.length`), its twins one unit, and the one rule on its shipped runs (L = 16 and
32 at `past` named a floor, not a refutation)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import PRESETS, ROOT
from scipy import stats

from moe_rl.config import TaskConfig
from moe_rl.studies import length as ln
from moe_rl.studies import study_rule
from moe_rl.studies.design import load_study

STUDY = PRESETS.parent / "study" / "length.yaml"


def test_every_level_pins_its_length_and_the_answer_it_needs() -> None:
    study = load_study(STUDY)
    assert {lv: ln.length_of(study, lv) for lv in study.axes["past"]} == {"past_L4": 4, "past_L16": 16, "past_L32": 32}
    for level in study.levels.values():
        size = ln.length_of(study, level.name)
        assert f"task.gym.kwargs.min_digits={size}" in level.overrides
        assert f"task.max_new_tokens={size + 3}" in level.overrides  # the sum's extra digit, eos and one spare
    assert study.by_member and study.admission.in_band and study.member_pool == 6


@pytest.mark.parametrize(
    ("task", "length"),
    [
        (TaskConfig(name="running_sum", kwargs={"min_len": 16, "max_len": 16}), 16),
        (TaskConfig(name="reversal", kwargs={"min_len": 3, "max_len": 6}), None),
        (TaskConfig(name="reversal"), None),
    ],
)
def test_fixed_length_is_set_only_where_the_task_pins_it(task: TaskConfig, length: int | None) -> None:
    assert task.fixed_length() == length


def _planted(slope_of) -> pd.DataFrame:  # noqa: ANN001
    """Per member m (its twin at seed m + 6), length and arm: arm a's change slope_of(m) log L (+ 0.01 on the
    twin), arm b's 0."""
    rows = []
    for m in range(4):
        for seed in (m, m + 6):
            for size in (4, 16, 32):
                for arm, y in (("a", slope_of(m) * math.log(size) + 0.01 * (seed > 5)), ("b", 0.0)):
                    rows.append(dict(level=f"past_L{size}", arm=arm, seed=seed, start=f"member {m}", change=y))
    return pd.DataFrame(rows)


def test_member_slopes_by_hand_with_twins_one_unit() -> None:
    """Member m's difference a - b is (m + 1) log L (its twin 0.01 above, which no slope sees): the slopes are
    1, 2, 3, 4, one per member (not per twin), their mean 2.5 with the t interval over 4 members."""
    study = load_study(STUDY)
    runs = _planted(lambda m: m + 1.0)
    values = ln.member_values(study, runs, study.axes["past"], "change", "a", "b")
    assert len(values) == 12  # 4 members x 3 lengths: twins averaged within their member
    assert ln.slopes(values).to_numpy() == pytest.approx([1.0, 2.0, 3.0, 4.0])
    t = ln.trend(study, runs, study.axes["past"], "change", "a", "b", log_y=False)
    half = stats.t.isf(0.025, 3) * np.std([1, 2, 3, 4], ddof=1) / 2
    assert t["members"] == 4 and t["slope"] == pytest.approx(2.5) and t["hi"] == pytest.approx(2.5 + half)
    few = ln.trend(study, runs[runs["start"] < "member 2"], study.axes["past"], "change", "a", "b", log_y=False)
    assert few["members"] == 2 and math.isnan(few["lo"])  # below 3 members: no interval


def test_the_shipped_runs_by_the_one_rule() -> None:
    """On the shipped runs: twins count once (at most 6 starts per length, from 9-11 pairs), the two starts warmed
    out of their band (L = 4 member 2, L = 16 member 1 on the EPYC) are left out, and L = 16 at `past`, where every
    run ends at accuracy 0, is untestable, not a refutation; claim 13's growth reads a run mean on that floor."""
    study = load_study(STUDY)
    result = study_rule.analyse(study, ROOT / "results" / "length" / "runs")
    assert len(result.runs) == 237 and (~result.runs["admitted"]).sum() == 12
    out = result.starts[~result.starts["admitted"]]
    assert sorted(out["start"]) == ["member 1", "member 2"] and not out["in_band"].any()
    v = result.verdicts.set_index("contrast")
    assert (v.loc["r2_minus_none_L4", ["starts", "pairs"]] == [5, 9]).all()
    for name in ("r2_minus_none_L16", "gspo_minus_grpo_none_L16", "routing_share_growth"):
        assert v.loc[name, "verdict"] == study_rule.UNTESTABLE and v.loc[name, "reason"].startswith("floor"), name
    assert Path(study.file).name == "length.yaml" and study.not_run[("grpo_none", "past_L4")] == (7, 8)
