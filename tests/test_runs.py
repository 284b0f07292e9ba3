"""Run folders people can watch and trust: live logging backends, progress lines, status.json on
every failure, checkpoints that cannot run code, wide metrics."""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import pickle
import random
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import FAULTS, tiny_config

from moe_rl.analysis import load_results
from moe_rl.config import validate
from moe_rl.run.folder import CorruptFileError, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from moe_rl.run.progress import eta_seconds, format_duration, progress_fields, progress_line
from moe_rl.train import Trainer, train

BACKENDS = [b for b in ("tensorboard", "wandb", "mlflow") if importlib.util.find_spec(b) is not None]


# --- logging backends -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def watched(tmp_path_factory, cache):
    """A 4-step run logged to every installed backend, interrupted inside step 4 (a SIGTERM-like
    SystemExit) after step 2's checkpoint, then resumed: step 3 reaches the backends twice."""
    tmp = tmp_path_factory.mktemp("watched")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_PROJECT": "moe_rl_test",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    run = tmp / "runs" / "watched" / "algo=grpo,seed=0"
    cfg = tiny_config(
        run,
        *FAULTS,
        cache=cache,
        steps=4,
        eval_every=2,
        checkpoint_every=2,
        log_every=2,
        experiment="watched",
        logger=f"[parquet,{','.join(BACKENDS)}]",
        results_dir=str(tmp / "runs"),
    )
    real_step = Trainer.step

    def interrupted(self, step):
        if step == 4:
            raise SystemExit("interrupted")
        return real_step(self, step)

    try:
        Trainer.step = interrupted
        with pytest.raises(SystemExit):
            train(cfg)
        Trainer.step = real_step
        assert json.loads((run / "status.json").read_text())["status"] == "running"
        ids = json.loads((run / "loggers.json").read_text())
        result = train(cfg)
    finally:
        Trainer.step = real_step
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert result["status"] in ("completed", "collapsed")
    assert json.loads((run / "loggers.json").read_text()) == ids  # the resume reopened the same backend runs
    frame = pd.read_parquet(run / "metrics.parquet")
    return {"run": run, "tmp": tmp, "frame": frame, "ids": ids}


def _expected(frame: pd.DataFrame, key: str) -> list[tuple[int, float]]:
    rows = frame[frame["key"] == key].sort_values("step")
    return list(zip(rows["step"].tolist(), rows["value"].tolist()))


KEYS = ("reward/mean", "task/accuracy", "route/old_vs_new/flip_rate")


def _assert_series(
    got: list[tuple[int, float]], expected: list[tuple[int, float]], key: str, rel: float = 1e-12
) -> None:
    assert [s for s, _ in got] == [s for s, _ in expected], key
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=rel), key


def _first_per_step(series: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return sorted(dict(reversed(series)).items())


def test_parquet_has_each_step_once_after_resume(watched) -> None:
    assert [s for s, _ in _expected(watched["frame"], "reward/mean")] == [1, 2, 3, 4]
    assert [s for s, _ in _expected(watched["frame"], "task/accuracy")] == [0, 2, 4]


@pytest.mark.skipif("tensorboard" not in BACKENDS, reason="tensorboard not installed (moe_rl[tensorboard])")
def test_tensorboard_event_files_mirror_the_parquet(watched) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(watched["run"] / "tensorboard"))
    events.Reload()
    for key in KEYS:
        got = [(e.step, e.value) for e in events.Scalars(key)]
        # exactly once per step: the resume purged the step 3 the interrupted process had logged
        _assert_series(got, _expected(watched["frame"], key), key, rel=1e-6)  # float32 in event files
    assert "config/text_summary" in events.Tags()["tensors"]


