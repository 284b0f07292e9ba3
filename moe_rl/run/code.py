"""The code a run ran: its commit, and where the tree differed from it, the difference itself.

A run launched from a tree with changes (tracked files edited, or files git does not ignore and does not yet track)
keeps them as one binary patch against its commit (`git diff --binary`, built through a temporary index so that the
user's own index never moves), stored once per folder of runs under `.code/<sha256>.patch` beside the run folders
and named in meta.json (`git_diff`). `rebuild` makes that exact tree again from the repository: the commit's files
(`git archive`) and the patch applied on top (`git apply`), in a folder of its own, so that `moe_rl.reproduce` reruns
a run with the code that made it rather than with today's. Machine paths (the checkout's location, the working
folder) never enter meta.json: `portable` writes them relative.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from moe_rl.run.atomic import write_atomic

log = logging.getLogger(__name__)
PATCHES = ".code"  # beside a folder's run folders, hidden like Hydra's and the sweep progress's own
CODE_PATHS = ("moe_rl", "experiments", "pyproject.toml")  # what a rerun imports and composes its config from


def git(args: list[str], cwd: Path | None = None, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`git ARGS` in `cwd` (default: this package's checkout), text out; a missing git is a failed process."""
    try:
        return subprocess.run(
            ["git", *args], cwd=cwd or Path(__file__).parent, capture_output=True, text=True, timeout=60, **kwargs
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return subprocess.CompletedProcess(["git", *args], 128, "", str(err))


def checkout_root() -> Path | None:
    """The top of the git checkout this package was imported from (None outside one)."""
    out = git(["rev-parse", "--show-toplevel"])
    return Path(out.stdout.strip()) if out.returncode == 0 else None


def tree_diff(root: Path) -> str:
    """The checkout's code changes against HEAD as a binary patch: tracked edits and the files git neither tracks
    nor ignores, under `CODE_PATHS` only (a run's own outputs, docs and tests are not its code), read through a copy
    of the index so the user's is untouched; "" for a clean tree."""
    index = root / git(["rev-parse", "--git-path", "index"], cwd=root).stdout.strip()  # root / absolute: itself
    with tempfile.TemporaryDirectory(prefix="moe_rl_index_") as tmp:
        scratch = Path(tmp) / "index"
        if index.is_file():
            shutil.copyfile(index, scratch)
        env = {**os.environ, "GIT_INDEX_FILE": str(scratch)}
        added = git(["add", "--all", "--", *CODE_PATHS], cwd=root, env=env)
        if added.returncode != 0:
            raise RuntimeError(f"git add (into a scratch index) failed in {root}: {added.stderr.strip()}")
        diff = git(
            ["diff", "--cached", "--binary", "--no-color", "--no-ext-diff", "HEAD", "--", *CODE_PATHS],
            cwd=root,
            env=env,
        )
    if diff.returncode != 0:
        raise RuntimeError(f"git diff failed in {root}: {diff.stderr.strip()}")
    return diff.stdout


def store_patch(patch: str, folder: Path) -> str:
    """Write `patch` once under `folder`/.code/ named by its sha256; that name (what meta.json records)."""
    digest = hashlib.sha256(patch.encode()).hexdigest()
    path = folder / PATCHES / f"{digest}.patch"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, patch)
    return digest


def code_record(run_dir: Path) -> dict[str, Any]:
    """meta.json's code fields: `git_sha`, `git_dirty` (the code differed from the commit, untracked files under
    `CODE_PATHS` that git does not ignore included) and, when dirty, `git_diff` (the sha256 of the patch stored
    beside the run folder). Where git fails, `git_dirty` None and `code_error` say so: the run goes on."""
    root = checkout_root()
    sha = git(["rev-parse", "HEAD"]).stdout.strip() if root else ""
    if not root or not sha:
        return {"git_sha": "unknown", "git_dirty": None}
    try:
        patch = tree_diff(root)
    except (RuntimeError, OSError) as err:  # provenance must never cost the run
        log.warning("could not record the run's code changes: %s", err)
        return {"git_sha": sha, "git_dirty": None, "code_error": str(err)}
    record: dict[str, Any] = {"git_sha": sha, "git_dirty": bool(patch)}
    if patch:
        record["git_diff"] = store_patch(patch, Path(run_dir).parent)
    return record


def patch_path(run_dir: Path, digest: str) -> Path:
    return Path(run_dir).parent / PATCHES / f"{digest}.patch"


@functools.lru_cache(maxsize=4096)
def has_commit(repo: Path, sha: str) -> bool:
    """Whether `repo` holds commit `sha` (asked once per commit: a folder's runs share a few)."""
    return git(["cat-file", "-e", f"{sha}^{{commit}}"], cwd=repo).returncode == 0


def rebuildable(run_dir: Path, meta: dict[str, Any], repo: Path) -> str | None:
    """Why the code of the run in `run_dir` (its meta.json `meta`) cannot be rebuilt from `repo`, or None when it
    can: its commit is in the repository and, if its tree was dirty, its patch is stored."""
    sha = meta.get("git_sha")
    if not sha or sha == "unknown":
        return "no commit recorded"
    if not has_commit(repo, sha):
        return f"commit {sha[:10]} is not in this repository"
    if meta.get("code_error"):
        return "its code changes could not be recorded"
    if meta.get("git_dirty"):
        digest = meta.get("git_diff")
        if not digest:
            return "its tree had uncommitted changes that were not recorded"
        if not patch_path(run_dir, digest).is_file():
            return f"its patch {PATCHES}/{digest[:12]}.patch is missing"
    return None


def rebuild(repo: Path, sha: str, patch: Path | None, dest: Path) -> Path:
    """The tree a run ran (`CODE_PATHS` of commit `sha` of `repo`, then `patch` applied) written into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", sha, "--", *CODE_PATHS], cwd=repo, capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {sha[:10]} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    if patch is not None:
        include = [f"--include={p}{tail}" for p in CODE_PATHS for tail in ("", "/*")]
        outside = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.absolute().parent)}  # a plain folder, no repo
        applied = git(["apply", "--binary", *include, str(patch.absolute())], cwd=dest, env=outside)
        if applied.returncode != 0:
            raise RuntimeError(f"the run's patch {patch.name} does not apply to {sha[:10]}: {applied.stderr.strip()}")
    return dest


def portable(value: Any, roots: tuple[Path, ...]) -> Any:
    """`value` (meta.json's contents) with every string's `roots` prefixes (the checkout, the working folder)
    removed, so that no machine path is recorded: "/home/me/moe_rl/experiments/train.py" -> "experiments/train.py"."""
    if isinstance(value, dict):
        return {k: portable(v, roots) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, roots) for v in value]
    if isinstance(value, str):
        for root in sorted({str(r).rstrip("/") for r in roots if str(r) not in ("", "/")}, key=len, reverse=True):
            value = re.sub(re.escape(root) + r"(/|(?![^\s\"'=,:;]))", lambda m: "" if m.group(1) else ".", value)
        return value
    return value
