"""Report text that is computed, not typed: checked on hand-built tables."""

from __future__ import annotations

import pandas as pd


def test_counts_that_move_between_collapse_definitions_are_listed() -> None:
    from moe_rl.analysis.folder_report import _moved_counts

    main = pd.DataFrame({"lr": [1e-3, 3e-4], "arm": ["a", "a"], "k": [8, 5], "n": [8, 24], "p_collapse": [1.0, 5 / 24]})
    alt = main.assign(k=[0, 6], p_collapse=[0.0, 6 / 24])
    text = _moved_counts([main, alt], ["lr"])
    assert text.startswith("Counts: 1 cell(s)") and "lr=0.001, arm=a: 8/8 vs 0/8" in text and "5/24" not in text
    assert "no cell and arm moves by 25%" in _moved_counts([main, main], ["lr"])


def test_report_keeps_runs_of_other_configs_apart_and_flags_unpoolable_groups(tmp_path) -> None:
    import shutil

    from fake_results import make_fake_results

    from moe_rl import analysis
    from moe_rl.analysis.configs import config_label, group_checks, with_config
    from moe_rl.report import main

    dirs = make_fake_results(tmp_path / "runs", arms=("grpo+r2",), seeds=(0, 1, 2, 3), steps=6, collapse=None)
    for run_dir in dirs[2:]:  # seeds 2 and 3 scored with another reward: not the same experiment
        (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text() + "reward: numeric\n")
    # seed 1 added later as a declared extension: the same run config, so it pools (moe_rl.config.NOT_IDENTITY)
    (dirs[1] / "config.yaml").write_text(
        (dirs[1] / "config.yaml").read_text() + "analysis:\n  extends: compare\n  look: 2\n"
    )
    copy = tmp_path / "runs" / "again" / "seed_0"  # seed 0 of the first config, run twice
    shutil.copytree(dirs[0], copy)
    frame = pd.read_parquet(copy / "metrics.parquet")
    frame[frame["step"] <= 3].assign(run="again-s0").to_parquet(copy / "metrics.parquet", index=False)

    df = analysis.load_results(tmp_path / "runs")
    labels = config_label(df)
    assert labels.to_dict() == {
        "compare-grpo+r2-s0": "reward=null",
        "compare-grpo+r2-s1": "reward=null",
        "compare-grpo+r2-s2": "reward=numeric",
        "compare-grpo+r2-s3": "reward=numeric",
        "again-s0": "reward=null",
    }
    assert config_label(df, pool=["reward"]).nunique() == 1 and "config" not in with_config(df, ["reward"])
    groups, added, _ = analysis.grouping(with_config(df), "arm")
    assert groups == ["arm", "config"] and added == ["config"]
    assert group_checks(with_config(df), groups) == [
        "- arm=grpo+r2, config=reward=null: seed 0 appears in 2 runs (`again-s0`, `compare-grpo+r2-s0`): they are "
        "not independent samples",
        "- arm=grpo+r2, config=reward=null: runs ran 3 to 5 steps; their means cover different stretches of training",
    ]
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "| arm | config | seeds |" in text
    assert "| grpo+r2 | reward=null | 3 |" in text and "| grpo+r2 | reward=numeric | 2 |" in text
    assert "**Check before reading the table**" in text and "seed 0 appears in 2 runs" in text
