"""What the study launchers share (experiments/length.py; frontier.py runs
its own probes): one Hydra multirun of experiments/train.py per part of a study, run in order, stopping at the first
that fails. Rerunning resumes: a finished run is read, not rerun."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path


def multirun(train: Path, preset: str, results_dir: Path, jobs: int) -> list[str]:
    """The start of a multirun of `train` under `+preset=<preset>`: runs into <results_dir>/<preset>/runs, `jobs` at
    a time (joblib), one torch thread each, no progress bars."""
    cmd = [sys.executable, str(train), "-m", f"+preset={preset}", f"out_dir={results_dir}/{preset}/runs"]
    return [*cmd, "progress=false", "threads=1", "hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"]


def run_multiruns(parts: Iterable[tuple[str, str, list[str]]], *, study: str, cwd: Path, dry_run: bool = False) -> None:
    """Each (prefix, label, command) in order: print the prefix and the command's arguments, run it unless
    `dry_run`, and exit naming the study and the label at the first that fails."""
    for prefix, label, cmd in parts:
        print(prefix + " ".join(cmd[1:]), flush=True)
        if not dry_run:
            code = subprocess.run(cmd, cwd=cwd).returncode
            if code != 0:
                sys.exit(f"{study}: the multirun of {label} exited {code}")
