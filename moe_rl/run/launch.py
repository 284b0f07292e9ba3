"""What a launch from the command line needs of the run layer (`experiments/train.py`, whose
`run_from_hydra` is the glue between Hydra's composed config and `train(cfg)`; `python -m moe_rl.forecast`):
the run folder's name (Hydra's `short_name` and `or_default` resolvers, registered on import), the old
spelling of a preset refused, a finished folder recognised, the line an interrupted run ends with, and
a sweep's progress (Hydra's callback `SweepProgress`, named in `experiments/conf/config.yaml`)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from moe_rl.metrics.status import FINISHED
from moe_rl.run.folder import RunDirectoryError, read_status
from moe_rl.run.progress import eta_seconds, format_duration

log = logging.getLogger(__name__)


def short_name(name: str, limit: int = 96) -> str:
    """A run directory name (and run id): Hydra's override string, or its head plus a hash when too long.

    `/` in a value (e.g. `model.checkpoint=/a/ckpt`) is written `%2F` (and `%` as `%25`), so the name
    is one folder, never a nested path, and stays unique: two checkpoints ending in the same folder
    name do not share a run id.
    """
    if not name:
        return "default"
    safe = name.replace("%", "%25").replace("/", "%2F")
    if len(safe) <= limit:
        return safe
    return f"{safe[: limit - 17]}~{hashlib.sha1(name.encode()).hexdigest()[:16]}"


def or_default(value: str | None, default: str) -> str:
    """`value` unless it is unset: `hydra.run.dir: ${or_default:${out_dir},...}` honours out_dir."""
    return default if value in (None, "") else str(value)


if not OmegaConf.has_resolver("short_name"):
    OmegaConf.register_new_resolver("short_name", short_name)
if not OmegaConf.has_resolver("or_default"):
    OmegaConf.register_new_resolver("or_default", or_default)


def old_preset_spelling(args: list[str]) -> str | None:
    """The one line that refuses the old spelling of a preset, or None when `args` do not use it.

    Presets (`experiments/conf/preset/NAME.yaml`) are the config group `preset`: `+preset=smoke` loads
    one, and `experiment=NAME` is the run's name alone, so a preset and a name go together
    (`+preset=smoke experiment=mine`). The group was once called `experiment` too: `+experiment=smoke`.
    """
    for arg in args:
        key, sep, name = arg.partition("=")
        if sep and key == "+experiment":
            return f"`{arg}` is now `+preset={name}` (experiment=NAME names the run)"
    return None


def refuse_old_preset_spelling(args: list[str]) -> None:
    """Exit (status 1) with `old_preset_spelling`'s line when `args` use the old spelling."""
    line = old_preset_spelling(args)
    if line is not None:
        raise SystemExit(f"error: {line}")


def interrupted_line(out_dir: str | Path, checkpoint_every: int) -> str:
    """The one line a Ctrl-C ends with: where the run stopped and what rerunning the command does."""
    done = int(read_status(out_dir).get("steps_done", 0))
    saved = done // checkpoint_every * checkpoint_every if checkpoint_every else 0
    if saved:
        return f"interrupted after step {done}: rerun the same command to resume from step {saved} ({out_dir})"
    return (
        f"interrupted after step {done}, before its first checkpoint (checkpoint_every={checkpoint_every}): "
        f"rerunning the same command starts the run over ({out_dir})"
    )


def finished_status(out_dir: str | Path, config_hash: str | None) -> str | None:
    """The status of a run directory whose outputs are complete, else None.

    A finished directory of another config (`config_hash`: `moe_rl.config.config_hash` of the launch's
    config) is an error, not a run to skip or overwrite; `config_hash` None reads the status without that
    check (a launcher asking which runs are done before it composes their configs).
    """
    path = Path(out_dir) / "status.json"
    try:
        doc = json.loads(path.read_text())
        status = doc["status"]
    except (OSError, ValueError, KeyError):
        return None
    if status not in FINISHED or not (Path(out_dir) / "metrics.parquet").is_file():
        return None
    if config_hash is not None and doc.get("config_hash") != config_hash:
        raise RunDirectoryError(
            f"{out_dir} holds a finished run of another config; choose another directory or delete it"
        )
    return status


