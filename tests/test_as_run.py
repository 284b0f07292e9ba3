"""The studies declared as they ran (`experiments/conf/study/<name>.yaml` with `declared`): `experiments/study.py`
names every shipped run as its multirun named it (so it reads them, not reruns them), and nothing else (every cell
composes and validates through Hydra: tests/test_study.py)."""

from __future__ import annotations

import pytest
from helpers import PRESETS, ROOT, study_dry_run

from moe_rl.run.launch import short_name
from moe_rl.studies.design import load_study, study_files

AS_RUN = {"causal": 252, "divergence": 192, "length": 237, "staleness": 522}  # the shipped runs of each
EXCLUDED = {"experiment", "out_dir", "progress", "threads", "hydra.launcher.n_jobs"}  # config.yaml's override_dirname


def run_name(overrides: list[str], seed: int) -> str:
    """The run folder Hydra's multirun names a job (its task overrides sorted, the excluded keys left out, a long
    name cut and hashed as config.yaml's `short_name` resolver does)."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+") not in EXCLUDED]
    return short_name(",".join(sorted([*kept, f"seed={seed}"])))


def dry_run_runs(name: str) -> set[str]:
    """<cell>/<run name> of every run the study's dry run lists."""
    out = study_dry_run(None, name)
    assert out.returncode == 0, out.stderr
    runs = set()
    for line in out.stdout.splitlines():
        if not line.startswith("["):
            continue
        cell, *tokens = line.split()
        overrides = [t for t in tokens if "=" in t and not t.startswith(("seed=", "hydra/", "+preset="))]
        seeds = next(t for t in tokens if t.startswith("seed=")).split("=", 1)[1].split(",")
        runs |= {f"{cell.strip('[]')}/{run_name(overrides, int(s))}" for s in seeds}
    return runs


def test_every_study_declared_as_it_ran_is_checked_here() -> None:
    declared = {p.stem for p in study_files(PRESETS.parent / "study") if load_study(p).declared}
    assert declared == set(AS_RUN)


@pytest.mark.parametrize("name", sorted(AS_RUN))
def test_the_declared_launcher_names_every_shipped_run(name: str) -> None:
    shipped = {
        f"{p.parent.parent.name}/{p.parent.name}" for p in (ROOT / "results" / name / "runs").glob("*/*/status.json")
    }
    listed = dry_run_runs(name)
    assert len(listed) == AS_RUN[name] and listed == shipped
