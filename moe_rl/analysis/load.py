"""Load run folders into one long-format DataFrame.

A run is a directory holding `metrics.parquet` (run keys, step, key, value), `status.json`,
`meta.json` and `config.yaml`. Any directory tree of runs is a results folder.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from os import PathLike
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from moe_rl.metrics.status import COLLAPSED, DIVERGED, FAILED, MISSING, RUNNING

VALUE_COLUMNS = ("step", "key", "value")
# columns added by load_results; everything else except VALUE_COLUMNS is a run key
RUN_INFO_COLUMNS = ("status", "n_collapse_events", "first_collapse_step", "run_dir")
INCOMPLETE_STATUSES = frozenset({RUNNING, FAILED, MISSING})
COLLAPSED_STATUSES = frozenset({COLLAPSED, DIVERGED})
EVENT_COLUMNS = ("step", "trigger", "detail", "run_dir")


def run_key_columns(df: pd.DataFrame) -> list[str]:
    """Columns that identify a run (every column but step/key/value and the loader's run info)."""
    return [c for c in df.columns if c not in VALUE_COLUMNS and c not in RUN_INFO_COLUMNS]


def _metric_files(root: Path) -> list[Path]:
    if not root.exists():
        raise FileNotFoundError(f"results folder {root} does not exist")
    files = sorted(root.rglob("metrics.parquet"))
    if not files:
        raise FileNotFoundError(f"no runs under {root}: no metrics.parquet found (searched recursively)")
    return files


def _read_status(run_dir: Path) -> dict:
    """status.json as a dict; status "missing" when the file is absent or unreadable."""
    path = run_dir / "status.json"
    if not path.exists():
        return {"status": MISSING, "collapse_events": []}
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        warnings.warn(f"unreadable {path} ({err}); treating the run as incomplete", stacklevel=3)
        return {"status": MISSING, "collapse_events": []}
    return {
        "status": str(status.get("status", MISSING)),
        "collapse_events": list(status.get("collapse_events") or []),
        "collapse_rule": status.get("collapse_rule"),
    }


def _first_collapse_step(events: list[dict]) -> float:
    steps = [float(e["step"]) for e in events if e.get("step") is not None]
    return min(steps) if steps else np.nan


def _default_run_id(run_dir: Path, root: Path) -> str:
    rel = run_dir.relative_to(root).as_posix()
    return run_dir.name if rel == "." else rel


def load_results(root: str | PathLike, *, keys: Sequence[str] | None = None, wide: bool = False) -> pd.DataFrame:
    """Every run under `root`, concatenated in long format (only metric `keys` when given;
    `wide=True`: one row per run and step, see `to_wide`).

    Runs labelled by different versions of the collapse rule (status.json's `collapse_rule`) are refused with a
    ValueError naming them: their collapse labels are not one measurement.
    Adds per-run columns `status` (from status.json; "missing" without one),
    `n_collapse_events`, `first_collapse_step` (NaN if none) and `run_dir`. Runs whose status is
    running/failed/missing are kept and named in a warning. A metrics.parquet that cannot be read
    is skipped with a warning; runs whose run id is also logged by another folder are named by
    their folder relative to `root` (with a warning), so no run is dropped.
    """
    root = Path(root)
    loaded: list[tuple[Path, pd.DataFrame]] = []
    for path in _metric_files(root):
        run_dir = path.parent
        try:
            frame = pd.read_parquet(path, filters=[("key", "in", list(keys))] if keys is not None else None)
        except Exception as err:  # corrupt or half-written file: skip it, keep the rest
            warnings.warn(f"skipping unreadable {path}: {type(err).__name__}: {err}", stacklevel=2)
            continue
        missing = [c for c in VALUE_COLUMNS if c not in frame.columns]
        if missing:
            warnings.warn(f"skipping {path}: missing column(s) {missing}", stacklevel=2)
            continue
        if frame.empty:
            if keys is None:
                warnings.warn(f"skipping {path}: no rows", stacklevel=2)
            continue
        if "run" not in frame.columns:
            frame.insert(0, "run", _default_run_id(run_dir, root))
        frame["run"] = frame["run"].astype(str)
        loaded.append((run_dir, frame))

    # a run id logged by several folders (e.g. runs of one sweep whose folder names ended alike):
    # each of them is named by its folder relative to root instead, which is unique and stable
    dirs_of: dict[str, set[Path]] = {}
    for run_dir, frame in loaded:
        for r in frame["run"].unique():
            dirs_of.setdefault(r, set()).add(run_dir)
    clash = {r for r, d in dirs_of.items() if len(d) > 1}
    if clash:
        warnings.warn(
            f"run id(s) {sorted(clash)} found in several folders; naming those runs by their folder relative to {root}",
            stacklevel=2,
        )
    frames: list[pd.DataFrame] = []
    rules: dict[object, list[Path]] = {}
    for run_dir, frame in loaded:
        if clash:
            rel = run_dir.relative_to(root).as_posix()
            single = frame["run"].nunique() == 1
            names = {r: r if r not in clash else (rel if single else f"{rel}/{r}") for r in frame["run"].unique()}
            frame["run"] = frame["run"].map(names)
        status = _read_status(run_dir)
        if status.get("collapse_rule") is not None:  # unread or absent: no label to compare
            rules.setdefault(status["collapse_rule"], []).append(run_dir)
        frame = frame.assign(
            step=frame["step"].astype("int64"),
            value=frame["value"].astype("float64"),
            status=status["status"],
            n_collapse_events=len(status["collapse_events"]),
            first_collapse_step=_first_collapse_step(status["collapse_events"]),
            run_dir=str(run_dir),
        )
        frames.append(frame)
    if not frames:
        raise FileNotFoundError(f"no readable runs under {root}: every metrics.parquet failed to load")
    if len(rules) > 1:  # a collapse count over runs judged by two rules would mean neither
        listed = "; ".join(
            f"version {v}: {len(d)} run(s), e.g. {d[0].relative_to(root).as_posix()}" for v, d in sorted(rules.items())
        )
        raise ValueError(
            f"runs under {root} were labelled by different versions of the collapse rule ({listed}); relabel them "
            "with one (scripts/relabel_collapse.py) before pooling them"
        )
    df = pd.concat(frames, ignore_index=True)
    df["n_collapse_events"] = df["n_collapse_events"].astype("int64")
    df["first_collapse_step"] = df["first_collapse_step"].astype("float64")
    keys = ["run"] + [c for c in run_key_columns(df) if c != "run"]
    df = df[keys + list(VALUE_COLUMNS) + list(RUN_INFO_COLUMNS)]
    incomplete = df.loc[df["status"].isin(INCOMPLETE_STATUSES), ["run", "status"]].drop_duplicates()
    if len(incomplete):
        listed = ", ".join(f"{r} ({s})" for r, s in incomplete.itertuples(index=False))
        warnings.warn(f"{len(incomplete)} incomplete run(s) loaded: {listed}", stacklevel=2)
    return to_wide(df) if wide else df


def to_wide(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, step), one column per metric key (NaN where a step did not log the key,
    e.g. `task/accuracy` between evaluations); run keys and run info stay as columns."""
    index = [c for c in df.columns if c not in ("key", "value")]
    info = df.drop_duplicates("run").set_index("run")[[c for c in index if c not in ("run", "step")]]
    wide = df.pivot_table(index=["run", "step"], columns="key", values="value", aggfunc="last", dropna=False)
    wide = wide.dropna(how="all").reset_index()
    wide.columns.name = None
    wide = info.join(wide.set_index("run"), how="inner").reset_index()
    return wide[["run", *[c for c in index if c not in ("run", "step")], "step", *sorted(df["key"].unique())]]


def _run_keys(path: Path, root: Path) -> dict:
    """Run keys of one run: the first row of metrics.parquet, else meta.json's run_keys."""
    try:
        import pyarrow.parquet as pq

        names = [n for n in pq.read_schema(path).names if n not in VALUE_COLUMNS]
        first = pd.read_parquet(path, columns=names).head(1)
        if len(first):
            keys = first.iloc[0].to_dict()
            keys.setdefault("run", _default_run_id(path.parent, root))
            return keys
    except Exception:  # fall back to meta.json below
        pass
    keys = {"run": _default_run_id(path.parent, root)}
    try:
        keys.update(json.loads((path.parent / "meta.json").read_text()).get("run_keys", {}))
    except (OSError, ValueError):
        pass
    return keys


def load_events(root: str | PathLike) -> pd.DataFrame:
    """Collapse events of every run under `root`: run keys, step, trigger, detail, run_dir."""
    root = Path(root)
    rows: list[dict] = []
    key_names: dict[str, None] = {"run": None}  # ordered union of run-key names
    statuses = [(path, _read_status(path.parent)) for path in _metric_files(root)]
    found = [(path, status, _run_keys(path, root)) for path, status in statuses if status["collapse_events"]]
    dirs_of: dict[str, set[Path]] = {}
    for path, _, keys in found:
        dirs_of.setdefault(str(keys["run"]), set()).add(path.parent)
    for path, status, keys in found:
        if len(dirs_of[str(keys["run"])]) > 1:  # the same renaming as load_results
            keys = {**keys, "run": path.parent.relative_to(root).as_posix()}
        key_names.update(dict.fromkeys(keys))
        for event in status["collapse_events"]:
            rows.append(
                {
                    **keys,
                    "step": event.get("step"),
                    "trigger": str(event.get("trigger", "")),
                    "detail": str(event.get("detail", "")),
                    "run_dir": str(path.parent),
                }
            )
    events = pd.DataFrame(rows, columns=list(key_names) + list(EVENT_COLUMNS))
    if len(events):
        steps = pd.to_numeric(events["step"], errors="coerce")
        events["step"] = steps.astype("int64") if steps.notna().all() else steps
        events = events.sort_values(["run", "step"], ignore_index=True)
    return events


# defaults for a frame not made by load_results (e.g. parquet files concatenated by hand)
_INFO_DEFAULTS = {"status": "unknown", "n_collapse_events": 0, "first_collapse_step": np.nan, "run_dir": ""}


def runs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: run keys, status, collapse info, run_dir and the last logged step."""
    table = df.drop_duplicates("run")[run_key_columns(df)].reset_index(drop=True)
    for col, default in _INFO_DEFAULTS.items():
        table[col] = df.drop_duplicates("run")[col].to_numpy() if col in df.columns else default
    table["last_step"] = table["run"].map(df.groupby("run")["step"].max())
    return table


def metric_keys(df: pd.DataFrame) -> list[str]:
    """Sorted metric keys present in `df`."""
    return sorted(df["key"].unique())


def run_lr(run_dir: str | PathLike) -> float:
    """The lr a run trained at (its config.yaml)."""
    return float((yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {})["optim"]["lr"])
