"""Tests for task=gym: reasoning-gym's tasks through its own generator and scorer, and their errors."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from helpers import tiny_config

from moe_rl.config import GymConfig, TaskConfig, validate
from moe_rl.tasks.setup import setup_task

needs_gym = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None, reason="reasoning-gym not installed: pip install 'moe_rl[gym]'"
)
SORTING = ("task.gym.name=number_sorting", "task.gym.kwargs.min_numbers=3", "task.gym.kwargs.max_numbers=3")


def test_missing_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    with pytest.raises(ImportError, match=r"task=gym needs reasoning-gym: pip install 'moe_rl\[gym\]'"):
        TaskConfig(name="gym", gym=GymConfig(name="number_sorting")).check()


def test_gym_needs_a_task_name():
    with pytest.raises(ValueError, match="task=gym needs task.gym.name"):
        TaskConfig(name="gym").check()


@needs_gym
def test_unknown_gym_task_lists_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"task.gym.name='sortin' is not a reasoning-gym task; e.g. basic_arithmetic"):
        validate(tiny_config(tmp_path, "task.name=gym", "task.gym.name=sortin"))
    cfg = tiny_config(tmp_path, "task.name=gym", "task.gym.name=number_sorting", "task.gym.kwargs.nope=1")
    with pytest.raises(ValueError, match=r"task.gym.kwargs=\{'nope': 1\} for 'number_sorting': TypeError"):
        setup_task(cfg.task, 0)


@needs_gym
def test_gym_data_held_out_and_scored_by_the_library(tmp_path):
    cfg = tiny_config(tmp_path, "task.name=gym", *SORTING, "task.n_train=40", "task.n_eval=8")
    task = setup_task(cfg.task, 0)
    again, other = setup_task(cfg.task, 0), setup_task(cfg.task, 1)
    assert (len(task.train), len(task.eval)) == (40, 8)
    assert [e["prompt"] for e in task.train] == [e["prompt"] for e in again.train]
    assert [e["prompt"] for e in task.eval] != [e["prompt"] for e in other.eval]
    assert not {e["prompt"] for e in task.train} & {e["prompt"] for e in task.eval}
    example = task.eval[0]
    assert example["prompt"].startswith("Sort these numbers") and example["answer"].startswith("['")
    assert task.score([example["answer"], "[]", "?"], [example] * 3).rewards == [1.0, 0.0, 0.0]
    assert task.reward_name == "gym:number_sorting" and task.data_hash == "reasoning-gym==" + _version()


@needs_gym
@pytest.mark.slow
def test_gym_task_trains_end_to_end(tmp_path):
    """A built model with a character tokenizer over the task's own characters: cold start, two RL steps."""
    import json

    from moe_rl.train import train

    cfg = tiny_config(
        tmp_path / "run",
        "task.name=gym",
        *SORTING,
        "task.gym.kwargs.max_decimals=0",
        "task.n_train=64",
        "task.n_eval=8",
        "task.max_new_tokens=24",
        "cold_start.max_steps=4",
        "cold_start.eval_every=2",
        "steps=2",
        "eval_every=2",
        "eval_size=8",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "optim.updates_per_rollout=1",
        "checkpoint_every=0",
        "threads=1",
        cache=tmp_path / "cache",
    )
    result = train(validate(cfg))
    assert result["status"] in ("completed", "no_signal")  # 4 warm-up steps rarely sort a list
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["cold_start"]["tokenizer"] == "char" and "S" in meta["cold_start"]["alphabet"]


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("reasoning-gym")
