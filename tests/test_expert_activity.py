"""The 1/sqrt(p_e) test (moe_rl.analysis.expert_activity) on planted instrument rows."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from moe_rl.analysis.expert_activity import per_expert, run_slope, section, slope_test

ACTIVE, MOVE = "optim/expert_step/active/", "optim/expert_step/move_active/"


def planted(run: str, shares: list[float], exponent: float, scale: float = 1.0) -> list[tuple]:
    """Two instrumented steps; expert e is active in a share shares[e] of each step's updates and moves
    scale * p^exponent per active update (the step's move_active: the mean over its active updates)."""
    rows = []
    for step in (10, 20):
        for e, p in enumerate(shares):
            key = f"layer_0/expert_{e}"
            rows.append((run, step, ACTIVE + key, p))
            if p > 0:
                rows.append((run, step, MOVE + key, scale * p**exponent))
    return rows


def test_per_expert_reads_p_and_the_move_per_active_update() -> None:
    """Step means: p averages the steps' shares; the move averages the steps' values weighted by their shares."""
    rows = [("r", 10, ACTIVE + "layer_1/expert_3", 0.25), ("r", 10, MOVE + "layer_1/expert_3", 2.0)]
    rows += [("r", 20, ACTIVE + "layer_1/expert_3", 0.75), ("r", 20, MOVE + "layer_1/expert_3", 4.0)]
    rows += [("r", 20, ACTIVE + "layer_1/expert_4", 0.0), ("r", 20, "reward/mean", 0.5)]
    out = per_expert(pd.DataFrame(rows, columns=["run", "step", "key", "value"])).set_index("expert")
    assert out.loc[3, "p"] == 0.5 and out.loc[3, "move"] == pytest.approx((0.25 * 2 + 0.75 * 4) / 1.0)
    assert out.loc[4, "p"] == 0.0 and math.isnan(out.loc[4, "move"]) and out.loc[3, "layer"] == 1


def test_the_slope_recovers_the_planted_exponent_and_pools_by_start() -> None:
    shares = [1.0, 0.5, 0.25, 0.125, 0.0]
    rows = []
    for i in range(6):  # 6 starts, one run each, every run exactly 1/sqrt(p) at its own scale
        rows += planted(f"run{i}", shares, -0.5, scale=1 + i)
    df = pd.DataFrame(rows, columns=["run", "step", "key", "value"])
    experts = per_expert(df)
    assert run_slope(experts[experts["run"] == "run0"]) == pytest.approx(-0.5)
    starts = pd.Series({f"run{i}": f"s{i}" for i in range(6)})
    t = slope_test(experts, starts)
    assert t["slope"] == pytest.approx(-0.5) and t["lo"] == pytest.approx(-0.5) and t["hi"] == pytest.approx(-0.5)
    assert t["runs"] == 6 and t["starts"] == 6 and t["below_0.9"] == 6 * 4 and not t["descriptive"]
    few = slope_test(experts[experts["run"].isin(["run0", "run1"])], starts)
    assert few["descriptive"].startswith("descriptive: 2") and math.isnan(few["lo"])
    assert "-0.50 [-0.50, -0.50]" in section(df, starts)
    flat = per_expert(pd.DataFrame(planted("flat", [1.0, 1.0, 1.0, 0.9], -0.5), columns=df.columns))
    assert np.isnan(run_slope(flat))  # fewer than 3 distinct p: no slope
    assert section(df[df["key"] == "reward/mean"], starts) == ""


def test_load_aware_runs_are_read_apart_from_the_plain_adamw_test() -> None:
    """6 plain runs at the planted -0.5 and 6 load-aware ones at +2.0: the test reads the plain ones alone, and the
    scaled ones are printed apart with their own slope."""
    shares = [1.0, 0.5, 0.25, 0.125]
    rows = [r for i in range(6) for r in planted(f"plain{i}", shares, -0.5, scale=1 + i)]
    rows += [r for i in range(6) for r in planted(f"aware{i}", shares, 2.0, scale=1 + i)]
    df = pd.DataFrame(rows, columns=["run", "step", "key", "value"])
    starts = pd.Series({f"{k}{i}": f"s{i}" for k in ("plain", "aware") for i in range(6)})
    scaled = pd.Series({r: r.startswith("aware") for r in starts.index})
    text = section(df, starts, scaled)
    assert "plain-AdamW runs: -0.50 [-0.50, -0.50] over 6 runs from 6 starts" in text
    assert "Load-aware runs, apart (their step is scaled by load by construction): +2.00 [+2.00, +2.00]" in text