def _wandb_records(path: Path):
    """Records of a W&B transaction log (.wandb: LevelDB log format of wandb_internal_pb2.Record)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, chunk = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += block - pos % block
            continue
        chunk, pos = chunk + data[pos : pos + length], pos + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


@pytest.mark.skipif("wandb" not in BACKENDS, reason="wandb not installed (moe_rl[wandb])")
def test_wandb_offline_run_mirrors_the_parquet(watched) -> None:
    files = sorted(glob.glob(str(watched["run"] / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2  # the interrupted process and the resume, one W&B run id
    history: dict[str, list[tuple[int, float]]] = {}
    runs = []
    for path in files:
        for record in _wandb_records(Path(path)):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                runs.append(record.run)
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                for key in KEYS:
                    if key in items:
                        history.setdefault(key, []).append((items["_step"], float(items[key])))
    assert {r.run_id for r in runs} == {watched["ids"]["wandb"]}
    assert {(r.project, r.run_group, r.job_type, r.display_name) for r in runs} == {
        ("moe_rl_test", "watched", "grpo+none", "algo=grpo,seed=0")
    }
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert config["optim"]["lr"] == 3e-3 and config["steps"] == 4
    for key in KEYS:
        _assert_series(_first_per_step(history[key]), _expected(watched["frame"], key), key)


@pytest.mark.skipif("mlflow" not in BACKENDS, reason="mlflow not installed (moe_rl[mlflow])")
def test_mlflow_local_store_mirrors_the_parquet(watched) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{watched['tmp']}/mlflow.db")
    run = client.get_run(watched["ids"]["mlflow"])
    assert run.info.run_name == "algo=grpo,seed=0" and run.info.status == "FINISHED"
    assert run.data.tags["arm"] == "grpo+none" and run.data.params["optim.lr"] == "0.003"
    assert client.get_experiment(run.info.experiment_id).name == "watched"
    # artifacts sit beside the local store, never in ./mlruns of the working directory
    assert (watched["tmp"] / "mlartifacts").is_dir() and run.info.artifact_uri.startswith(
        (watched["tmp"] / "mlartifacts").resolve().as_uri()
    )
    for key in KEYS:
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        expected = _expected(watched["frame"], key)
        # step 3 ran twice (before the interrupt and after the resume), bitwise equal: MLflow keeps both
        assert len(got) == len(expected) + (key != "task/accuracy")
        _assert_series(_first_per_step(got), expected, key)


@pytest.mark.skipif(importlib.util.find_spec("trackio") is None, reason="trackio not installed (moe_rl[trackio])")
def test_trackio_local_run_mirrors_the_parquet(tmp_path, cache, monkeypatch) -> None:
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    run = tmp_path / "runs" / "tracked" / "seed=0"
    train(tiny_config(run, *FAULTS, cache=cache, steps=2, eval_every=2, experiment="tracked", logger="[trackio]"))
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs("tracked", "seed=0")
    frame = pd.read_parquet(run / "metrics.parquet")
    got = [(row["step"], row["reward/mean"]) for row in logs if "reward/mean" in row]
    _assert_series(got, _expected(frame, "reward/mean"), "reward/mean")


def test_unknown_or_missing_logger_is_rejected_at_validation(tmp_path, cache, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"logger entry 'tensorbored' is not valid; valid: \['mlflow', 'parquet'"):
        validate(tiny_config(tmp_path / "run", *FAULTS, cache=cache, logger="[tensorbored]"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ImportError, match=r"logger=wandb needs the 'wandb' package: pip install 'moe_rl\[wandb\]'"):
        train(tiny_config(tmp_path / "run", *FAULTS, cache=cache, logger="[parquet,wandb]"))
    assert not (tmp_path / "run").exists()


# --- progress ------------------------------------------------------------------------------------


def test_progress_formatting() -> None:
    assert [format_duration(s) for s in (12, 184, 3725, math.inf)] == ["12s", "3m04s", "1h02m", "?"]
    assert eta_seconds(20, 300, 10.0) == 140.0 and eta_seconds(0, 300, 10.0) == math.inf
    metrics = {"reward/mean": 0.4123, "route/old_vs_new/flip_rate": 0.03125}
    assert progress_fields(metrics, None) == {"reward": "0.41", "flip": "0.031"}  # never acc=nan
    assert progress_fields(metrics, float("nan")) == {"reward": "0.41", "flip": "0.031"}
    assert progress_line(20, 300, progress_fields(metrics, 0.375), 1.5, 184) == (
        "step 20/300 reward=0.41 flip=0.031 acc=0.38 1.50 steps/s ETA 3m04s"
    )


def test_progress_lines_go_to_train_log(watched) -> None:
    log = (watched["run"] / "train.log").read_text()
    lines = [line for line in log.splitlines() if "steps/s" in line]
    assert [line.split("step ")[1].split()[0] for line in lines] == ["2/4", "4/4"]
    assert all("acc=" in line and "ETA" in line for line in lines) and "acc=nan" not in log


# A multirun's progress ("k of n runs done" after each job) and its launch line are checked on the compare
# sweep's dry run, which test_experiments.test_multirun_dry_run launches anyway.


def test_a_launch_names_the_runs_it_skips_and_where_they_were_made(tmp_path) -> None:
    """Two of three run folders finished (one on another CPU), one to run: the line counts them, names each
    maker's CPU and numerics, and warns that the other CPU's pool members would be warmed again here."""
    from moe_rl.run.launch import launch_line

    def finished(name: str, vendor: str, numerics: str) -> Path:
        run = tmp_path / name
        run.mkdir()
        (run / "status.json").write_text(json.dumps({"status": "completed"}))
        (run / "metrics.parquet").write_bytes(b"")
        meta = {"cpu": {"vendor": vendor, "model": "CPU X"}, "numerics": numerics, "compiled": False}
        (run / "meta.json").write_text(json.dumps(meta))
        return run

    runs = [finished("a", "Here", "avx2"), finished("b", "There", "avx2"), tmp_path / "c"]
    line = launch_line(runs, this_cpu="Here CPU X")
    assert line.startswith(
        "sweep: 3 runs, 1 to run, 2 read as finished (skipped) made on Here CPU X, numerics avx2 (1); "
        "There CPU X, numerics avx2 (1). WARNING: 1 of them were made on another CPU than this one (Here CPU X)"
    )
    assert "WARNING" not in launch_line(runs[:2], this_cpu="Here CPU X")  # nothing left to run: nothing warmed


# --- status.json on every failure ------------------------------------------------------------------


@pytest.mark.parametrize("where", ["cold_start", "step0_eval", "step"])
def test_failure_anywhere_leaves_failed_status_with_reason(tmp_path, cache, monkeypatch, where: str) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError(f"boom in {where}")

    real_step = Trainer.step
    if where == "cold_start":
        monkeypatch.setattr("moe_rl.train.get_cold_start", boom)
    elif where == "step0_eval":
        monkeypatch.setattr(Trainer, "evaluate", boom)
    else:
        monkeypatch.setattr(Trainer, "step", lambda self, step: boom() if step == 2 else real_step(self, step))
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match=f"boom in {where}"):
        train(tiny_config(run, *FAULTS, cache=cache, steps=3))
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed"
    assert status["error"] == {"type": "RuntimeError", "message": f"boom in {where}"}
    assert status["steps_done"] == (1 if where == "step" else 0)
    log = (run / "train.log").read_text()
    assert "Traceback (most recent call last)" in log and f"RuntimeError: boom in {where}" in log
    if where == "step":
        assert sorted(pd.read_parquet(run / "metrics.parquet")["step"].unique()) == [0, 1]


# An invalid config launched under Hydra marks its out_dir invalid (status.json, its error, no metrics): the launch
# of test_cli.test_a_bad_config_value_ends_the_launch_with_its_one_line_and_marks_its_folder_invalid, which also
# checks what it prints.


# --- checkpoints that cannot run code -----------------------------------------------------------------


class Payload:
    """Unpickling this object runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_with_a_pickle_payload_is_refused_and_runs_nothing(tmp_path, cache) -> None:
    cfg = tiny_config(tmp_path / "run", *FAULTS, cache=cache, steps=4, keep_checkpoint="true")
    train(cfg)
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    state = load_checkpoint(checkpoint)  # an honest checkpoint loads with weights_only=True
    marker = tmp_path / "pwned"
    state["events"] = [Payload(marker)]
    save_checkpoint(checkpoint, state)
    (tmp_path / "run" / "status.json").unlink()
    with pytest.raises(CorruptFileError, match="holds objects other than plain data"):
        Trainer(cfg).run()
    assert not marker.exists()
    assert json.loads((tmp_path / "run" / "status.json").read_text())["error"]["type"] == "CorruptFileError"
    with pytest.raises(pickle.UnpicklingError):
        torch.load(checkpoint, weights_only=True)
    torch.load(checkpoint, weights_only=False)  # the payload is real: a full unpickle runs it
    assert marker.exists()


def test_rng_state_round_trips_through_weights_only(tmp_path) -> None:
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    np.random.standard_normal()  # a cached Gaussian in numpy's state
    save_checkpoint(tmp_path / "rng.pt", {"rng": rng_state()})
    expected = (torch.rand(3), random.random(), np.random.standard_normal(2))
    set_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])
    got = (torch.rand(3), random.random(), np.random.standard_normal(2))
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and np.array_equal(got[2], expected[2])


# --- readable metrics --------------------------------------------------------------------------------


def test_load_results_wide_has_one_row_per_run_and_step(watched) -> None:
    long = load_results(watched["run"].parent)
    wide = load_results(watched["run"].parent, wide=True)
    assert len(wide) == long.groupby(["run", "step"]).ngroups == 5
    assert wide["step"].tolist() == [0, 1, 2, 3, 4] and wide["arm"].unique().tolist() == ["grpo+none"]
    frame = watched["frame"]
    for key in KEYS:
        expected = dict(_expected(frame, key))
        got = {s: v for s, v in zip(wide["step"], wide[key]) if not math.isnan(v)}
        assert got == expected, key
    assert math.isnan(wide.loc[wide["step"] == 1, "task/accuracy"].item())  # no evaluation at step 1
