"""The pages of a results root: CLAIMS.md (the verdicts, the sections studies add, the provenance of every
folder) with claims.csv beside it (the same table as data: what the index and README.md's claim table read),
and collapse_definitions.md; each written to a temporary name and renamed into place."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from moe_rl import analysis
from moe_rl.analysis.claims import Claim, format_claims_markdown, runs_folder
from moe_rl.analysis.claims.markdown import escape_cell
from moe_rl.analysis.provenance import commits, load_provenance
from moe_rl.run.atomic import write_atomic


def write_claims_page(
    root: Path, claims: list[Claim], sections: list[str], scale_folders: tuple[str, ...], out: Path | None = None
) -> Path:
    """RESULTS_ROOT/CLAIMS.md: the verdicts of `claims` on the folders under root, the scale paragraph from
    `scale_folders`, then `sections` (what studies add) and the provenance of every folder."""
    path = (out or root) / "CLAIMS.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = format_claims_markdown(claims, root, scale_folders)
    text = text.rstrip("\n") + "\n\n" + "\n".join([*sections, *provenance_section(root)]) + "\n"
    write_atomic(path.with_name(CLAIMS_TABLE), claims_frame(claims).to_csv(index=False, lineterminator="\n").encode())
    write_atomic(path, text.encode())
    return path


CLAIMS_TABLE = "claims.csv"  # beside CLAIMS.md
CLAIMS_COLUMNS = (
    "id",
    "claim",
    "source",
    "experiment",
    "cells",
    "read_on",
    "statistic",
    "divergence",
    "verdict",
    "reason",
    "on_rung",
)
README_CLAIMS = ("<!-- claim table: python -m moe_rl.report --claims --readme -->", "<!-- end of claim table -->")


def claims_frame(claims: list[Claim]) -> pd.DataFrame:
    """The claim table of CLAIMS.md as data, one row per claim."""
    return pd.DataFrame([{k: getattr(c, k) for k in CLAIMS_COLUMNS} for c in claims], columns=list(CLAIMS_COLUMNS))


def read_claims(root: Path) -> pd.DataFrame | None:
    """RESULTS_ROOT/claims.csv (every column text, empty cells ""), None where it has not been written."""
    path = root / CLAIMS_TABLE
    return pd.read_csv(path, dtype=str, keep_default_na=False) if path.is_file() else None


def readme_claims_table(root: Path) -> str | None:
    """README.md's claim table from RESULTS_ROOT/claims.csv: each claim, its verdict, the model and routing share it
    was read on, what the runs show (the statistic, the study and cells, the divergence ratio, the reason) and its
    reading on the routing-dominant rung (the row's verdict alone in bold)."""
    table = read_claims(root)
    if table is None:
        return None

    def shows(row: pd.Series) -> str:
        named = ": ".join(part for part in (row["experiment"], row["cells"]) if part)
        where = f" ({named})" if row["experiment"] else ""  # the study, and its cells where it names them
        ratio = f"; divergence ratio {row['divergence']}" if row["divergence"] else ""
        return f"{row['statistic'] or 'no statistic'}{where}{ratio}; {row['reason']}"

    lines = [
        "| # | claim | verdict | read on | what the runs show | on the routing-dominant rung |",
        "|---:|:---|:---|:---|:---|:---|",
    ]
    for _, row in table.iterrows():
        cells = (
            row["id"],
            row["claim"],
            f"**{row['verdict']}**",
            row["read_on"] or "—",
            shows(row),
            row.get("on_rung") or "—",
        )
        lines.append("| " + " | ".join(escape_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def provenance_section(root: Path) -> list[str]:
    """The commits each result folder's runs came from (their meta.json), for CLAIMS.md."""
    lines = [
        "## Provenance",
        "",
        "The commits each folder's runs were made by (meta.json; runs that recorded none name the commit that "
        "shipped them). A rerun agrees bitwise on a CPU of the same vendor and model for runs with `numerics=avx2` "
        "(on one of the same kernel set for `native` runs), and lies within seed variation elsewhere; see "
        "docs/reproducing.md. `rebuildable`: runs whose code this repository rebuilds (their commit, and where "
        "the tree was dirty the patch stored beside them), which `python -m moe_rl.reproduce` reruns with it.",
        "",
        "| folder | runs | rebuildable | commits |",
        "|---|---|---|---|",
    ]
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        frame = load_provenance(folder)
        if len(frame):
            shas = ", ".join(f"`{c}`" for c in commits(frame)) or "—"
            lines.append(f"| {folder.name} | {len(frame)} | {int(frame['code'].isna().sum())} | {shas} |")
    return lines


def write_collapse_definitions(root: Path, folders: tuple[str, ...], out: Path | None = None) -> Path | None:
    """RESULTS_ROOT/collapse_definitions.md: which runs each collapse definition flags, and why."""
    frames = {}
    for name in folders:
        runs_dir = runs_folder(root, name)
        if runs_dir.is_dir() and any(runs_dir.rglob("metrics.parquet")):
            frames[f"{root.name}/{runs_dir.relative_to(root).as_posix()}"] = analysis.load_results(runs_dir)
    if not frames:
        print(f"skipped collapse_definitions.md: none of {list(folders)} under {root}", file=sys.stderr)
        return None
    path = (out or root) / "collapse_definitions.md"
    text = analysis.collapse_definitions_markdown(frames)
    write_atomic(path, text.encode())
    return path


def write_readme_block(readme: Path, markers: tuple[str, str], body: str | None) -> Path | None:
    """Replace the text between `markers` in `readme` with `body` (a generated table); None where there is no body
    (nothing shipped yet), ValueError where the README lacks the markers."""
    text = readme.read_text()
    start, end = markers
    if start not in text or end not in text:
        raise ValueError(f"{readme} has no markers {start!r} ... {end!r}")
    if body is None:
        return None
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    write_atomic(readme, f"{head}{start}\n{body}{end}{tail}".encode())
    return readme


def readme_block(readme: Path, markers: tuple[str, str]) -> str:
    """The text between `markers` in `readme` (after the start marker's newline)."""
    return readme.read_text().split(markers[0], 1)[1].split(markers[1], 1)[0].removeprefix("\n")
