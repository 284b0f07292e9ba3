"""The mechanism ladder's table: each rung's share of the dense - moe gap, on planted runs."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from moe_rl.studies.mechanism import (
    format_ladder_markdown,
    instrument_table,
    ladder_runs,
    ladder_section,
    ladder_table,
    plot_ladder,
    verdict,
)

# planted accuracy change per rung (pp of held-out accuracy): moe loses 20, dense holds, "half" closes half
CHANGE = {"moe": -0.20, "dense": 0.0, "half": -0.10, "worse": -0.30}


def _frame(noise: float = 0.01) -> pd.DataFrame:
    """A load_results-like long frame: 2 cold seeds x 4 seeds per rung, evaluations at steps 0, 100, 150, 200
    (start 0.4, the last three at 0.4 + change + a pair's noise), reward and entropy at step 1."""
    rng = np.random.default_rng(0)
    rows = []
    for cold, seed in itertools.product(range(2), range(4)):
        shared = rng.normal(0, noise)  # what a pair shares: its seeds
        for rung, change in CHANGE.items():
            run = f"{rung}-{cold}-{seed}"
            keys = {"run": run, "rung": rung, "cold_seed": cold, "seed": seed}
            rows.append({**keys, "step": 0, "key": "task/accuracy", "value": 0.4})
            for step in (100, 150, 200):
                rows.append({**keys, "step": step, "key": "task/accuracy", "value": 0.4 + change + shared})
            rows.append({**keys, "step": 1, "key": "reward/mean", "value": 0.15})
            rows.append({**keys, "step": 1, "key": "policy/entropy", "value": 0.9})
    return pd.DataFrame(rows)


def test_each_rung_gets_its_planted_share_of_the_gap() -> None:
    table = ladder_table(ladder_runs(_frame())).set_index("rung")
    assert list(table.index) == ["moe", "half", "worse", "dense"]  # moe first, dense last
    # pairs share their noise, so differences are exact: share = (change - moe) / (dense - moe)
    assert table.loc["half", "share"] == pytest.approx(0.5)
    assert table.loc["worse", "share"] == pytest.approx(-0.5)
    assert table.loc["moe", "share"] == pytest.approx(0.0) and table.loc["dense", "share"] == pytest.approx(1.0)
    assert table.loc["half", "pairs"] == 8 and table.loc["half", "runs"] == 8
    assert table.loc["half", "vs_moe"] == pytest.approx(0.10) and table.loc["worse", "vs_moe"] == pytest.approx(-0.10)
    assert table.loc["half", "change"] == pytest.approx(-0.10, abs=0.01)
    # 8 pairs, every difference the same sign: the exact sign-flip p is 2 / 2^8; Holm over the 3 rungs tested
    assert table.loc["half", "vs_moe_p"] == pytest.approx(2 / 2**8) and pd.isna(table.loc["moe", "vs_moe_p"])
    assert table.loc["worse", "vs_moe_holm"] == pytest.approx(3 * 2 / 2**8)
    assert table.loc["half", "start_reward"] == 0.15 and table.loc["half", "start_entropy"] == 0.9
    reads = {rung: verdict(row) for rung, row in table.reset_index().set_index("rung", drop=False).iterrows()}
    assert reads["worse"] == "opens the gap" and reads["moe"] == "reference (0)"


def test_a_rung_that_closes_the_gap_reads_so_and_noise_widens_the_interval() -> None:
    frame = _frame()
    frame.loc[frame["rung"] == "half", "rung"] = "closer"
    closer = frame["rung"] == "closer"
    frame.loc[closer & (frame["step"] > 0) & (frame["key"] == "task/accuracy"), "value"] += 0.08  # share 0.9
    table = ladder_table(ladder_runs(frame)).set_index("rung")
    assert table.loc["closer", "share"] == pytest.approx(0.9)
    assert verdict(table.reset_index().set_index("rung", drop=False).loc["closer"]) == "closes the gap"
    noisy = frame.copy()
    rng = np.random.default_rng(1)
    late = closer & (noisy["step"] > 0) & (noisy["key"] == "task/accuracy")
    noisy.loc[late, "value"] += np.repeat(rng.normal(0, 0.1, late.sum() // 3), 3)  # one draw per run
    wide = ladder_table(ladder_runs(noisy)).set_index("rung")
    assert (
        wide.loc["closer", "share_hi"] - wide.loc["closer", "share_lo"]
        > table.loc["closer", "share_hi"] - table.loc["closer", "share_lo"]
    )


def test_the_ladder_renders() -> None:
    table = ladder_table(ladder_runs(_frame()))
    text = format_ladder_markdown(table)
    assert text.count("\n") == len(table) + 1 and "| half | 8 | 40.0% | 0.150 | 0.900 | " in text
    assert plot_ladder(table).axes


def test_instruments_are_each_rungs_mean_over_steps_and_the_drift_its_last_value() -> None:
    """Planted per-step values: a run's load entropy is its mean over steps, its router drift the last step's;
    a rung's value the mean over its runs; a rung without routers (dense) shows NaN."""
    frame = _frame()
    rows = []
    for run, rung in frame.groupby("run")["rung"].first().items():
        if rung == "dense":
            continue
        seed = int(run.rsplit("-", 1)[1])
        for step in (1, 2, 3):
            rows.append(
                {"run": run, "rung": rung, "step": step, "key": "route/load/entropy", "value": 0.5 + 0.1 * step}
            )
            rows.append(
                {"run": run, "rung": rung, "step": step, "key": "optim/router_drift", "value": step * (1 + seed)}
            )
    table = instrument_table(pd.concat([frame, pd.DataFrame(rows)], ignore_index=True))
    assert list(table.index) == ["moe", "half", "worse", "dense"]
    assert list(table.columns) == ["route/load/entropy", "optim/router_drift"]  # the INSTRUMENTS order
    assert table.loc["half", "route/load/entropy"] == pytest.approx(0.7)
    assert table.loc["half", "optim/router_drift"] == pytest.approx(
        3 * 2.5
    )  # the last step (3) x mean(1 + seed) over seeds 0..3; the mean over steps: 5
    assert table.loc["dense"].isna().all()
    files, text = ladder_section(pd.concat([frame, pd.DataFrame(rows)], ignore_index=True))
    assert sorted(files) == ["instruments.csv", "instruments.png", "ladder.csv", "ladder.png"]
    assert "| half | 0.7 | 7.5 |" in text and "| dense | — | — |" in text
    assert sorted(ladder_section(frame)[0]) == ["ladder.csv", "ladder.png"]  # runs that logged no instrument


def test_without_a_gap_no_rung_is_read_and_runaway_bounds_are_capped() -> None:
    """dense = moe (no gap): the shares are ratios over noise, so the table reads no rung, and the bounds a
    near-zero denominator sends far out print as beyond +-100."""
    frame = _frame(noise=0.05)
    frame.loc[(frame["rung"] == "dense") & (frame["step"] > 0) & (frame["key"] == "task/accuracy"), "value"] -= 0.2
    rng = np.random.default_rng(2)
    late = (frame["rung"] == "dense") & (frame["step"] > 0) & (frame["key"] == "task/accuracy")
    frame.loc[late, "value"] += np.repeat(rng.normal(0, 0.05, late.sum() // 3), 3)
    table = ladder_table(ladder_runs(frame))
    text = format_ladder_markdown(table)
    assert "no gap to share" in text and "closes the gap" not in text and "opens the gap" not in text
    assert "| reference (0) |" in text and "| target (1) |" in text
    from moe_rl.studies.mechanism import _bounded

    assert _bounded(3.0e16) == ">+100" and _bounded(-250.0) == "<-100" and _bounded(-0.57) == "-0.57"
