"""Runs that learned nothing say so: `no_signal` and `reward_failed`, never `completed`."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from moe_rl.config import TrainConfig
from moe_rl.metrics.verdict import longest_no_signal, run_verdict
from moe_rl.train import train

ROWS = [{"question": f"what is {a} plus {b}?", "answer": str(a + b)} for a in range(8) for b in range(5)]


def test_longest_no_signal_stretch():
    assert longest_no_signal([1.0, 0.5, 1.0, 1.0, 1.0, 0.0, 1.0]) == (3, 2)
    assert longest_no_signal([0.0, 0.9]) == (0, 0)
    assert longest_no_signal([1.0, 1.0]) == (2, 0)


def test_verdict_thresholds_hand_checked():
    steps = [1, 2, 3, 4, 5]
    kw = dict(completions_per_step=10, no_signal_steps=3, max_reward_error_frac=0.5)
    signal = [0.5] * 5
    assert run_verdict(steps, signal, [0] * 5, [0.4] * 5, **kw) is None
    # 25 errors of 50 completions is exactly the allowed share; 26 is more
    assert run_verdict(steps, signal, [5, 5, 5, 5, 5], [0.4] * 5, **kw) is None
    failed = run_verdict(steps, signal, [5, 5, 5, 5, 6], [0.4] * 5, **kw)
    assert failed.status == "reward_failed" and "raised on 26 of 50 completions (52%" in failed.reason
    # a stretch of 3 zero-variance steps (2..4) is enough; 2 are not
    assert run_verdict(steps, [0.5, 1.0, 1.0, 0.5, 1.0], [0] * 5, [0.4] * 5, **kw) is None
    quiet = run_verdict(steps, [0.5, 1.0, 1.0, 1.0, 0.5], [0] * 5, [0.5, 0.0, 0.0, 0.0, 0.5], **kw)
    assert quiet.status == "no_signal" and quiet.reason.startswith("steps 2-4: every prompt group")
    assert "the reward is always 0" in quiet.reason
    # a run shorter than the stretch: all its steps count
    assert run_verdict([1, 2], [1.0, 1.0], [0, 0], [1.0, 1.0], **kw).status == "no_signal"
    assert run_verdict([1, 2], [1.0, 1.0], [0, 0], [1.0, 1.0], **{**kw, "no_signal_steps": 0}) is None
    solved = run_verdict(
        [1, 2], [1.0, 1.0], [0, 0], [1.0, 1.0], **kw, cold_start={"in_band": False, "accuracy": 0.0, "band": [0.2, 0.6]}
    )
    assert "cold start ended outside its band (held-out accuracy 0.000" in solved.reason
    assert "every completion already earns the full reward" in solved.reason
    # the reward raising everywhere also leaves no signal: the reward is named, not the symptom
    assert run_verdict([1, 2], [1.0, 1.0], [10, 10], [0.0, 0.0], **kw).status == "reward_failed"


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A data file and a module of rewards that plant each useless run."""
    root = tmp_path_factory.mktemp("planted")
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "planted_rewards.py").write_text(
        "def raising(completion, example):\n    raise KeyError('solution')\n"
        "def constant(completion, example):\n    return 1.0\n"
        "def sometimes(completion, example):\n    return float(len(completion) % 2)\n"
    )
    return root


def _run(root: Path, reward: str, monkeypatch, **changes) -> dict:
    monkeypatch.syspath_prepend(str(root))
    dotlist = [
        "task.name=dataset",
        f"task.path={root / 'rows.jsonl'}",
        "task.prompt_field=question",
        "task.n_train=null",
        "task.n_eval=8",
        f"task.reward=planted_rewards:{reward}",
        "task.max_new_tokens=4",
        "steps=3",
        "eval_every=3",
        "eval_size=4",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "optim.updates_per_rollout=2",
        "snapshot_every=0",
        "checkpoint_every=0",
        "progress=false",
        "threads=1",
        "cold_start.mode=none",
        f"cold_start.cache_dir={root / 'cache'}",
        f"out_dir={root / reward}",
    ] + [f"{k}={v}" for k, v in changes.items()]
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.from_dotlist(dotlist)))
    return train(cfg)


def test_raising_reward_ends_reward_failed(planted, monkeypatch):
    result = _run(planted, "raising", monkeypatch)
    status = json.loads((Path(result["dir"]) / "status.json").read_text())
    assert result["status"] == status["status"] == "reward_failed" and status["steps_done"] == 3
    assert "raised on 24 of 24 completions (100%" in status["reason"]
    frame = pd.read_parquet(Path(result["dir"]) / "metrics.parquet")
    assert frame[frame.key == "reward/errors"]["value"].tolist() == [8.0, 8.0, 8.0]
    meta = json.loads((Path(result["dir"]) / "meta.json").read_text())
    assert any(w.startswith("reward_failed: the reward function raised") for w in meta["warnings"])


def test_constant_reward_ends_no_signal(planted, monkeypatch):
    result = _run(planted, "constant", monkeypatch)
    status = json.loads((Path(result["dir"]) / "status.json").read_text())
    assert status["status"] == "no_signal"
    assert status["reason"].startswith("steps 1-3: every prompt group's completions scored alike")
    assert "reward/mean 1.000" in status["reason"] and "already earns the full reward" in status["reason"]


def test_a_run_with_signal_completes(planted, monkeypatch):
    result = _run(planted, "sometimes", monkeypatch, **{"signal.no_signal_steps": 3})
    frame = pd.read_parquet(Path(result["dir"]) / "metrics.parquet")
    zero_var = frame[frame.key == "reward/zero_var_group_frac"]["value"].tolist()
    assert min(zero_var) < 1.0 and result["status"] in ("completed", "collapsed")
