"""The stabilizer leaderboard on hand-made per-run outcomes: paired differences, McNemar and Holm by hand."""

from __future__ import annotations

import math
import re

import pandas as pd
import pytest
from helpers import PRESETS

from moe_rl.studies.stabilizers import format_leaderboard_markdown, leaderboard


def _runs() -> pd.DataFrame:
    rows = []
    # two cells x 4 seeds; arm "a" beats the reference by exactly +0.10 accuracy in every pair and survives
    # in 3 pairs where the reference collapsed; arm "b" equals the reference
    for lr, n in ((3e-4, 8), (1e-3, 2)):
        for seed in range(4):
            base = 0.1 * seed + (0.05 if n == 2 else 0.0)
            common = {"lr": lr, "N": n, "seed": seed, "token_ratio_var": 0.2, "routing_share": 0.25}
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
                    "survived": float(seed < 3 or n == 8) if (lr, seed) != (3e-4, 3) else 0.0,
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


def test_paired_differences_survival_and_holm_by_hand() -> None:
    table = leaderboard(_runs())
    assert table["arm"].tolist() == ["grpo+none", "a", "b"]  # the reference, then by paired accuracy gain
    ref, a, b = table.iloc[0], table.iloc[1], table.iloc[2]
    assert a["pairs"] == 8 and a["runs"] == 8 and a["cells"] == 2
    assert a["late_accuracy_diff"] == pytest.approx(0.1, abs=1e-12)
    # every difference is +0.1: the bootstrap interval of a constant is that constant
    assert a["late_accuracy_lo"] == pytest.approx(0.1, abs=1e-12) and a["late_accuracy_hi"] == pytest.approx(
        0.1, abs=1e-12
    )
    # sign-flip test of 8 equal positive differences: 2 of 2^8 sign patterns are as extreme (two-sided)
    assert a["late_accuracy_p"] == pytest.approx(2 / 2**8)
    # survival: "a" survives in 6 pairs where the reference collapsed (seeds 0-2 at lr 1e-3; 0-2 at lr 3e-4),
    # none the other way: exact McNemar, two-sided, 2 * 0.5^6
    assert a["survived_diff"] == pytest.approx(6 / 8)
    assert a["survived_p"] == pytest.approx(2 * 0.5**6)
    # "b" equals the reference: zero difference, p = 1
    assert b["late_accuracy_diff"] == 0.0 and b["late_accuracy_p"] == pytest.approx(1.0)
    assert b["survived_p"] == pytest.approx(1.0)
    # Holm over the two arms: the smaller p times 2, the larger max(itself, that)
    assert a["late_accuracy_holm"] == pytest.approx(2 * a["late_accuracy_p"])
    assert b["late_accuracy_holm"] == pytest.approx(1.0)
    assert math.isnan(ref["late_accuracy_p"]) and ref["survived_mean"] == 0.0
    text = format_leaderboard_markdown(table)
    assert "| **grpo+none** (ref) | 8 |" in text and "| a | 8 | " in text and "+10.0 [+10.0, +10.0]" in text


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
    section = "\n".join(claims_section(tmp_path, PRESETS))
    assert section.startswith("## Stabilizer leaderboard") and "| sapo+none | 4 |" in section
    assert claims_section(tmp_path / "elsewhere", PRESETS) == []
    # the study is found from its runs, not from the output folder's name
    elsewhere = tmp_path / "report_elsewhere"
    assert main([str(out / "runs"), "--out", str(elsewhere)]) == 0
    assert (elsewhere / "leaderboard.csv").read_bytes() == (out / "leaderboard.csv").read_bytes()
