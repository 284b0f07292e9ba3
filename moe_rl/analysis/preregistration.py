"""Whether a study's declaration was written before its runs: its history in git against its runs' commits (pure).

A declaration (experiments/conf/study/<name>.yaml) is a pre-registration only if no version of it came after its
runs began. `declaration_history` reads the file's commits (`git log --follow`) in the repository that holds it and
each run's code commit from its meta.json (`git_sha`, `git_dirty`, `git_diff`). A run records no start time, so a
version counts as **before** a run where the run's code holds it (the version's commit is an ancestor of, or is,
the run's commit: the run composed its config from that version or a later one), and a run's date is its code
commit's date (the earliest it can have started). Every version that some run's code lacks was committed after
that run's code, and is listed as an amendment made after the runs began: its commit and date, what changed (the
top-level keys whose parsed values differ from the version before, "comments only" where none do; "reporting keys
only" where every changed key is one that changes what the report says, not what runs or how it decides) and the
look it fell in, as a range: from the members whose runs were shipped (committed into the repository, through
renames) with or before it to the members whose runs ran the version before it (some perhaps still under way when
it was made), each against the study's `design.looks`. A first version some run's code lacks was written after
the runs began (a study declared as it ran). A run whose tree had uncommitted changes to the declaration itself
(its stored patch touches the file) ran a version git does not hold: counted and said. Runs whose commit this
repository does not hold (or none recorded) are counted and left undated.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

# Keys that change what a study's report says of it, not what it runs or how it decides: an amendment touching only
# these is said to be so ("reporting keys only").
REPORTING_KEYS = frozenset({"question", "claims", "declared", "columns", "axes", "readme", "sections", "duplicates"})
# The registry's bookkeeping (`moe_rl.studies`): where the study sits on the pages, whether it is history, which reading
# of a claim is the current one. A version changing only these (and comments) is not a version of the design at all:
# it is left out of the history.
REGISTRY_KEYS = frozenset(
    {"order", "status", "reason", "superseded_by", "presets", "report", "decides", "claims_section"}
)


@dataclass(frozen=True)
class Commit:
    sha: str
    date: datetime  # the committer date

    @property
    def short(self) -> str:
        return self.sha[:7]

    @property
    def when(self) -> str:
        return self.date.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


@dataclass(frozen=True)
class Amendment:
    """A version of the declaration that some run's code lacks: committed after that run's code."""

    commit: Commit
    changed: str  # the top-level keys that differ from the version before ("+key" added, "-key" removed), or why not
    design: bool  # whether a key outside the reporting keys changed (the file's first version: always)
    created: bool  # the file's first version: the declaration was written after runs began
    members_shipped: int  # members whose runs were shipped with or before it (their outcomes could be read)
    members_before: int  # members whose runs ran the version before it (the most that had begun)
    looks: tuple[int, ...] = ()

    @property
    def look(self) -> str:
        """The look it fell in: between the shipped members' and the begun members' (one where they agree)."""
        low, high = look_of(self.members_shipped, self.looks), look_of(self.members_before, self.looks)
        return low if low == high else f"{low} to {high}"

    @property
    def text(self) -> str:
        """ "amended at <commit> (<date>, <what changed>) with runs of <n> members on the version before (<m>
        shipped): <look>"; the first version: "written at <commit> (<date>): runs of <n> members before it (...)"."""
        if self.created:
            head = (
                f"written at {self.commit.short} ({self.commit.when}): runs of {self.members_before} members before it"
            )
        else:
            what = self.changed + ("" if self.design or "changed " not in self.changed else ", reporting keys only")
            head = (
                f"amended at {self.commit.short} ({self.commit.when}, {what}) with runs of {self.members_before} "
                "members on the version before"
            )
        return head + f" ({self.members_shipped} shipped)" + (f": {self.look}" if self.looks else "")


