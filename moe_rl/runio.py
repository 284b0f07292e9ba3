"""A run directory on disk: atomic files, streamed metrics, checkpoints (DESIGN §3 run outputs).

Layout of one run:
    config.yaml           resolved config
    meta.json             git sha, library versions, device, seed, run keys, cold start
    metrics.parquet       long format (run keys..., step, key, value), rewritten at each flush
    metrics/part-*.parquet  the same rows, one file per flush, so memory stays flat
    status.json           running | completed | collapsed | diverged | failed, with collapse events
    checkpoint.pt         model, optimizer, scheduler, RNG states, step, events (every K steps)
    routes/step_*.safetensors  route snapshots
Every file is written to a temporary name and renamed, so a reader never sees a partial file.
"""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from moe_rl.atomic import write_atomic

STATUSES = {
    "running": "the run is in progress, or was killed (rerun the same command to resume)",
    "completed": "all steps ran and no collapse trigger fired",
    "collapsed": "all steps ran; a collapse trigger (reward drop, entropy collapse) fired on the way",
    "diverged": "a non-finite loss, gradient or log-prob: the run stopped at that step",
    "failed": "an exception other than divergence stopped the run (see the log)",
}
FINISHED = ("completed", "collapsed", "diverged")


class CorruptFileError(RuntimeError):
    """A run file that exists but cannot be read; it is never silently reused."""


class RunWriter:
    """Owns a run directory. Metric rows are buffered between flushes only."""

    def __init__(self, out_dir: str | Path, keys: dict[str, Any], *, config_hash: str = "") -> None:
        self.dir = Path(out_dir)
        self.config_hash = config_hash
        self.dir.mkdir(parents=True, exist_ok=True)
        self.parts = self.dir / "metrics"
        self.keys = keys
        self.rows: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []

    def write_config(self, cfg_dict: dict[str, Any]) -> None:
        from omegaconf import OmegaConf

        write_atomic(self.dir / "config.yaml", OmegaConf.to_yaml(cfg_dict))

    def write_meta(self, **extra: Any) -> None:
        import transformers

        meta = {
            "git_sha": _git_sha(), "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                                "python": platform.python_version()},
            "device": _device_name(), "seed": self.keys["seed"], "run_keys": self.keys, **extra,
        }
        write_atomic(self.dir / "meta.json", json.dumps(meta, indent=1, default=str))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rows += [{"step": step, "key": k, "value": float(v)} for k, v in metrics.items()]

    def _frame(self, rows: list[dict[str, Any]]) -> pd.DataFrame:
        frame = pd.DataFrame(rows, columns=["step", "key", "value"]).astype({"step": "int64", "value": "float64"})
        for column, value in reversed(self.keys.items()):
            frame.insert(0, column, value)
        return frame

    def flush(self, status: str, steps_done: int, wall_s: float) -> None:
        """Write buffered rows as a new part, rebuild metrics.parquet from the parts, write status."""
        if self.rows:
            self.parts.mkdir(exist_ok=True)
            last = max(r["step"] for r in self.rows)
            write_atomic(self.parts / f"part-{last:07d}.parquet", self._frame(self.rows).to_parquet(index=False))
            self.rows = []
        self._consolidate()
        doc = {"status": status, "steps_done": steps_done, "collapse_events": self.events, "wall_s": wall_s,
               "config_hash": self.config_hash}
        write_atomic(self.dir / "status.json", json.dumps(doc, indent=1))

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
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # truncated zip, unpickling errors, ...: report by name, never reuse
        raise CorruptFileError(
            f"checkpoint {path} is corrupt or truncated ({type(err).__name__}: {err}); "
            "delete it (and the run directory's metrics/) to restart the run"
        ) from err


def rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state = {"torch": torch.random.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.random.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()})"
