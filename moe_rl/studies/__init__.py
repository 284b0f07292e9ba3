"""The registry: every results folder is one declaration in experiments/conf/study/ (a declared study, or a folder
whose runs its presets made), loaded from that folder in its `order`.

A declaration's registry keys (`moe_rl.studies.declaration_keys`) say what the pages need of it: its question, whether
it is history (`status`, `reason`, `superseded_by`), the presets whose runs it holds, its report (`report`, a
"module:function"; a declared study's is `study_report`, a folder's the folder report by arm), the claims it reads
(`decides`: by a contrast of its own or a reader of its own, each after the reading it follows, `earlier`) and its
section of CLAIMS.md (`claims_section`). A claim's current reading is the one no other reading follows; the others are
its earlier looks, in its notes. A new study is its declaration alone.

The presets folder is passed in (`python -m moe_rl.report --presets`, default experiments/conf/preset); the
declarations are the folder beside it (`design.studies_folder`): nothing here reads the checkout.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from moe_rl.analysis.claims import Claim, ClaimItem, evaluate_claims
from moe_rl.analysis.folder_report import StudyReport
from moe_rl.analysis.pages import write_claims_page
from moe_rl.analysis.provenance import run_records
from moe_rl.studies import study_claims, study_report
from moe_rl.studies.declaration_keys import read_declaration
from moe_rl.studies.design import studies_folder

Section = Callable[[Path, Path], list[str]]  # (root, presets) -> its lines of CLAIMS.md
Reader = Callable[[Path, Path], Claim]  # (root, presets) -> a claim's reading


@dataclass(frozen=True)
class ResultsFolder:
    """One results folder: what it asks, which presets fill it, how it is reported and what it decides."""

    folder: str  # results/<folder>
    presets: tuple[str, ...]  # experiments/conf/preset/<name>.yaml whose runs it holds (their `experiment` key)
    question: str
    report: StudyReport | None = None  # (runs_dir, out, presets) -> files; None: the folder report by arm
    claims: Mapping[int, ClaimItem] = field(default_factory=dict)  # the claims whose current reading it holds, by id
    claims_section: Section | None = None  # its section of CLAIMS.md
    rung: str = ""  # the rung its section's claims were read on ("" where it names none)
    rung_readings: Callable[[Path, Path], dict[int, str]] | None = None  # their cells of the claim table's rung column
    history: str = ""  # a superseded sweep or a pilot kept as history: by what, and why ("" where current)
    superseded_by: str = ""  # the study that re-reads what it read ("" where none)
    order: int = 0


# the folders the scale paragraph of CLAIMS.md reads, in its order, and those of collapse_definitions.md
SCALE_FOLDERS = (
    "phase",
    "phase_mismatch",
    "drift_scaling",
    "drift_forecast",
    "engine_mismatch",
    "engine_mismatch_stable",
    "dense_control",
    "phase_mixtral",  # the phase map of another family
    "stabilizers",  # the leaderboard at the end of the page
)
COLLAPSE_FOLDERS = ("stress", "compare")


def named(text: str, where: Path) -> object:
    """The object a declaration names as "module:function" (a report, a reader of a claim, a section)."""
    module, _, name = str(text).partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{where}: {text!r} names no module:function ({err})") from None


def _reader(text: str, where: Path) -> Reader:
    """A claim's own reader, (root, presets) -> Claim: a claim with a statistic of its own (claims 1 and 6)."""
    found = named(text, where)
    if not callable(found):
        raise ValueError(f"{where}: {text!r} is not a reader of a claim")
    return found  # type: ignore[return-value]


def _report(text: str, where: Path) -> StudyReport:
    found = named(text, where)
    if not callable(found):
        raise ValueError(f"{where}: {text!r} is not a report")
    return found  # type: ignore[return-value]


def _section(raw: object, name: str, where: Path) -> Section | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return named(raw, where)  # type: ignore[return-value]
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: claims_section is a module:function or a mapping (title, claims, then)")
    section = study_claims.claims_section(name, str(raw["title"]), tuple(str(c) for c in raw["claims"]))
    if raw.get("then") is None:
        return section
    then: Section = named(raw["then"], where)  # type: ignore[assignment]
    return lambda root, presets: [*section(root, presets), *then(root, presets)]


def _judge(cid: int, name: str, decides: dict[str, dict], files: dict[str, Path]) -> Reader:
    """Claim `cid` as study `name` reads it, after the reading it follows (`earlier`)."""
    entry = decides[name][str(cid)]
    if "reader" in entry:
        return _reader(entry["reader"], files[name])
    earlier = entry.get("earlier")
    prior = None if earlier is None else _judge(cid, str(earlier), decides, files)
    return study_claims.study_claim(cid, name, str(entry["contrast"]), prior)