@dataclass(frozen=True)
class Preregistration:
    """A declaration's history against its runs; `text` is the report's one line."""

    file: Path
    versions: tuple[Commit, ...] = ()  # its commits, oldest first
    amendments: tuple[Amendment, ...] = ()  # the versions some run's code lacks, oldest first
    first_run: Commit | None = None  # the earliest code commit among its dated runs
    runs: int = 0
    undated: int = 0  # runs with no commit recorded, or one this repository does not hold
    dirty_runs: int = 0  # runs whose tree held uncommitted changes to the declaration
    working_copy: str | None = None  # the keys where the file differs from its last commit; None: it does not
    problem: str | None = None  # why the history could not be read (no repository, never committed)
    looks: tuple[int, ...] = field(default_factory=tuple)

    @property
    def before_runs(self) -> bool:
        """Whether every version is held by every dated run's code (and the history could be read)."""
        return self.problem is None and bool(self.versions) and not self.amendments

    @property
    def design_amended(self) -> bool:
        """Whether a version after the runs began changed more than the reporting keys (or was the first)."""
        return any(a.design for a in self.amendments)

    @property
    def text(self) -> str:
        if self.problem is not None:
            return f"Pre-registration not checked: {self.problem}."
        first = self.versions[0]
        if self.first_run is None:
            line = f"Declared at {first.short} ({first.when}); no dated run yet."
        elif not self.amendments:
            line = f"Declared at {first.short} ({first.when}), before its first run ({self._first_run})."
            if len(self.versions) > 1:
                last = self.versions[-1]
                line = line[:-1] + f"; amended {len(self.versions) - 1}x before it (last {last.short}, {last.when})."
        else:
            texts = [a.text for a in self.amendments]
            after = f"after its first run ({self._first_run})"
            if self.amendments[0].created:  # declared as it ran: "Written at X (date), after its first run (...): ..."
                written = f"written at {first.short} ({first.when})"
                line = f"Written at {first.short} ({first.when}), {after}{texts[0].removeprefix(written)}"
                line += "".join(f"; {x}" for x in texts[1:]) + "."
            else:
                line = f"Declared at {first.short} ({first.when}); {after}: " + "; ".join(texts) + "."
        if self.undated:
            line += f" {self.undated} of {self.runs} runs undated (no commit recorded, or not in this repository)."
        if self.dirty_runs:
            line += f" {self.dirty_runs} runs ran uncommitted changes to it."
        if self.working_copy is not None:
            line += f" Its working copy differs from {self.versions[-1].short} ({self.working_copy})."
        return line

    @property
    def _first_run(self) -> str:
        assert self.first_run is not None
        return f"{self.first_run.when}, code {self.first_run.short}"


def look_of(members: int, looks: tuple[int, ...]) -> str:
    """Where `members` starts lie among the looks: before look 1, after look k, or after the last look."""
    if not looks:
        return f"{members} members"
    passed = sum(1 for n in looks if n <= members)
    if passed == 0:
        return f"before look 1 ({looks[0]} starts)"
    if passed == len(looks):
        return f"after the last look ({looks[-1]} starts)"
    return f"after look {passed} ({looks[passed - 1]} starts)"


