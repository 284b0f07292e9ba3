"""Where a folder of runs came from: the commits, CPUs, kernel sets and versions their meta.json record.

A run's last bits depend on the CPU kernels torch dispatches to (chosen by instruction set), and with
`numerics=avx2` still on the CPU's vendor and model, so a report names them beside the commits; see
docs/reproducing.md.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from moe_rl.run.code import checkout_root, rebuildable

COLUMNS = [
    "run",
    "git_sha",
    "git_dirty",
    "code",
    "shipped_in",
    "cpu",
    "capability",
    "numerics",
    "torch",
    "transformers",
]


def _metas(root: Path) -> Iterator[tuple[Path, dict]]:
    """Every readable meta.json under `root`, in path order, with its parsed contents (unreadable ones skipped)."""
    for meta_path in sorted(root.rglob("meta.json")):
        try:
            yield meta_path, json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue


def load_provenance(results_dir: str | Path) -> pd.DataFrame:
    """One row per run folder under `results_dir` (a folder holding meta.json) with what made it; runs
    written before a field was recorded have None there."""
    rows = []
    root = Path(results_dir)
    repo = checkout_root()
    for meta_path, meta in _metas(root):
        cpu = meta.get("cpu") or {}
        env = cpu.get("env") or {}
        versions = meta.get("versions") or {}
        sha = meta.get("git_sha")
        rows.append(
            {
                "run": meta_path.parent.relative_to(root).as_posix(),
                "git_sha": None if sha in (None, "unknown") else sha,
                "git_dirty": meta.get("git_dirty"),
                # None: rebuildable from this repository (moe_rl.run.code), else why not
                "code": rebuildable(meta_path.parent, meta, repo) if repo else "this checkout is not a repository",
                "shipped_in": meta.get("shipped_in"),
                "cpu": cpu.get("model"),
                "capability": cpu.get("capability"),
                "numerics": meta.get("numerics")
                or ("avx2" if env.get("ATEN_CPU_CAPABILITY") == "avx2" and "MKL_CBWR" in env else "native"),
                "torch": versions.get("torch"),
                "transformers": versions.get("transformers"),
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def _counted(values: pd.Series, short: int | None = None) -> str:
    counts = Counter(str(v)[:short] if short else str(v) for v in values.dropna())
    return ", ".join(f"`{v}` ({n})" if short else f"{v} ({n})" for v, n in sorted(counts.items()))


def provenance_line(frame: pd.DataFrame) -> str:
    """One sentence for a report: commits (runs each), dirty trees, CPUs and kernel sets, versions."""
    if frame.empty:
        return "Provenance: no run records a meta.json."
    parts = []
    known = frame["git_sha"].notna()
    if known.any():
        parts.append(f"commits {_counted(frame.loc[known, 'git_sha'], 7)}")
        dirty = int(frame["git_dirty"].eq(True).sum())
        if dirty:
            parts.append(f"{dirty} of them from a tree with uncommitted changes")
    parts.append(code_clause(frame))
    if (~known).any():
        shipped = _counted(frame.loc[~known, "shipped_in"], 7)
        parts.append(
            f"{int((~known).sum())} run(s) recorded no commit"
            + (f" (shipped in {shipped}: made by that code or earlier)" if shipped else "")
        )
    if frame["cpu"].notna().any():
        parts.append(f"CPUs {_counted(frame['cpu'])}")
    if frame["capability"].notna().any():
        parts.append(f"torch kernels {_counted(frame['capability'])}, numerics {_counted(frame['numerics'])}")
    parts.append(f"torch {_counted(frame['torch'])}, transformers {_counted(frame['transformers'])}")
    return "Provenance (meta.json): " + "; ".join(parts) + "."


def code_clause(frame: pd.DataFrame) -> str:
    """How many runs' code this repository rebuilds (`python -m moe_rl.reproduce` reruns them with it), and why not
    the others, counted by reason."""
    missing = frame["code"].dropna()
    clause = f"code rebuildable for {len(frame) - len(missing)} of {len(frame)} runs"
    return clause + (f" (not: {_counted(missing)})" if len(missing) else "")


def commits(frame: pd.DataFrame) -> list[str]:
    """The distinct commits (short) behind the runs, recorded or shipped-in."""
    shas = pd.concat([frame["git_sha"], frame["shipped_in"]]).dropna().astype(str).str[:7]
    return sorted(set(shas))


RUN_COLUMNS = ["run", "experiment", "seed", "cold_start", "status", "wall_s"]


def run_records(results_dir: str | Path) -> pd.DataFrame:
    """One row per run folder under `results_dir` (a folder holding meta.json): the experiment and seed its
    meta.json records, its cold start (the cached start's key), and its status.json status and wall seconds."""
    rows = []
    root = Path(results_dir)
    for meta_path, meta in _metas(root):
        try:
            status = json.loads((meta_path.parent / "status.json").read_text())
        except (OSError, ValueError):
            status = {}
        keys = meta.get("run_keys") or {}
        rows.append(
            {
                "run": meta_path.parent.relative_to(root).as_posix(),
                "experiment": keys.get("experiment"),
                "seed": keys.get("seed", meta.get("seed")),
                # the start as a unit (twins of one member count once), else its cached key
                "cold_start": (meta.get("cold_start") or {}).get("unit") or (meta.get("cold_start") or {}).get("key"),
                "status": status.get("status"),
                "wall_s": status.get("wall_s"),
            }
        )
    return pd.DataFrame(rows, columns=RUN_COLUMNS)
