"""The stabilizer leaderboard on hand-made per-run outcomes: clustered paired differences and Holm by hand."""

from __future__ import annotations

import math
import re

import pandas as pd
import pytest
from helpers import PRESETS

from moe_rl.studies.stabilizers import format_leaderboard_markdown, leaderboard


def _runs(seeds: int = 6, own_starts: bool = True) -> pd.DataFrame:
    """Two cells x `seeds` seeds; with `own_starts` every seed has a cold start of its own (`start`), shared by its
    runs in both cells, else no `start` (one cold start, as the shipped bench has)."""
    rows = []
    # arm "a" beats the reference by exactly +0.10 accuracy in every pair and survives in both cells of seeds 0-2,
    # where the reference collapsed; arm "b" equals the reference
    for lr, n in ((3e-4, 8), (1e-3, 2)):
        for seed in range(seeds):
            base = 0.1 * seed + (0.05 if n == 2 else 0.0)
            common = {"lr": lr, "N": n, "seed": seed, "token_ratio_var": 0.2, "routing_share": 0.25}
            if own_starts:
                common["start"] = f"start{seed}"
            rows.append(
                {
                    "arm": "grpo+none",
                    "late_accuracy": base,
                    "reward_auc": base / 2,
                    "survived": 0.0,
                    "clip_frac": 0.01,
                    **common,
                }
            )
            rows.append(
                {
                    "arm": "a",
                    "late_accuracy": base + 0.1,
                    "reward_auc": base / 2 + 0.01,
                    "survived": float(seed < 3),
                    "clip_frac": 0.03,
                    **common,
                }
            )
            rows.append(
                {
                    "arm": "b",
                    "late_accuracy": base,
                    "reward_auc": base / 2,
                    "survived": 0.0,
                    "clip_frac": 0.02,  # equal outcomes, another computation
                    **common,
                }
            )
    return pd.DataFrame(rows)


def test_the_same_computation_is_listed_once_and_counted_once_in_holm() -> None:
    runs = _runs()
    copy = runs[runs["arm"] == "a"].assign(arm="a_again")  # bitwise the same outcomes as "a" in every pair
    table = leaderboard(pd.concat([runs, copy], ignore_index=True))
    assert table["arm"].tolist() == ["grpo+none", "a", "b"]
    assert table.set_index("arm").loc["a", "same_as"] == "a_again"
    alone = leaderboard(runs).set_index("arm")
    assert table.set_index("arm")["late_accuracy_holm"].equals(alone["late_accuracy_holm"])  # two tests, not three
    assert "(= a_again: the same computation, counted once)" in format_leaderboard_markdown(table)


def test_paired_differences_clustered_by_start_and_holm_by_hand() -> None:
    table = leaderboard(_runs())
    assert table["arm"].tolist() == ["grpo+none", "a", "b"]  # the reference, then by paired accuracy gain
    ref, a, b = table.iloc[0], table.iloc[1], table.iloc[2]
    assert a["pairs"] == 12 and a["n_starts"] == 6 and a["runs"] == 12 and a["cells"] == 2 and a["descriptive"] == ""
    assert a["late_accuracy_diff"] == pytest.approx(0.1, abs=1e-12)
    # every difference is +0.1: the hierarchical bootstrap interval of a constant is that constant
    assert a["late_accuracy_lo"] == pytest.approx(0.1, abs=1e-12) and a["late_accuracy_hi"] == pytest.approx(
        0.1, abs=1e-12
    )
    # one sign per start: 6 starts all positive, 2 of 2^6 sign patterns as extreme (two-sided); not 2 / 2^12
    assert a["late_accuracy_p"] == pytest.approx(2 / 2**6)
    # survival: start means 1, 1, 1, 0, 0, 0 (seeds 0-2 survive in both cells): +0.5; the three non-zero starts flip,
    # 2 of their 2^3 sign patterns are as extreme
    assert a["survived_diff"] == pytest.approx(0.5)
    assert a["survived_p"] == pytest.approx(2 / 2**3)
    # "b" equals the reference: zero difference, p = 1
    assert b["late_accuracy_diff"] == 0.0 and b["late_accuracy_p"] == pytest.approx(1.0)
    assert b["survived_p"] == pytest.approx(1.0)
    # Holm over the two arms: the smaller p times 2, the larger max(itself, that)
    assert a["late_accuracy_holm"] == pytest.approx(2 * a["late_accuracy_p"])
    assert b["late_accuracy_holm"] == pytest.approx(1.0)
    assert math.isnan(ref["late_accuracy_p"]) and ref["survived_mean"] == 0.0
    text = format_leaderboard_markdown(table)
    assert "| **grpo+none** (ref) | 12 | — |" in text and "| a | 12 | 12 (6) | " in text
    assert "+10.0 [+10.0, +10.0] | 0.031 (0.062) |" in text and "descriptive" not in text


