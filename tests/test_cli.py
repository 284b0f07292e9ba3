"""The command line: a run named without a file or from a preset, the old preset spelling refused, and what an
interrupted run and a bad config value say."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest
from helpers import ROOT, run_train
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore

from moe_rl.config import TrainConfig, to_train_config, validate
from moe_rl.run.launch import interrupted_line, old_preset_spelling, refuse_old_preset_spelling

CONF = ROOT / "experiments" / "conf"
ConfigStore.instance().store(name="base_config", node=TrainConfig)


def test_experiment_name_needs_no_file() -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        named = to_train_config(compose("config", overrides=["experiment=my_probe", "steps=4"]))
        smoke = to_train_config(compose("config", overrides=["+preset=smoke"]))
        plain = to_train_config(compose("config", overrides=["steps=4"]))
    assert (named.experiment, named.steps) == ("my_probe", 4)
    assert named.to_dict() == {**plain.to_dict(), "experiment": "my_probe"}  # the name and nothing else
    assert (smoke.experiment, smoke.steps) == ("smoke", 3)  # a preset still loads its deltas


def test_a_run_from_a_preset_can_be_named() -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        mine = to_train_config(compose("config", overrides=["+preset=smoke", "experiment=mine"]))
        smoke = to_train_config(compose("config", overrides=["+preset=smoke"]))
    assert mine.experiment == "mine"
    assert mine.to_dict() == {**smoke.to_dict(), "experiment": "mine"}  # the smoke deltas, under another name
    assert (mine.steps, mine.task.n_train, mine.cold_start.band) == (3, 200, [0.0, 1.0])


def test_the_old_preset_spelling_is_refused_with_the_new_one() -> None:
    line = "`+experiment=smoke` is now `+preset=smoke` (experiment=NAME names the run)"
    assert old_preset_spelling(["steps=4", "+experiment=smoke"]) == line
    assert old_preset_spelling(["+preset=smoke", "experiment=mine", "steps=4"]) is None
    with pytest.raises(SystemExit, match=re.escape(f"error: {line}")):
        refuse_old_preset_spelling(["+experiment=smoke"])
    # the command as typed: `python experiments/train.py ...`, the script run in this process (`run_train`)
    out = run_train("+experiment=smoke", "dry_run=true")
    assert out.returncode == 1 and out.stderr.strip() == f"error: {line}", out.stderr[-2000:]


def test_interrupted_line_says_what_a_rerun_does(tmp_path) -> None:
    (tmp_path / "status.json").write_text(json.dumps({"status": "running", "steps_done": 57}))
    assert interrupted_line(tmp_path, 25) == (
        f"interrupted after step 57: rerun the same command to resume from step 50 ({tmp_path})"
    )
    (tmp_path / "status.json").write_text(json.dumps({"status": "running", "steps_done": 6}))
    assert interrupted_line(tmp_path, 25) == (
        f"interrupted after step 6, before its first checkpoint (checkpoint_every=25): rerunning the same command "
        f"starts the run over ({tmp_path})"
    )


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["rollout.group_size=1"], "rollout.group_size=1 must be >= 2 (group-normalised advantages)"),
        (
            ["algo.k_pos=-1"],
            "algo.k_pos is not a parameter of algo.name='grpo'; its parameters: ['eps_high', 'eps_low']",
        ),
        (["algo=vespo", "algo.k_pos=-1"], "algo.k_pos=-1.0 must be >= 0"),
        (
            ["replay.mode=r3", "model=qwen3_dense"],
            "replay.mode='r3' replays expert routes, but model.family='qwen3_dense' is dense (no MoE layer to route); "
            "use replay.mode=none",
        ),
    ],
)
def test_a_bad_config_value_is_refused_in_its_one_line(overrides: list[str], line: str) -> None:
    """Composed as `experiments/train.py` composes it, each bad value is refused by a ValueError whose message is its
    one line, with no warning printed on the way (Python's default filters: a deprecation is not shown). A launch
    prints any such refusal as `error: <message>` and exits 1 (`run_from_hydra`, the same path for every value: the
    next test launches one), so these are checked in this process."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for quiet in (DeprecationWarning, PendingDeprecationWarning):
            warnings.filterwarnings("ignore", category=quiet)
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
            with pytest.raises(ValueError) as refused:
                validate(to_train_config(cfg))
    assert str(refused.value) == line


def test_a_bad_config_value_ends_the_launch_with_its_one_line_and_marks_its_folder_invalid(tmp_path) -> None:
    """As a new user types it: the reason in one line and exit status 1, not a traceback under Hydra's banner; the
    run folder (out_dir is honoured: Hydra's folder is it) says why it holds no run, and no work was done."""
    run = tmp_path / "my_run"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out = subprocess.run(
        [sys.executable, "experiments/train.py", "optim.lr=-1", f"out_dir={run}"],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    line = "optim.lr=-1.0 must be > 0"
    assert out.returncode == 1 and out.stderr.strip() == f"error: {line}", out.stderr[-2000:]
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "invalid"
    assert status["error"] == {"type": "ValueError", "message": line}
    assert not (run / "metrics.parquet").exists()


def test_the_trace_of_a_bad_config_value_on_request(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "experiments/train.py", "rollout.group_size=1", f"results_dir={tmp_path}"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 1 and "Traceback (most recent call last)" in out.stderr
    assert "ValueError: rollout.group_size=1 must be >= 2" in out.stderr  # the check that raised it, in the trace
