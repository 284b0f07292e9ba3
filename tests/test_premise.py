"""Claim 16 (`moe_rl.studies.premise`): a difference of differences across rungs from two studies' start
differences, read by hand."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from moe_rl.studies import premise, study_rule
from moe_rl.studies.premise import Side


def _sides(monkeypatch, readings: dict[str, Side]) -> None:
    monkeypatch.setattr(premise, "side", lambda root, presets, study, contrast: readings[study])


def test_the_difference_of_differences_by_hand(monkeypatch) -> None:
    """R2: wide +6 pp (SE 2), default -2 pp (SE 1.5): +8 pp with SE 2.5, z 3.2, p 0.00069 passes Holm over 2 (the
    smaller p against 0.0125); anchoring: wide +1 (SE 2), default +0 (SE 1.5): +1 pp, upper bound 1 + 1.96 x 2.5 =
    5.9 pp, not below 5: inconclusive."""
    _sides(
        monkeypatch,
        {
            "routing_dominant": Side("routing_dominant", "r2_minus_none", 16, 0.06, 0.02, True),
            "offpolicy_edge": Side("offpolicy_edge", "r2_minus_none", 16, -0.02, 0.015, True),
            "routing_dominant_mechanism": Side(
                "routing_dominant_mechanism", "anchored_minus_moe", 16, 0.01, 0.02, True
            ),
            "causal_matched": Side("causal_matched", "anchored_minus_moe", 32, 0.0, 0.015, True),
        },
    )
    table = premise.read(None, None).set_index("part")
    assert table.loc["r2", "estimate"] == pytest.approx(0.08) and table.loc["r2", "se"] == pytest.approx(0.025)
    assert table.loc["r2", "p"] == pytest.approx(float(stats.norm.sf(3.2)))
    assert table.loc["r2", "verdict"] == study_rule.REPRODUCED
    assert table.loc["anchored", "upper"] == pytest.approx(0.01 + float(stats.norm.isf(0.025)) * 0.025)
    assert table.loc["anchored", "verdict"] == study_rule.INCONCLUSIVE


def test_a_side_not_final_or_missing_leaves_it_open(monkeypatch) -> None:
    """A growth excluded where both are final (upper bound -4 + 1.96 x 1 < 5); the same numbers with one side still
    running wait for it; a side without runs waits for its runs."""
    wide, default = (
        Side("routing_dominant", "r2_minus_none", 24, -0.03, 0.006, True),
        Side("offpolicy_edge", "r2_minus_none", 16, 0.01, 0.008, True),
    )
    missing = Side("routing_dominant_mechanism", "anchored_minus_moe", missing="no runs here yet")
    other = Side("causal_matched", "anchored_minus_moe", 32, 0.0, 0.015, True)
    readings = {"routing_dominant": wide, "offpolicy_edge": default, "routing_dominant_mechanism": missing}
    _sides(monkeypatch, {**readings, "causal_matched": other})
    table = premise.read(None, None).set_index("part")
    assert table.loc["r2", "verdict"] == study_rule.NOT_REPRODUCED and table.loc["r2", "upper"] < premise.MARGIN
    assert table.loc["anchored", "verdict"] == study_rule.INCONCLUSIVE
    assert table.loc["anchored", "reason"] == "waits: no runs here yet"
    running = Side("routing_dominant", "r2_minus_none", 8, -0.03, 0.006, False)
    _sides(monkeypatch, {**readings, "routing_dominant": running, "causal_matched": other})
    r2 = premise.read(None, None).set_index("part").loc["r2"]
    assert (
        r2["verdict"] == study_rule.INCONCLUSIVE and r2["reason"] == "waits for the final reading of routing_dominant"
    )
    assert math.isclose(r2["estimate"], -0.04)