@functools.cache
def _registry(folder: Path) -> tuple[ResultsFolder, ...]:
    raws = {path: read_declaration(path) for path in sorted(folder.glob("*.yaml"))}
    names = {path: str(raw.get("name") or path.stem) for path, raw in raws.items()}
    files = {n: p for p, n in names.items()}
    decides = {names[p]: {str(k): dict(v) for k, v in (raw.get("decides") or {}).items()} for p, raw in raws.items()}
    for name, entries in decides.items():
        for cid, entry in entries.items():
            if ("reader" in entry) == ("contrast" in entry):
                raise ValueError(f"{files[name]}: decides.{cid} names a contrast or a reader (one of them)")
            earlier = entry.get("earlier")
            if earlier is not None and cid not in decides.get(str(earlier), {}):
                raise ValueError(
                    f"{files[name]}: decides.{cid}.earlier names {earlier!r}, which does not read claim {cid}"
                )
    followed = {(str(e["earlier"]), c) for d in decides.values() for c, e in d.items() if e.get("earlier")}
    heads: dict[int, str] = {}
    for name, entries in decides.items():
        for cid in entries:
            if (name, cid) not in followed:
                if int(cid) in heads:
                    raise ValueError(
                        f"{files[name]}: claim {cid} is also read by {heads[int(cid)]}; name it as earlier"
                    )
                heads[int(cid)] = name
    rows = []
    for path, raw in raws.items():
        name = names[path]
        if "order" not in raw:
            raise ValueError(f"{path}: a declaration needs `order`, its place in the registry (the pages' order)")
        study = "arms" in raw
        launched = study and "as_ran" not in raw  # a study re-reading its presets' runs keeps its folder's report
        report = raw.get("report")
        history = raw.get("status", "current") == "history"
        section = raw.get("claims_section")
        rung, readings = "", None
        if isinstance(section, dict) and section.get("rung"):
            rung = " ".join(str(section["rung"]).split())
            readings = study_claims.rung_readings(name, tuple(str(c) for c in section["claims"]))
        if history and not raw.get("reason"):
            raise ValueError(f"{path}: status history needs a reason (superseded by what, or kept why)")
        rows.append(
            ResultsFolder(
                folder=name,
                presets=tuple(str(p) for p in raw.get("presets", [name] if study else [])),
                question=" ".join(str(raw["question"]).split()),
                report=_report(report, path) if report else study_report.study_report(name) if launched else None,
                claims={c: _judge(c, name, decides, files) for c, n in sorted(heads.items()) if n == name},
                claims_section=_section(raw.get("claims_section"), name, path),
                rung=rung,
                rung_readings=readings,
                history=" ".join(str(raw.get("reason", "")).split()) if history else "",
                superseded_by=str(raw.get("superseded_by") or ""),
                order=int(raw["order"]),
            )
        )
    rows.sort(key=lambda r: r.order)
    orders = [r.order for r in rows]
    if len(set(orders)) != len(orders):
        raise ValueError(
            f"{folder}: two declarations share an order: {sorted(o for o in orders if orders.count(o) > 1)}"
        )
    return tuple(rows)


def registry(presets: str | Path, declarations: str | Path | None = None) -> tuple[ResultsFolder, ...]:
    """Every results folder's row, from the declarations (default: the folder beside the presets), in page order."""
    return _registry(Path(declarations or studies_folder(presets)).resolve())


def claim_items(presets: str | Path, declarations: str | Path | None = None) -> dict[int, ClaimItem]:
    """Each claim's current reading, by id."""
    return dict(sorted((i, c) for s in registry(presets, declarations) for i, c in s.claims.items()))


def study_of_runs(runs_dir: Path, presets: str | Path) -> ResultsFolder | None:
    """The study whose presets made the runs under `runs_dir` (the experiment their meta.json records); first, the
    row of the runs' own folder where it names no preset but a report of its own (a pilot run with another
    preset's overrides, e.g. the ladder); None when no row names them all."""
    rows = registry(presets)
    experiments = set(run_records(runs_dir)["experiment"].dropna())
    found = [s for s in rows if experiments and experiments <= set(s.presets)]
    folder = runs_dir.parent.name if runs_dir.name == "runs" else runs_dir.name
    own = [s for s in rows if s.folder == folder and not s.presets and s.report is not None]  # its own report
    chosen = own or found
    return chosen[0] if chosen else None


def claims(root: Path, presets: Path, declarations: Path | None = None) -> list[Claim]:
    """Every study's claims, judged on the result folders under `root`, in id order, each with its reading on the
    routing-dominant rung where a study's section reads it there (`on_rung`). The registry is read from
    `declarations` where given, else beside `presets`; a claim no declaration reads has no data."""
    judged = evaluate_claims(root, claim_items(presets, declarations), presets)
    on_rung: dict[int, str] = {}
    for s in registry(presets, declarations):
        if s.rung_readings is not None:
            on_rung.update(s.rung_readings(root, presets))
    return [replace(c, on_rung=on_rung.get(c.id, "")) for c in judged]


def write_claims(root: Path, presets: Path, out: Path | None = None) -> Path:
    """RESULTS_ROOT/CLAIMS.md: the verdicts, the sections the studies add (in page order), the provenance."""
    sections = [line for s in registry(presets) if s.claims_section for line in s.claims_section(root, presets)]
    return write_claims_page(root, claims(root, presets), sections, SCALE_FOLDERS, out)
