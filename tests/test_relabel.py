"""scripts/relabel_collapse.py: shipped run folders relabelled from their own metrics, rerunnably."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import yaml
from helpers import ROOT

SCRIPT = ROOT / "scripts" / "relabel_collapse.py"


def _load():
    spec = importlib.util.spec_from_file_location("relabel_collapse", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(
    root: Path,
    name: str,
    reward: list[float],
    entropy: list[float],
    status: dict,
    collapse: dict,
    final_accuracy: float = 0.75,
) -> Path:
    """A run folder: accuracy 0.45 at step 0 and `final_accuracy` at the last step, the rest per step."""
    run = root / "runs" / name
    run.mkdir(parents=True)
    rows = [(0, "task/accuracy", 0.45), (len(reward), "task/accuracy", final_accuracy)]
    for s, (r, e) in enumerate(zip(reward, entropy), start=1):
        rows += [(s, "reward/mean", r), (s, "policy/entropy", e), (s, "loss", 0.1), (s, "optim/grad_norm", 1.0)]
        rows += [(s, "reward/zero_var_group_frac", 0.0), (s, "reward/errors", 0.0)]
    pd.DataFrame(rows, columns=["step", "key", "value"]).assign(run=name).to_parquet(run / "metrics.parquet")
    (run / "config.yaml").write_text(
        yaml.safe_dump({"collapse": collapse, "rollout": {"prompts_per_step": 4, "group_size": 2}})
    )
    (run / "status.json").write_text(json.dumps({"steps_done": len(reward), "config_hash": "abc", **status}))
    return run


def test_relabel_turns_converged_runs_completed_and_keeps_real_collapses(tmp_path, capsys) -> None:
    # converged: reward 0.5 then a plateau 0.8 / 0.78 alternating with odd-length runs, entropy 0.01. The old
    # rule (entropy low while the rolling reward is below its value 10 records earlier) labelled it.
    plateau = [0.8 if (s // 3) % 2 else 0.78 for s in range(60)]
    converged = _run(
        tmp_path,
        "converged",
        [0.5] * 10 + plateau,
        [0.01] * 70,
        {"status": "collapsed", "collapse_events": [{"step": 25, "trigger": "entropy_collapse", "detail": "old"}]},
        {"entropy_floor": 0.05, "entropy_window": 10},  # written before `definition` existed
    )
    # reward 0.8 falls to 0.1 at step 31 at low entropy: rolling 10 < 0.5 * 0.8 first at step 36
    # ((0.8 * 4 + 0.1 * 6) / 10 = 0.38; step 35 gives 0.45), where the entropy trigger fires too; its
    # accuracy ends at 0.3, below the 0.45 of step 0
    collapsed = _run(
        tmp_path,
        "collapsed",
        [0.8] * 30 + [0.1] * 30,
        [0.01] * 60,
        {"status": "collapsed", "collapse_events": [{"step": 20, "trigger": "entropy_collapse", "detail": "old"}]},
        {"entropy_window": 1},  # no `definition` either: absolute, so reward_drop (relative: reward_below_start)
        final_accuracy=0.3,
    )
    relabel = _load()
    assert relabel.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{converged}: collapsed (entropy_collapse@25) -> completed (-)" in out
    assert f"{collapsed}: collapsed (entropy_collapse@20) -> collapsed (reward_drop@36, entropy_collapse@36)" in out
    assert (
        "2 run folders relabelled from their metrics; changed: collapsed -> collapsed: 1, collapsed -> completed: 1"
        in out
    )
    status = json.loads((converged / "status.json").read_text())
    assert status == {
        "steps_done": 70,
        "config_hash": "abc",
        "status": "completed",
        "collapse_events": [],
        "collapse_rule": 1,
    }
    assert relabel.main([str(tmp_path)]) == 0  # rerunnable: nothing left to change
    assert capsys.readouterr().out.strip().endswith("changed: none")


def test_relabel_rejudges_a_dip_the_run_recovered_from(tmp_path, capsys) -> None:
    # reward 0.8 dips to 0.1 (steps 31..45) and is back at 0.8 from step 46 to the end (70); accuracy ends
    # at 0.75 > 0.45 at step 0. Labelled when an event stood as soon as it fired; now a recovered dip.
    dip = _run(
        tmp_path,
        "dip",
        [0.8] * 30 + [0.1] * 15 + [0.8] * 25,
        [0.8] * 70,
        {"status": "collapsed", "collapse_events": [{"step": 36, "trigger": "reward_drop", "detail": "old"}]},
        {"definition": "absolute"},
    )
    relabel = _load()
    assert relabel.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{dip}: collapsed (reward_drop@36) -> completed (-; recovered reward_drop@36)" in out
    status = json.loads((dip / "status.json").read_text())
    assert status["status"] == "completed" and status["collapse_events"] == []
    (event,) = status["recovered_events"]
    assert (event["step"], event["trigger"]) == (36, "reward_drop")
    assert event["detail"].endswith("recovered: final rolling reward 0.8 >= 0.5 * best 0.8")
    assert relabel.main([str(tmp_path)]) == 0  # rerunnable
    assert capsys.readouterr().out.strip().endswith("changed: none")


def test_grid_check_finds_no_collapse_in_runs_that_end_above_their_start(tmp_path, capsys) -> None:
    # a reward fall in the last steps (0.8 -> 0.1 from step 51 of 60, under 0.5 * best at step 56) with
    # accuracy ending at 0.75 > 0.45: no definition calls it collapsed; a run that ends below its start
    # (0.3) is not checked
    _run(tmp_path, "late_fall", [0.8] * 50 + [0.1] * 10, [0.8] * 60, {"status": "completed"}, {})
    _run(tmp_path, "below", [0.8] * 60, [0.8] * 60, {"status": "completed"}, {}, final_accuracy=0.3)
    relabel = _load()
    assert relabel.main([str(tmp_path), "--grid"]) == 0
    assert capsys.readouterr().out.strip() == (
        "1 runs end above their cold start; collapsed under some definition of the grid: 0"
    )
    # a non-finite gradient norm stands whatever the accuracy: found, named, and the check fails
    frame = pd.read_parquet(tmp_path / "runs" / "late_fall" / "metrics.parquet")
    frame.loc[(frame["key"] == "optim/grad_norm") & (frame["step"] == 30), "value"] = float("nan")
    frame.to_parquet(tmp_path / "runs" / "late_fall" / "metrics.parquet")
    assert relabel.main([str(tmp_path), "--grid"]) == 1
    out = capsys.readouterr().out
    assert "late_fall: ends above its cold start, collapsed under 150 definitions: relative:d0.3:p1" in out
    assert out.strip().endswith("collapsed under some definition of the grid: 1")


def test_the_loop_writes_the_collapse_rule_version(tmp_path) -> None:
    from moe_rl.metrics.collapse import RULE_VERSION
    from moe_rl.run.folder import write_status

    write_status(tmp_path, "completed", steps_done=3)
    assert json.loads((tmp_path / "status.json").read_text())["collapse_rule"] == RULE_VERSION == 1
