"""The command line: a run named without a file, and what an interrupted run says."""

from __future__ import annotations

import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore

from moe_rl.config import TrainConfig
from moe_rl.run.experiment import interrupted_line, named_experiment_args, to_train_config

CONF = Path(__file__).resolve().parents[1] / "experiments" / "conf"
ConfigStore.instance().store(name="base_config", node=TrainConfig)


def test_experiment_name_needs_no_file() -> None:
    argv = ["train.py", "experiment=my_probe", "steps=4", "experiment=smoke", "+experiment=compare"]
    assert named_experiment_args(argv, CONF) == [
        "train.py",
        "+experiment=my_probe",
        "steps=4",
        "+experiment=smoke",
        "+experiment=compare",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        named = to_train_config(compose("config", overrides=["+experiment=my_probe", "steps=4"]))
        smoke = to_train_config(compose("config", overrides=["+experiment=smoke"]))
        plain = to_train_config(compose("config", overrides=["steps=4"]))
    assert (named.experiment, named.steps) == ("my_probe", 4)
    assert named.to_dict() == {**plain.to_dict(), "experiment": "my_probe"}  # the name and nothing else
    assert (smoke.experiment, smoke.steps) == ("smoke", 3)  # a file still loads its deltas


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