def declaration_history(
    study_file: Path, run_dirs: list[Path], looks: tuple[int, ...] | None = None, pool: int | None = None
) -> Preregistration:
    """The history of the declaration `study_file` against the runs in `run_dirs` (folders holding meta.json; see
    the module docstring). `looks` (starts) and `pool` (run seed s starts from member s mod pool, where a run's
    meta.json names no `cold_member`) default to the declaration's own `design.looks` and `unit.pool`."""
    study_file = Path(study_file).resolve()
    declared = _parse(study_file.read_text()) if study_file.is_file() else None
    if looks is None:
        looks = tuple(int(n) for n in ((declared or {}).get("design") or {}).get("looks") or ())
    if pool is None:
        pool = ((declared or {}).get("unit") or {}).get("pool")
    git = _Git(study_file.parent)
    if git.root is None:
        return Preregistration(study_file, problem=f"{study_file.name} is not in a git repository", looks=looks)
    rel = study_file.relative_to(git.root).as_posix()
    history = git.history(rel)
    if not history:
        return Preregistration(study_file, problem=f"{rel} was never committed (no history to hold its runs to)")
    history = [
        h
        for i, h in enumerate(history)
        if i == 0
        or _changed(git.show(history[i - 1][0].sha, history[i - 1][1]), git.show(h[0].sha, h[1]))[0] != REGISTRY
    ]
    versions = tuple(c for c, _ in history)

    runs = [_run(Path(d), pool, rel, git) for d in run_dirs]
    dated = [(r, r.code) for r in runs if r.code is not None]
    shipped = git.shipped([Path(d) for d in run_dirs])
    amendments = []
    for i, (version, path) in enumerate(history):
        lacking = [r for r, code in dated if not git.holds(code, version.sha)]
        if not lacking:
            continue
        seen = {
            r.member
            for r, d in zip(runs, run_dirs, strict=True)
            if r.member is not None
            and (ship := shipped.get(Path(d).resolve())) is not None
            and git.holds(version, ship.sha)
        }
        if i == 0:
            changed, design = "written", True
        else:
            before = history[i - 1][1]
            changed, design = _changed(git.show(history[i - 1][0].sha, before), git.show(version.sha, path))
            if before != path:
                changed = f"renamed from {before}" + ("" if changed == "unchanged" else f", {changed}")
        amendments.append(
            Amendment(
                commit=version,
                changed=changed,
                design=design,
                created=i == 0,
                members_shipped=len(seen),
                members_before=len({r.member for r in lacking if r.member is not None}),
                looks=looks,
            )
        )
    working = None
    if study_file.is_file():
        current = study_file.read_text()
        last = git.show(versions[-1].sha, history[-1][1])
        if current != last:
            changed, design = _changed(last, current)
            working = (
                None
                if changed == REGISTRY
                else changed + ("" if design or "changed " not in changed else ", reporting keys only")
            )
    return Preregistration(
        file=study_file,
        versions=versions,
        amendments=tuple(amendments),
        first_run=min((code for _, code in dated), key=lambda c: c.date) if dated else None,
        runs=len(runs),
        undated=len(runs) - len(dated),
        dirty_runs=sum(r.dirty_declaration for r in runs),
        working_copy=working,
        looks=looks,
    )


@dataclass(frozen=True)
class _Run:
    member: int | None
    code: Commit | None
    dirty_declaration: bool