def test_a_difference_is_the_mean_of_the_starts_means() -> None:
    """Start 0 holds one pair (its lr 1e-3 run of "a" is missing), at +0.3; the 5 others two pairs each at +0.1:
    the difference is the mean of the 6 start means, (0.3 + 5 x 0.1) / 6, not the mean of the 11 pairs."""
    runs = _runs()
    start0 = (runs["arm"] == "a") & (runs["seed"] == 0)
    runs.loc[start0, "late_accuracy"] += 0.2
    runs = runs[~(start0 & (runs["lr"] == 1e-3))]
    a = leaderboard(runs).set_index("arm").loc["a"]
    assert a["pairs"] == 11 and a["n_starts"] == 6
    assert a["late_accuracy_diff"] == pytest.approx((0.3 + 5 * 0.1) / 6)
    # a replicate draws start 0 k times of 6 (k ~ Binomial(6, 1/6)): 0.1 + 0.2 k / 6. P(k = 0) = 0.33 > 2.5%, and
    # P(k >= 3) = 6.2% > 2.5% > P(k >= 4) = 0.9%: the 95% interval is k = 0 to k = 3
    assert a["late_accuracy_lo"] == pytest.approx(0.1) and a["late_accuracy_hi"] == pytest.approx(0.1 + 0.2 * 3 / 6)


def test_below_five_starts_a_difference_is_descriptive() -> None:
    """Runs without a `start` began from one cold start (the shipped bench): 8 pairs, 1 start, so the differences
    stand without an interval, a p or Holm, and the table says why."""
    table = leaderboard(_runs(seeds=4, own_starts=False))
    a = table.set_index("arm").loc["a"]
    reason = "descriptive: 1 independent start (an interval needs 5)"
    assert a["pairs"] == 8 and a["n_starts"] == 1 and a["descriptive"] == reason
    assert a["late_accuracy_diff"] == pytest.approx(0.1) and a["survived_diff"] == pytest.approx(6 / 8)
    for col in ("late_accuracy", "reward_auc", "survived"):
        assert table[[f"{col}_lo", f"{col}_hi", f"{col}_p", f"{col}_holm"]].isna().all().all()
    text = format_leaderboard_markdown(table)
    assert "| a | 8 | 8 (1) | " in text and "| +10.0 | — | " in text and "[" not in text.split("\n", 2)[2]
    assert text.endswith(f"A Δ without an interval or p is {reason}.\n")
    # four starts of their own are still too few
    assert leaderboard(_runs(seeds=4)).set_index("arm").loc["a", "n_starts"] == 4
    assert leaderboard(_runs(seeds=4))["late_accuracy_p"].isna().all()


def test_a_missing_reference_is_refused() -> None:
    with pytest.raises(KeyError, match=re.escape("reference arm 'grpo+none' has no runs")):
        leaderboard(_runs().query("arm != 'grpo+none'"))


def test_the_stabilizers_report_borrows_its_baselines_and_opens_with_the_leaderboard(tmp_path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from fake_results import make_fake_grid

    from moe_rl.report import main
    from moe_rl.studies.stabilizers import claims_section

    cell = {"lrs": (3e-4,), "Ns": (8,), "seeds": tuple(range(4)), "acc_noise": 0.0}
    # the baselines live in dense_control (with a dense family the leaderboard must leave out)
    make_fake_grid(tmp_path, experiment="dense_control", arms=("grpo+none", "gspo+none"), **cell)
    make_fake_grid(tmp_path, experiment="dense_control", arms=("grpo+none",), family="qwen3_dense", **cell)
    acc = {"grpo+r2": 0.45, "sapo+none": 0.15}
    make_fake_grid(tmp_path, experiment="stabilizers", arms=tuple(acc), final_acc=lambda arm, *_: acc[arm], **cell)
    out = tmp_path / "stabilizers"
    assert main([str(out / "runs"), "--out", str(out)]) == 0  # the runs' study (its registry row) picks the report
    text = (out / "summary.md").read_text()
    assert text.startswith("# Results: stabilizers\n\n## Leaderboard: every arm against grpo+none")
    assert "16 finished runs, 8 of them from" in text  # 4 seeds x (2 own arms + 2 borrowed), the dense runs left out
    table = pd.read_csv(out / "leaderboard.csv")
    pooled = table[table["cell"] == "pooled"].set_index("arm")
    # the fake grpo+r2 runs log bitwise what the fake grpo+none runs do: the same computation, listed once
    assert set(pooled.index) == {"grpo+none", "gspo+none", "sapo+none"}
    assert pooled.loc["grpo+none", "same_as"] == "grpo+r2"
    assert pooled.loc["sapo+none", "pairs"] == 4 and pooled.loc["sapo+none", "late_accuracy_diff"] < 0
    assert pooled.loc["sapo+none", "n_starts"] == 1 and pooled["late_accuracy_p"].isna().all()  # one cold start
    section = "\n".join(claims_section(tmp_path, PRESETS))
    assert section.startswith("## Stabilizer leaderboard") and "| sapo+none | 4 |" in section
    assert claims_section(tmp_path / "elsewhere", PRESETS) == []
    # the study is found from its runs, not from the output folder's name
    elsewhere = tmp_path / "report_elsewhere"
    assert main([str(out / "runs"), "--out", str(elsewhere)]) == 0
    assert (elsewhere / "leaderboard.csv").read_bytes() == (out / "leaderboard.csv").read_bytes()