class SweepProgress(Callback):
    """Hydra callback: after each job of a multirun, log "k of n runs done" and the sweep's ETA.

    Jobs may run in other processes (joblib, submitit), so the count lives in the sweep folder:
    `.sweep_progress/start.json` (n and the start time) and one marker file per finished job.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = Path(config.hydra.sweep.dir) / ".sweep_progress"
        folder.mkdir(parents=True, exist_ok=True)
        for marker in folder.glob("job-*"):
            marker.unlink(missing_ok=True)  # two runs of one cell launched at once clear the same markers
        (folder / "start.json").write_text(json.dumps({"n": sweep_size(config), "start": time.time()}))
        dirs = sweep_run_dirs(config)
        if dirs is not None:
            log.info("%s", launch_line(dirs))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        folder = Path(config.hydra.sweep.dir) / ".sweep_progress"
        try:
            start = json.loads((folder / "start.json").read_text())
        except (OSError, ValueError):
            return  # a single run, or the sweep folder was moved
        (folder / f"job-{config.hydra.job.num}").touch()
        done = len(list(folder.glob("job-*")))
        n = start["n"]
        eta = eta_seconds(done, n, time.time() - start["start"]) if n else float("nan")
        log.info("%d of %s runs done (sweep ETA %s)", done, n or "?", format_duration(eta))


def _jobs(config: DictConfig) -> list[list[str]] | None:
    """The override lists of the jobs the basic sweeper makes of `hydra.sweeper.params` plus the command line
    (None for another sweeper, e.g. optuna, whose jobs are not known ahead)."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
        overrides = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
        return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
    except Exception:  # noqa: BLE001 - another sweeper: unknown
        return None


def sweep_size(config: DictConfig) -> int | None:
    """Number of jobs the basic sweeper makes of `hydra.sweeper.params` plus the command line."""
    jobs = _jobs(config)
    return None if jobs is None else len(jobs)


def sweep_run_dirs(config: DictConfig) -> list[Path] | None:
    """Each job's run folder, named as Hydra names it (`hydra.sweep.subdir`: `short_name` of the job's
    override_dirname), when the sweep's jobs are known and its subdir is that name."""
    jobs = _jobs(config)
    if jobs is None or "short_name:${hydra.job.override_dirname}" not in str(
        OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")  # type: ignore[union-attr]
    ):
        return None
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser

    naming = config.hydra.job.config.override_dirname
    parser = OverridesParser.create()
    names = [
        get_overrides_dirname(parser.parse_overrides(job), list(naming.exclude_keys), naming.item_sep, naming.kv_sep)
        for job in jobs
    ]
    return [Path(config.hydra.sweep.dir) / short_name(name) for name in names]


def launch_line(run_dirs: list[Path], this_cpu: str | None = None) -> str:
    """What a multirun is about to do: how many runs it runs, how many it reads as finished (skipped, not rerun)
    and on which CPUs and numerics domains those were made; a warning where another CPU made some, since a pool
    member that CPU warmed is warmed again here (a twin of the same start, not a new one)."""
    from collections import Counter

    from moe_rl.run.folder import cpu_id, recorded_cpu_id

    this_cpu = this_cpu or cpu_id()
    made: Counter[str] = Counter()
    elsewhere = 0
    for run_dir in run_dirs:
        if finished_status(run_dir, None) is None:
            continue
        try:
            meta = json.loads((run_dir / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
        machine = recorded_cpu_id(meta.get("cpu") or {})
        made[
            f"{machine}, numerics {meta.get('numerics') or 'native'}{', compiled' if meta.get('compiled') else ''}"
        ] += 1
        elsewhere += machine != this_cpu
    done = sum(made.values())
    line = f"sweep: {len(run_dirs)} runs, {len(run_dirs) - done} to run, {done} read as finished (skipped)"
    if done:
        line += " made on " + "; ".join(f"{what} ({n})" for what, n in sorted(made.items()))
    if elsewhere and done < len(run_dirs):
        line += (
            f". WARNING: {elsewhere} of them were made on another CPU than this one ({this_cpu}); the pool members "
            "their runs share with the runs to come are warmed again here, a twin of each start, not a new start"
        )
    return line
