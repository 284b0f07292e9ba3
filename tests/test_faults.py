"""Runs that survive faults and bad input: kill and resume, determinism, NaN, corrupt files."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from helpers import FAULTS, ROOT, run_metrics, run_train, tiny_config, tiny_overrides
from omegaconf import OmegaConf

from moe_rl.config import TrainConfig, validate
from moe_rl.models import build_model
from moe_rl.run.folder import CorruptFileError
from moe_rl.train import Trainer, train

OVERRIDES = tiny_overrides(*FAULTS)  # the tiny run as Hydra overrides; as a config: tiny_config(out, *FAULTS)


def test_same_config_and_seed_give_identical_metrics(tmp_path, cache) -> None:
    for name in ("a", "b"):
        assert train(tiny_config(tmp_path / name, *FAULTS, cache=cache, steps=4))["status"] in (
            "completed",
            "collapsed",
        )
    a, b = run_metrics(tmp_path / "a"), run_metrics(tmp_path / "b")
    pd.testing.assert_frame_equal(a.drop(columns="run"), b.drop(columns="run"))
    assert a["key"].str.startswith("route/old_vs_new").any() and sorted(a["step"].unique()) == [0, 1, 2, 3, 4]
    other = run_metrics(tmp_path / "a")
    train(tiny_config(tmp_path / "c", *FAULTS, cache=cache, steps=4, seed=1))
    assert not run_metrics(tmp_path / "c")["value"].equals(other["value"])


def _steps_done(run: Path) -> int:
    try:
        return json.loads((run / "status.json").read_text())["steps_done"]
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_resumes_to_identical_metrics(tmp_path, cache, caplog) -> None:
    """A launched run killed mid-run (SIGKILL: no handler runs) leaves a resumable folder; the rerun resumes from its
    last checkpoint to the metrics of a run never stopped. The rerun is the same config in this process: `tiny_config`
    composes what the command line does (the same config hash, or the folder would be refused), and a launched
    rerun resumes through the same `train` (launched python resumes: test_distributed)."""
    reference = tmp_path / "reference"
    train(tiny_config(reference, *FAULTS, cache=cache))
    run = tmp_path / "killed"
    cmd = [sys.executable, "experiments/train.py", *OVERRIDES, f"cold_start.cache_dir={cache}", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while _steps_done(run) < 4:  # status.json says step 4 is flushed (it is written after the metrics part)
        assert proc.poll() is None and time.time() < deadline, "run ended before it could be killed"
        time.sleep(0.01)
    time.sleep(0.05)  # somewhere inside step 5 or 6
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "running" and 4 <= status["steps_done"] < 10
    with caplog.at_level("INFO", logger="moe_rl.loop.checkpoint"):
        train(tiny_config(run, *FAULTS, cache=cache))
    assert any(record.getMessage().startswith(f"resuming {run} after step") for record in caplog.records)
    assert json.loads((run / "status.json").read_text())["steps_done"] == 10
    pd.testing.assert_frame_equal(run_metrics(run).drop(columns="run"), run_metrics(reference).drop(columns="run"))


def test_corrupt_checkpoint_is_reported_by_name(tmp_path, cache) -> None:
    cfg = tiny_config(tmp_path / "run", *FAULTS, cache=cache, steps=4, keep_checkpoint="true")
    train(cfg)
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    assert checkpoint.is_file()
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    (tmp_path / "run" / "status.json").unlink()
    with pytest.raises(CorruptFileError, match=r"checkpoint .*run/checkpoint.pt is corrupt or truncated"):
        Trainer(cfg).run()


def test_corrupt_metrics_part_is_reported_by_name(tmp_path, cache) -> None:
    cfg = tiny_config(tmp_path / "run", *FAULTS, cache=cache, steps=4, keep_checkpoint="true")
    train(cfg)  # checkpoint at step 2; parts up to steps 2 and 4
    part = sorted((tmp_path / "run" / "metrics").glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:50])
    with pytest.raises(CorruptFileError, match=rf"metrics part .*{part.name} is corrupt or truncated"):
        Trainer(cfg).run()


def test_nan_in_one_run_of_a_multirun_is_data_not_a_crash(tmp_path, cache) -> None:
    """`python experiments/train.py -m ...` (the script run in this process, `run_train`): the multirun ends well."""
    out = run_train(
        "-m",
        *tiny_overrides(*FAULTS, "steps=5"),
        f"cold_start.cache_dir={cache}",
        "fault_nan_step=3,null",
        # reward-based labels only: at lr 3e-3 the healthy run's 16-prompt accuracy falls 0.25 -> 0, which
        # the default (relative) definition calls a collapse; this test counts the NaN run's
        "collapse.definition=absolute",
        f"results_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    runs = [p.parent for p in (tmp_path / "default").rglob("status.json")]
    fault = {run: OmegaConf.load(run / "config.yaml").fault_nan_step for run in runs}
    diverged = [json.loads((run / "status.json").read_text()) for run in runs if fault[run] == 3]
    healthy = [json.loads((run / "status.json").read_text()) for run in runs if fault[run] is None]
    assert len(diverged) == 1 and len(healthy) == 1
    assert diverged[0]["status"] == "diverged" and diverged[0]["steps_done"] == 3
    assert diverged[0]["collapse_events"][0]["step"] == 3
    assert diverged[0]["collapse_events"][0]["trigger"] == "nonfinite"
    assert healthy[0]["status"] in ("completed", "collapsed") and healthy[0]["steps_done"] == 5
    from moe_rl.analysis import load_results, summarize

    summary = summarize(load_results(tmp_path / "default"))
    assert summary["collapsed"].tolist() == ["1 of 2"]
    assert summary["first_collapse_step"].tolist() == [3]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(replay="r3", record_routes=False), r"replay.mode='r3' replays rollout routes, but rollout.record_routes"),
        (dict(checkpoint="mixtral"), r"is a 'mixtral' model but model.family='qwen3_moe'; set model.family=mixtral"),
        (dict(checkpoint="missing"), r"is not a save_pretrained directory"),
    ],
)
def test_bad_input_rejected_before_work(tmp_path, change, match: str) -> None:
    cfg = TrainConfig(out_dir=str(tmp_path / "run"))
    if change.get("replay"):
        cfg.replay.mode = change["replay"]
        cfg.rollout.record_routes = change["record_routes"]
    if change.get("checkpoint") == "mixtral":
        build_model("mixtral").save_pretrained(tmp_path / "mixtral")
        cfg.model.checkpoint = str(tmp_path / "mixtral")
    if change.get("checkpoint") == "missing":
        cfg.model.checkpoint = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=match):
        validate(cfg)
    assert not (tmp_path / "run").exists()


def test_local_checkpoint_is_a_starting_policy(tmp_path) -> None:
    from moe_rl.tasks import make_tokenizer

    tokenizer = make_tokenizer()
    build_model("olmoe", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    cfg = tiny_config(tmp_path / "run", *FAULTS, cache=tmp_path / "unused", steps=2)
    cfg.model.family, cfg.model.checkpoint = "olmoe", str(tmp_path / "ckpt")
    result = train(cfg)
    assert result["status"] == "no_signal"  # an untrained checkpoint earns no reward, and the run says so
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["cold_start"]["path"] == str(tmp_path / "ckpt")
    assert not (tmp_path / "unused").exists()


def test_run_directory_of_another_config_is_refused(tmp_path, cache) -> None:
    from moe_rl.config import config_hash
    from moe_rl.run.launch import finished_status

    cfg = tiny_config(tmp_path / "run", *FAULTS, cache=cache, steps=4, keep_checkpoint="true")
    train(cfg)
    other = tiny_config(tmp_path / "run", *FAULTS, cache=cache, steps=4, **{"optim.lr": 1e-4})
    with pytest.raises(ValueError, match="holds a finished run of another config"):
        finished_status(tmp_path / "run", config_hash(other))
    assert finished_status(tmp_path / "run", config_hash(cfg)) in ("completed", "collapsed")
    (tmp_path / "run" / "status.json").unlink()  # as if killed: a checkpoint (step 2) remains
    with pytest.raises(ValueError, match="belongs to a run with another config"):
        Trainer(other).run()


def test_relative_collapse_definition_in_the_loop(tmp_path, cache) -> None:
    # thresholds that must fire: accuracy below 2x its step-0 value at one evaluation (step 1)
    cfg = tiny_config(
        tmp_path / "rel",
        *FAULTS,
        cache=cache,
        steps=2,
        eval_every=1,
        **{"collapse.definition": "relative", "collapse.accuracy_drop_frac": 2.0, "collapse.accuracy_patience": 1},
    )
    result = train(validate(cfg))
    status = json.loads((tmp_path / "rel" / "status.json").read_text())
    assert result["status"] == status["status"] == "collapsed"
    assert [(e["step"], e["trigger"]) for e in status["collapse_events"]] == [(1, "accuracy_below_start")]
    with pytest.raises(ValueError, match="collapse.definition"):
        validate(tiny_config(tmp_path / "bad", *FAULTS, cache=cache, **{"collapse.definition": "nope"}))
