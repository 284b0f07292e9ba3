"""Live logging backends that mirror metrics.parquet: TensorBoard, W&B, MLflow, trackio.

`metrics.parquet` stays the source of truth (analysis, reports and resume read only it); a
backend is a window onto a running job, chosen with `logger=[parquet,tensorboard,...]`. Each one
is an optional extra (`pip install 'moe_rl[wandb]'`), imported only when chosen, and checked at
validation so a missing package fails before any work. Every backend gets the same `/`-namespaced
keys and steps as the parquet, the resolved config once, a run name from the run folder and a
group from the experiment and arm; a resumed run continues the same backend run where the backend
allows it (ids are kept in the run folder's `loggers.json`).

Backends, what they write and how a resume continues:
    tensorboard  <run>/tensorboard/ event files; a resume purges the steps after the checkpoint
    wandb        a W&B run (project $WANDB_PROJECT, default moe_rl; group = experiment, job type
                 = arm); its files under <run>/wandb/; same run id on resume (resume="allow");
                 W&B ignores steps it already has, so steps logged after the last checkpoint of
                 a killed run keep their first values there. WANDB_MODE=offline works offline.
    mlflow       an MLflow run in experiment `experiment` (tracking URI $MLFLOW_TRACKING_URI, default
                 sqlite:///<results_dir>/mlflow.db); same run id on resume, so steps logged after the
                 last checkpoint of a killed run appear twice in its history
    trackio      a trackio run in project `experiment`, group = arm (local, $TRACKIO_DIR);
                 resume="allow" on the run name
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from moe_rl.metrics.status import COLLAPSED, COMPLETED, DIVERGED, FAILED, RUNNING
from moe_rl.run.atomic import write_atomic

log = logging.getLogger(__name__)

# backend name -> (module that must be importable, the extra that installs it)
BACKENDS: dict[str, tuple[str, str] | None] = {
    "parquet": None,  # always written by RunWriter; listed so that logger=[parquet] reads naturally
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}
IDS_FILE = "loggers.json"
# the statuses the backends report as a run that ended well (W&B exit code 0, MLflow FINISHED)
ENDED_WELL = (COMPLETED, COLLAPSED, DIVERGED)


class Backend(Protocol):
    """What the run writer calls: `log` per step, `close` once with the run's final status."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, status: str) -> None: ...


def check_loggers(names: list[str]) -> None:
    """Raise (before any work) for an unknown backend or one whose package is not installed."""
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"logger entry {name!r} is not valid; valid: {sorted(BACKENDS)}")
        need = BACKENDS[name]
        if need is not None and importlib.util.find_spec(need[0]) is None:
            raise ImportError(f"logger={name} needs the {need[0]!r} package: pip install 'moe_rl[{need[1]}]'")


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes (POSIX flock), released on exit."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class TensorBoardBackend:
    def __init__(self, run_dir: Path, info: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides what a killed process logged after the checkpoint the run resumes from
        self.writer = SummaryWriter(
            str(run_dir / "tensorboard"), purge_step=info["resumed_after"] + 1 if info["resumed_after"] else 0
        )
        if not info["resumed_after"]:
            self.writer.add_text("config", "```\n" + json.dumps(info["config"], indent=1, default=str) + "\n```")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.add_text("status", status)
        self.writer.close()


class WandbBackend:
    def __init__(self, run_dir: Path, info: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "moe_rl"),
            name=info["name"],
            group=info["experiment"],
            job_type=info["arm"],
            tags=[info["experiment"], info["arm"]],
            id=info["id"],
            resume="allow",
            dir=str(run_dir),
            config=info["config"],
            reinit="create_new",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, status: str) -> None:
        self.run.summary["status"] = status
        self.run.finish(exit_code=0 if status in ENDED_WELL else 1)


class MlflowBackend:
    def __init__(self, run_dir: Path, info: dict[str, Any]) -> None:
        from mlflow import MlflowClient

        results = Path(info["results_dir"]).resolve()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{results}/mlflow.db"
        results.mkdir(parents=True, exist_ok=True)
        # parallel jobs of a sweep would race to create the store's tables and the experiment
        with _file_lock(results / ".mlflow.lock"):
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(info["experiment"])
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:  # a local store keeps its artifacts beside it, not in ./mlruns of whatever the cwd is
                local = uri.startswith("sqlite:///")
                store = Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts"
                experiment_id = self.client.create_experiment(
                    info["experiment"], artifact_location=store.resolve().as_uri() if local else None
                )
        run_id = info["ids"].get("mlflow") if info["resumed_after"] else None
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
        else:
            tags = {
                "arm": info["arm"],
                "experiment": info["experiment"],
                "run_dir": str(run_dir),
                "mlflow.runName": info["name"],
            }
            run_id = self.client.create_run(experiment_id, run_name=info["name"], tags=tags).info.run_id
            from mlflow.entities import Param

            params = [Param(k, str(v)[:6000]) for k, v in _flat(info["config"]).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[i : i + 100])
            self.client.log_text(run_id, json.dumps(info["config"], indent=1, default=str), "config.json")
        self.run_id = run_id
        info["ids"]["mlflow"] = run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), stamp, step) for k, v in metrics.items()])

    def close(self, status: str) -> None:
        self.client.set_tag(self.run_id, "status", status)
        state = {**dict.fromkeys(ENDED_WELL, "FINISHED"), RUNNING: "KILLED"}
        self.client.set_terminated(self.run_id, state.get(status, "FAILED"))


class TrackioBackend:
    def __init__(self, run_dir: Path, info: dict[str, Any]) -> None:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(
            project=info["experiment"],
            name=info["name"],
            group=info["arm"],
            config=_flat(info["config"]),
            resume="allow",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, status: str) -> None:
        self.run.finish()


FACTORIES = {
    "tensorboard": TensorBoardBackend,
    "wandb": WandbBackend,
    "mlflow": MlflowBackend,
    "trackio": TrackioBackend,
}


def open_loggers(
    names: list[str],
    run_dir: str | Path,
    *,
    keys: dict[str, Any],
    config: dict[str, Any],
    results_dir: str,
    resumed_after: int,
) -> list[Backend]:
    """Start the chosen backends for one run (each logs `config` once; parquet needs nothing here).

    A fresh start (`resumed_after == 0`) opens new backend runs; a resume reopens the ids saved
    in `<run_dir>/loggers.json`.
    """
    run_dir = Path(run_dir)
    chosen = [n for n in dict.fromkeys(names) if n != "parquet"]
    if not chosen:
        return []
    check_loggers(chosen)
    ids_path = run_dir / IDS_FILE
    ids: dict[str, str] = {}
    if resumed_after and ids_path.is_file():
        ids = json.loads(ids_path.read_text())
    if "wandb" not in ids:
        prefix = re.sub(r"[^A-Za-z0-9_-]", "-", str(keys.get("experiment", "run")))[:24]  # W&B id characters
        ids["wandb"] = f"{prefix}-{uuid.uuid4().hex[:12]}"
    info = {
        "name": str(keys.get("run", run_dir.name)),
        "experiment": str(keys.get("experiment", "default")),
        "arm": f"{keys.get('algo')}+{keys.get('replay')}",
        "config": config,
        "results_dir": results_dir,
        "resumed_after": resumed_after,
        "ids": ids,
        "id": ids["wandb"],
    }
    backends: list[Backend] = []
    try:
        for name in chosen:
            backends.append(FACTORIES[name](run_dir, info))
    except BaseException:
        for backend in backends:
            backend.close(FAILED)
        raise
    write_atomic(ids_path, json.dumps(ids, indent=1))
    return backends
