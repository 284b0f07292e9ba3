"""A declaration's history in git against its runs' commits (`moe_rl.analysis.preregistration`): declared before
its first run, or each amendment after the runs began with what changed and the look it fell in."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from moe_rl.analysis.preregistration import declaration_history, look_of

DECLARATION = {
    "name": "toy",
    "question": "Does r2 change the gain?",
    "arms": {"none": {"overrides": ["replay=none"]}, "r2": {"overrides": ["replay=r2"]}},
    "levels": {"hi": {"overrides": ["optim.lr=2e-3"]}},
    "unit": {"members": "0..7"},
    "contrasts": [{"name": "r2_minus_none", "claim": "x", "cells": {"r2@hi": 1, "none@hi": -1}}],
    "design": {"mde": 0.05, "looks": [3, 6, 8], "sized_from": "a test"},
}


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for who in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{who}_NAME", "Test")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "test@example.invalid")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    root = tmp_path / "repo"
    (root / "conf" / "study").mkdir(parents=True)
    _git(root, "init", "-q")
    return root


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def _commit(root: Path, message: str, hour: int, monkeypatch: pytest.MonkeyPatch) -> str:
    """Commit everything at 2026-01-01 `hour`:00 UTC; its sha."""
    date = f"2026-01-01T{hour:02d}:00:00+00:00"
    monkeypatch.setenv("GIT_AUTHOR_DATE", date)
    monkeypatch.setenv("GIT_COMMITTER_DATE", date)
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "--allow-empty", "-m", message)
    return _git(root, "rev-parse", "HEAD")


def _declare(root: Path, text: str | None = None, **changes: object) -> Path:
    path = root / "conf" / "study" / "toy.yaml"
    path.write_text(text if text is not None else yaml.safe_dump({**DECLARATION, **changes}, sort_keys=False))
    return path


def _runs(root: Path, sha: str, members: range, cell: str = "none@hi", **meta: object) -> list[Path]:
    """One run folder per member under results/toy/runs/<cell>/, its meta.json naming commit `sha`."""
    out = []
    for m in members:
        folder = root / "results" / "toy" / "runs" / cell / f"seed={m}"
        folder.mkdir(parents=True)
        record = {"git_sha": sha, "git_dirty": False, "seed": m, "run_keys": {"seed": m, "cold_member": m}, **meta}
        (folder / "meta.json").write_text(json.dumps(record))
        (folder / "status.json").write_text(json.dumps({"status": "completed", "wall_s": 1.0}))
        out.append(folder)
    return out


def test_a_declaration_committed_before_its_runs_reads_declared_before_its_first_run(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _declare(repo)
    declared = _commit(repo, "declare", 9, monkeypatch)
    (repo / "code.py").write_text("x = 1\n")
    code = _commit(repo, "code", 10, monkeypatch)
    runs = _runs(repo, code, range(4)) + _runs(repo, declared, range(4), cell="r2@hi")
    _commit(repo, "runs", 11, monkeypatch)
    history = declaration_history(path, runs)
    assert history.before_runs and not history.amendments and history.runs == 8 and history.undated == 0
    assert history.first_run is not None and history.first_run.sha == declared
    assert history.text == (
        f"Declared at {declared[:7]} (2026-01-01 09:00 UTC), before its first run (2026-01-01 09:00 UTC, code "
        f"{declared[:7]})."
    )
    assert "\n" not in history.text


def test_an_amendment_after_the_runs_began_is_listed_with_what_changed_and_its_look(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _declare(repo)
    declared = _commit(repo, "declare", 9, monkeypatch)
    early = _runs(repo, declared, range(4))  # members 0-3 run and are shipped
    _commit(repo, "first runs", 10, monkeypatch)
    _runs(repo, declared, range(4, 5))  # member 4 runs the first version, not yet shipped
    late_design = {**DECLARATION["design"], "mde": 0.08}
    _declare(repo, design=late_design, readme=True)
    amended = _commit(repo, "amend the design", 11, monkeypatch)  # member 4's run ships with it
    text = path.read_text()
    _declare(repo, "# a note\n" + text)
    comment = _commit(repo, "a comment", 12, monkeypatch)
    late = _runs(repo, comment, range(5, 8))
    _commit(repo, "later runs", 13, monkeypatch)
    runs = early + [repo / "results" / "toy" / "runs" / "none@hi" / "seed=4"] + late

    history = declaration_history(path, runs)
    assert not history.before_runs and history.design_amended
    assert [a.commit.sha for a in history.amendments] == [amended, comment]  # both after members 0-4's code
    a, note = history.amendments
    assert (a.changed, a.design, a.created) == ("changed design, +readme", True, False)
    assert (a.members_shipped, a.members_before) == (5, 5)  # member 4's run shipped with it: its author had it
    assert a.look == "after look 1 (3 starts)"
    assert (note.changed, note.design, note.members_shipped, note.members_before) == ("comments only", False, 5, 5)
    assert history.text == (
        f"Declared at {declared[:7]} (2026-01-01 09:00 UTC); after its first run (2026-01-01 09:00 UTC, code "
        f"{declared[:7]}): amended at {amended[:7]} (2026-01-01 11:00 UTC, changed design, +readme) with runs of 5 "
        f"members on the version before (5 shipped): after look 1 (3 starts); amended at {comment[:7]} (2026-01-01 "
        "12:00 UTC, comments only) with runs of 5 members on the version before (5 shipped): after look 1 (3 starts)."
    )
    # without the runs of the first version, the amendment is before every run: declared (and amended) before them
    history = declaration_history(path, late)
    assert history.before_runs and history.text == (
        f"Declared at {declared[:7]} (2026-01-01 09:00 UTC), before its first run (2026-01-01 12:00 UTC, code "
        f"{comment[:7]}); amended 2x before it (last {comment[:7]}, 2026-01-01 12:00 UTC)."
    )
    # a version that changes only what the report says is said to
    _declare(repo, text + "readme: false\n")
    assert declaration_history(path, runs).working_copy == "changed readme, reporting keys only"
    # one that changes only the registry's bookkeeping (its place, which reading of a claim is current) is no version
    _declare(repo, "# a note\n" + text)
    before = declaration_history(path, runs).text
    _declare(repo, "# a note\n" + text + "order: 5\ndecides:\n  '2': {contrast: r2_minus_none}\n")
    assert declaration_history(path, runs).working_copy is None
    _commit(repo, "registry keys", 14, monkeypatch)
    after = declaration_history(path, runs)
    assert after.text == before and len(after.versions) == 3
    _declare(repo, "# a note\n" + text + "order: 5\ndecides:\n  '2': {contrast: r2_minus_none}\nreadme: false\n")
    assert declaration_history(path, runs).working_copy == "changed readme, reporting keys only"


def test_a_declaration_written_after_its_runs_a_renamed_one_and_its_working_copy(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (repo / "code.py").write_text("x = 1\n")
    code = _commit(repo, "code", 8, monkeypatch)
    runs = _runs(repo, code, range(7))
    _commit(repo, "runs", 9, monkeypatch)
    _declare(repo)
    written = _commit(repo, "declared as it ran", 10, monkeypatch)
    (repo / "conf" / "study" / "toy.yaml").rename(repo / "conf" / "study" / "toy2.yaml")
    _commit(repo, "renamed", 11, monkeypatch)
    path = repo / "conf" / "study" / "toy2.yaml"
    history = declaration_history(path, runs)
    assert [v.sha for v in history.versions][0] == written and len(history.versions) == 2
    a, renamed = history.amendments  # the rename came after the runs too: their code lacks it
    assert a.created and a.commit.sha == written and (a.members_shipped, a.members_before) == (7, 7)
    assert (renamed.changed, renamed.design) == ("renamed from conf/study/toy.yaml", False)
    assert history.text.startswith(
        f"Written at {written[:7]} (2026-01-01 10:00 UTC), after its first run (2026-01-01 08:00 UTC, code "
        f"{code[:7]}): runs of 7 members before it (7 shipped): after look 2 (6 starts); amended at "
    )
    path.write_text(path.read_text().replace("a test", "a test, re-read"))
    assert history.working_copy is None
    assert declaration_history(path, runs).text.endswith(
        "Its working copy differs from " + _git(repo, "rev-parse", "--short=7", "HEAD") + " (changed design)."
    )


def test_undated_runs_and_runs_of_an_uncommitted_declaration_are_counted(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _declare(repo)
    declared = _commit(repo, "declare", 9, monkeypatch)
    runs = _runs(repo, declared, range(2)) + _runs(repo, "0" * 40, range(2, 3)) + _runs(repo, "unknown", range(3, 4))
    dirty = _runs(repo, declared, range(4, 5), cell="r2@hi", git_dirty=True, git_diff="abc")
    code = repo / "results" / "toy" / "runs" / "r2@hi" / ".code"
    code.mkdir()
    (code / "abc.patch").write_text("diff --git a/conf/study/toy.yaml b/conf/study/toy.yaml\n")
    history = declaration_history(path, runs + dirty)
    assert history.before_runs and (history.runs, history.undated, history.dirty_runs) == (5, 2, 1)
    assert history.text.endswith(
        "2 of 5 runs undated (no commit recorded, or not in this repository). 1 runs ran uncommitted changes to it."
    )


def test_outside_a_repository_or_uncommitted_the_history_is_not_read(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loose = tmp_path / "loose" / "toy.yaml"
    loose.parent.mkdir()
    loose.write_text(yaml.safe_dump(DECLARATION))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    history = declaration_history(loose, [])
    assert history.problem == "toy.yaml is not in a git repository" and not history.before_runs
    assert history.text == "Pre-registration not checked: toy.yaml is not in a git repository."
    path = _declare(repo)
    history = declaration_history(path, [])
    assert history.text == (
        "Pre-registration not checked: conf/study/toy.yaml was never committed (no history to hold its runs to)."
    )
    _commit(repo, "declare", 9, monkeypatch)
    assert declaration_history(path, []).text.endswith("no dated run yet.")


def test_look_of_places_members_among_the_looks() -> None:
    assert look_of(2, (3, 6, 8)) == "before look 1 (3 starts)"
    assert look_of(6, (3, 6, 8)) == "after look 2 (6 starts)"
    assert look_of(9, (3, 6, 8)) == "after the last look (8 starts)"
    assert look_of(4, ()) == "4 members"
