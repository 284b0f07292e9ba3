"""results/README.md: one row per results folder, in the registry's order (the main job first): its question,
presets, runs, cold starts and seeds, the wall time of its runs, and the claims it decides with their verdicts
(claims.csv beside it, written with CLAIMS.md)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from moe_rl.analysis.claims import runs_folder
from moe_rl.analysis.pages import read_claims
from moe_rl.analysis.provenance import run_records
from moe_rl.run.atomic import write_atomic
from moe_rl.studies import registry


def verdicts(root: Path) -> dict[int, str]:
    """Claim id -> verdict, from RESULTS_ROOT/claims.csv (`report --claims` writes it); empty without one."""
    table = read_claims(root)
    return {} if table is None else {int(i): str(v) for i, v in zip(table["id"], table["verdict"], strict=True)}


def seed_ranges(seeds: list[int]) -> str:
    """0, 1, 2, 5, 6 -> "0-2, 5-6"."""
    if not seeds:
        return "—"
    spans: list[list[int]] = []
    for s in sorted(seeds):
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def wall(seconds: float) -> str:
    """Seconds as hours and minutes (`3 h 05 min`, `42 min`), `—` for none."""
    if not seconds:
        return "—"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def _row(root: Path, study, found: dict[int, str], runs: pd.DataFrame) -> str:
    """The study's row from its runs' records (`run_records` of its folder)."""
    seeds = sorted({int(s) for s in runs["seed"].dropna()})
    starts = runs["cold_start"].dropna().nunique()
    link = (
        f"[{study.folder}]({study.folder}/summary.md)"
        if (root / study.folder / "summary.md").is_file()
        else study.folder
    )
    decided = "; ".join(f"{i}: {found.get(i, 'not evaluated')}" for i in sorted(study.claims)) or "—"
    presets = ", ".join(f"`{p}`" for p in study.presets) or "—"
    question = f"**History** ({study.history}). {study.question}" if study.history else study.question
    return (
        f"| {link} | {question} | {presets} | {len(runs)} | {starts or '—'} | {seed_ranges(seeds)} | "
        f"{wall(float(pd.to_numeric(runs['wall_s'], errors='coerce').sum()))} | {decided} |"
    )


def independent_line(rows: list, records: dict[str, pd.DataFrame], pilots: dict[str, pd.DataFrame]) -> str:
    """How many independent cold starts stand behind all the folders together (`records`: each folder's run
    records; `pilots`: those of the calibration pilots a folder keeps under pilot/): a start several folders share,
    or a member warmed twice (twins, `cold_start.unit`), counts once; how many of them the current folders use, and
    how many were warmed for a pilot alone (they placed an operating point; no contrast reads them)."""
    every = {k for r in records.values() for k in r["cold_start"].dropna()}
    piloted = {k for r in pilots.values() for k in r["cold_start"].dropna()} - every
    current = {k for s in rows if not s.history for k in records[s.folder]["cold_start"].dropna()}
    history = [s.folder for s in rows if s.history]
    where = ", ".join(f"{f}/pilot" for f in pilots)
    return (
        f"Independent cold starts behind all {len(rows)} folders: {len(every) + len(piloted)}, of which "
        f"{len(piloted)} warmed for calibration pilots alone ({where or 'none'}; they placed an operating point and no "
        f"contrast reads them) (a start several folders share counts once; so does a pool member warmed twice, where "
        f"its runs record `cold_start.unit`); {len(current)} behind the folders that are not history "
        f"({', '.join(history) or 'none'} are)."
    )


def _study_records(root: Path, folder: str) -> pd.DataFrame:
    """The run records of a folder's own runs: its runs/ (or the folder itself), never a calibration pilot's."""
    records = run_records(runs_folder(root, folder))
    if not (root / folder / "runs").is_dir():
        records = records[~records["run"].astype(str).str.startswith("pilot/")]
    return records


def index_markdown(root: Path, presets: Path) -> str:
    """The text of RESULTS_ROOT/README.md."""
    found = verdicts(root)
    studies = registry(presets)
    rows = [s for s in studies if (root / s.folder).is_dir()]
    records = {s.folder: _study_records(root, s.folder) for s in rows}  # each folder's meta.json, read once
    pilots = {s.folder: run_records(root / s.folder / "pilot") for s in rows if (root / s.folder / "pilot").is_dir()}
    named = {p for s in studies for p in s.presets}
    unfiled = sorted(p.stem for p in Path(presets).glob("*.yaml") if p.stem not in named)
    others = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in {s.folder for s in studies})
    lines = [
        "# Results",
        "",
        "Generated by `python -m moe_rl.report --index` from the folders here, the study registry "
        "(a declaration per folder, experiments/conf/study/) and the verdicts of [CLAIMS.md](CLAIMS.md); nothing here is typed by hand. One "
        "row per folder, the main job first. Runs: the run folders (their meta.json); cold starts: the distinct "
        "starts they began from (a member warmed twice counts once where its runs record `cold_start.unit`); wall time: the sum of the runs' own wall time (status.json `wall_s`), not "
        "the sweep's, which ran several at once. Claims: the ids of [CLAIMS.md](CLAIMS.md) each folder decides, "
        "with their verdicts (other folders' runs may enter a claim as notes).",
        "",
        "| folder | question | presets | runs | cold starts | seeds | wall time | claims decided |",
        "|---|---|---|---:|---:|---|---:|---|",
        *(_row(root, s, found, records[s.folder]) for s in rows),
        "",
        independent_line(rows, records, pilots),
        "",
    ]
    if unfiled:
        lines += [
            "Presets without a folder of their own (their runs went into another folder, or are tests): "
            + ", ".join(f"`{p}`" for p in unfiled)
            + ".",
            "",
        ]
    if others:
        lines += ["Folders without a study: " + ", ".join(f"`{p}`" for p in others) + ".", ""]
    return "\n".join(lines)


def write_index(root: Path, presets: Path, out: Path | None = None) -> Path:
    """RESULTS_ROOT/README.md (into `out` when given)."""
    path = (out or root) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = index_markdown(root, presets)
    write_atomic(path, text.encode())
    return path
