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


def _frame(noise: float = 0.01, cold_seeds: int = 6, seeds: int = 2) -> pd.DataFrame:
    """A load_results-like long frame: `cold_seeds` cold seeds x `seeds` seeds per rung, evaluations at steps 0, 100,
    150, 200 (start 0.4, the last three at 0.4 + change + a pair's noise), reward and entropy at step 1."""
    rng = np.random.default_rng(0)
    rows = []
    for cold, seed in itertools.product(range(cold_seeds), range(seeds)):
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
    assert table.loc["half", "pairs"] == 12 and table.loc["half", "runs"] == 12
    assert table.loc["half", "n_starts"] == 6 and table.loc["half", "pair_starts"] == 6
    assert (table["descriptive"] == "").all()  # 6 independent starts: every number has its interval
    assert table.loc["half", "vs_moe"] == pytest.approx(0.10) and table.loc["worse", "vs_moe"] == pytest.approx(-0.10)
    # a constant difference: the hierarchical bootstrap interval of a constant is that constant
    assert table.loc["half", "vs_moe_lo"] == pytest.approx(0.10) and table.loc["half", "vs_moe_hi"] == pytest.approx(
        0.10
    )
    assert table.loc["half", "change"] == pytest.approx(-0.10, abs=0.01)
    # 6 starts, every start's mean difference the same sign: the cluster sign-flip p is 2 / 2^6 (not 2 / 2^12 over
    # the 12 pairs); Holm over the 3 rungs tested
    assert table.loc["half", "vs_moe_p"] == pytest.approx(2 / 2**6) and pd.isna(table.loc["moe", "vs_moe_p"])
    assert table.loc["worse", "vs_moe_holm"] == pytest.approx(3 * 2 / 2**6)
    assert table.loc["half", "start_reward"] == pytest.approx(0.15)
    assert table.loc["half", "start_entropy"] == pytest.approx(0.9)
    reads = {rung: verdict(row) for rung, row in table.reset_index().set_index("rung", drop=False).iterrows()}
    assert reads["worse"] == "opens the gap" and reads["moe"] == "reference (0)"


def test_a_rungs_change_is_the_mean_of_its_starts_means() -> None:
    """Unbalanced starts: cold seed 0 keeps one run of "half", the others two. The change is the mean over the 6
    starts of each start's mean, not the mean over the 11 runs; the paired difference likewise."""
    frame = _frame(noise=0.0)
    acc = (frame["key"] == "task/accuracy") & (frame["step"] > 0)
    half = frame["rung"] == "half"
    frame.loc[acc & half & (frame["cold_seed"] == 0), "value"] += 0.12  # start 0: change -0.10 + 0.12 = +0.02
    frame = frame[~(half & (frame["cold_seed"] == 0) & (frame["seed"] == 1))]  # start 0 keeps one run
    table = ladder_table(ladder_runs(frame)).set_index("rung")
    assert table.loc["half", "runs"] == 11 and table.loc["half", "n_starts"] == 6
    assert table.loc["half", "change"] == pytest.approx((0.02 + 5 * -0.10) / 6)  # not (0.02 + 10 * -0.10) / 11
    assert table.loc["half", "vs_moe"] == pytest.approx((0.22 + 5 * 0.10) / 6)
    assert table.loc["half", "pairs"] == 11 and table.loc["half", "pair_starts"] == 6


def test_below_five_starts_every_number_is_descriptive() -> None:
    """The shipped design, 2 cold seeds x 4 seeds: 8 pairs per rung but 2 starts, so no interval, no p, no Holm and
    no read; the means are still there, and the table prints the reason."""
    table = ladder_table(ladder_runs(_frame(noise=0.0, cold_seeds=2, seeds=4))).set_index("rung")
    reason = "descriptive: 2 independent starts (an interval needs 5)"
    assert (table["descriptive"] == reason).all() and (table["n_starts"] == 2).all()
    assert table.loc["half", "pairs"] == 8 and table.loc["half", "pair_starts"] == 2
    assert table.loc["half", "vs_moe"] == pytest.approx(0.10) and table.loc["half", "share"] == pytest.approx(0.5)
    for col in ("change_lo", "change_hi", "vs_moe_lo", "vs_moe_hi", "vs_moe_p", "vs_moe_holm", "share_lo", "share_hi"):
        assert table[col].isna().all(), col
    reads = {rung: verdict(row) for rung, row in table.reset_index().set_index("rung", drop=False).iterrows()}
    assert reads["half"] == reads["worse"] == "descriptive" and reads["dense"] == "target (1)"
    text = format_ladder_markdown(table.reset_index())
    assert "| half | 8 (2) | 40.0% | 0.150 | 0.900 | -10.0 | +10.0 | — | +0.50 | descriptive |" in text
    assert text.endswith(f"A number without an interval or p is {reason}; a descriptive rung is not read.")


def test_the_cold_start_key_names_the_start_where_given() -> None:
    """`starts` (configs.run_starts) is the start: two cold seeds of one rung that share a cached start are one."""
    runs = _frame(cold_seeds=6, seeds=2)
    names = runs.drop_duplicates("run").set_index("run")
    starts = names["rung"] + "/" + names["cold_seed"].clip(upper=4).astype(str)  # cold seeds 4 and 5 share a start
    table = ladder_table(ladder_runs(runs, starts)).set_index("rung")
    assert (table["n_starts"] == 5).all() and table.loc["half", "pair_starts"] == 6  # pairs cluster by cold seed
    assert ladder_runs(runs).loc[0, "start"] == "cold_seed=0"


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
    assert text.count("\n") == len(table) + 1 and "| half | 12 (6) | 40.0% | 0.150 | 0.900 | " in text
    assert plot_ladder(table).axes


def test_instruments_are_each_rungs_mean_over_steps_and_the_drift_its_last_value() -> None:
    """Planted per-step values: a run's load entropy is its mean over steps, its router drift the last step's;
    a rung's value the mean over its runs; a rung without routers (dense) shows NaN."""
    frame = _frame(cold_seeds=2, seeds=4)
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