def _run(folder: Path, pool: object, rel: str, git: _Git) -> _Run:
    """One run's member, code commit (None: unrecorded or unknown here) and whether its tree changed the file."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return _Run(None, None, False)
    keys = meta.get("run_keys") or {}
    seed = keys.get("seed", meta.get("seed"))
    member = keys.get("cold_member")
    if member is None and seed is not None:
        member = int(seed) % int(pool) if isinstance(pool, int) and pool > 0 else int(seed)
    sha = meta.get("git_sha")
    code = git.commit(sha) if isinstance(sha, str) and sha not in ("", "unknown") else None
    dirty = False
    if meta.get("git_dirty") and meta.get("git_diff"):
        patch = folder.parent / ".code" / f"{meta['git_diff']}.patch"
        try:
            dirty = f"a/{rel}" in patch.read_text() or f"b/{rel}" in patch.read_text()
        except OSError:
            dirty = False
    return _Run(None if member is None else int(member), code, dirty)


def _parse(text: str) -> dict | None:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return raw if isinstance(raw, dict) else None


def _changed(before: str | None, after: str | None) -> tuple[str, bool]:
    """(the top-level keys whose parsed values differ, "+key" added and "-key" removed, or "comments only", or
    "unchanged" where the text is; whether one of them is outside the reporting keys)."""
    if before == after:
        return "unchanged", False
    old, new = _parse(before or ""), _parse(after or "")
    if old is None or new is None:
        return "not parseable as a mapping", True
    keys = [
        ("+" if k not in old else "-" if k not in new else "") + str(k)
        for k in dict.fromkeys([*old, *new])
        if old.get(k, _MISSING) != new.get(k, _MISSING)
    ]
    if keys and all(k.lstrip("+-") in REGISTRY_KEYS for k in keys):
        return REGISTRY, False
    keys = [k for k in keys if k.lstrip("+-") not in REGISTRY_KEYS]
    if not keys:
        return "comments only", False
    return "changed " + ", ".join(keys), any(k.lstrip("+-") not in REPORTING_KEYS for k in keys)


_MISSING = object()
REGISTRY = "registry keys only"  # a version `_changed` finds changing nothing but REGISTRY_KEYS


class _Git:
    """git in the repository holding `folder` (`root` None where there is none), its answers cached."""

    def __init__(self, folder: Path) -> None:
        top = self._run(["rev-parse", "--show-toplevel"], folder)
        self.root = Path(top.strip()).resolve() if top is not None else None
        self.commits: dict[str, Commit | None] = {}
        self.ancestry: dict[tuple[str, str], bool] = {}

    @staticmethod
    def _run(args: list[str], cwd: Path) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=cwd, capture_output=True, text=True, check=False, env={**os.environ, "LC_ALL": "C"}
            )
        except OSError:  # no git
            return None
        return done.stdout if done.returncode == 0 else None

    def git(self, *args: str) -> str | None:
        assert self.root is not None
        return self._run(list(args), self.root)

    def history(self, rel: str) -> list[tuple[Commit, str]]:
        """(commit, the file's path there) of every commit of `rel`, following renames, oldest first."""
        out = self.git("log", "--follow", "--format=@%H %cI", "--name-only", "--", rel) or ""
        history: list[tuple[Commit, str]] = []
        for line in out.splitlines():
            if line.startswith("@"):
                sha, date = line[1:].split()
                history.append((Commit(sha, datetime.fromisoformat(date)), rel))
            elif line.strip() and history:
                history[-1] = (history[-1][0], line.strip())
        return history[::-1]

    def commit(self, sha: str) -> Commit | None:
        """The commit `sha` names (its full sha and date), or None where the repository does not hold it."""
        if sha not in self.commits:
            out = self.git("show", "-s", "--format=%H %cI", f"{sha}^{{commit}}")
            if out and out.split():
                full, date = out.split()[:2]
                self.commits[sha] = Commit(full, datetime.fromisoformat(date))
            else:
                self.commits[sha] = None
        return self.commits[sha]

    def holds(self, commit: Commit, version: str) -> bool:
        """Whether `commit`'s tree holds commit `version` (it is `version` or a descendant)."""
        key = (commit.sha, version)
        if key not in self.ancestry:
            self.ancestry[key] = self.git("merge-base", "--is-ancestor", version, commit.sha) is not None
        return self.ancestry[key]

    def show(self, sha: str, path: str) -> str | None:
        return self.git("show", f"{sha}:{path}")

    def shipped(self, run_dirs: list[Path]) -> dict[Path, Commit]:
        """The commit that first added each run folder's meta.json to the repository, through the renames (files
        moved) inside the folder above the runs' common folder (runs not committed: absent)."""
        assert self.root is not None
        inside = []
        for d in run_dirs:
            try:
                inside.append(Path(d).resolve().relative_to(self.root).as_posix())
            except ValueError:
                continue
        if not inside:
            return {}
        scope = os.path.dirname(os.path.commonpath(inside)) or "."
        out = self.git("log", "-M", "--diff-filter=AR", "--format=@%H %cI", "--name-status", "--", scope) or ""
        commits: list[tuple[Commit, list[list[str]]]] = []
        for line in out.splitlines():
            if line.startswith("@"):
                sha, date = line[1:].split()
                commits.append((Commit(sha, datetime.fromisoformat(date)), []))
            elif line.strip() and commits and line.endswith("meta.json"):
                commits[-1][1].append(line.split("\t"))
        origin: dict[str, Commit] = {}
        for commit, changes in reversed(commits):  # oldest first: a moved file keeps its first addition's commit
            for change in changes:
                if change[0] == "A":
                    origin.setdefault(change[1], commit)
                elif change[0].startswith("R") and len(change) == 3:
                    origin.setdefault(change[2], origin.get(change[1], commit))
        return {(self.root / d).resolve(): origin[f"{d}/meta.json"] for d in inside if f"{d}/meta.json" in origin}
