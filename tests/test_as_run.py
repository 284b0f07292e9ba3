"""The studies declared as they ran (`experiments/conf/study/<name>.yaml` with `declared`): `experiments/study.py`
names every shipped run as its multirun named it (so it reads them, not reruns them), and nothing else (every cell
composes and validates through Hydra: tests/test_study.py). The sweeps their presets ran, re-read by the one rule
(`as_ran`): each run folder's name puts it in one cell at one seed, every seed a cell declares is a shipped run, and
the rule reads a start's pairs as the runs say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import PRESETS, ROOT, study_dry_run

from moe_rl.analysis.load import load_results
from moe_rl.analysis.outcomes import finished_runs
from moe_rl.run.launch import short_name
from moe_rl.studies.design import AsRan, load_study, study_files
from moe_rl.studies.study_rule import analyse

AS_RUN = {"causal": 252, "divergence": 192, "length": 237, "staleness": 522}  # the shipped runs of each
# the sweeps re-read by the one rule (`as_ran`): the runs each declaration's cells read, of the folder's
AS_RAN = {"dense_control": 32, "drift_scaling": 16, "engine_mismatch": 16, "frontier": 80, "mechanism": 24, "phase": 72}
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
    studies = [load_study(p) for p in study_files(PRESETS.parent / "study")]
    assert {s.name for s in studies if s.declared and s.as_ran is None} == set(AS_RUN)
    assert {s.name for s in studies if s.as_ran is not None} == set(AS_RAN)


@pytest.mark.parametrize("name", sorted(AS_RUN))
def test_the_declared_launcher_names_every_shipped_run(name: str) -> None:
    shipped = {
        f"{p.parent.parent.name}/{p.parent.name}" for p in (ROOT / "results" / name / "runs").glob("*/*/status.json")
    }
    listed = dry_run_runs(name)
    assert len(listed) == AS_RUN[name] and listed == shipped


def test_a_run_folder_name_gives_its_cell_and_the_studys_seed() -> None:
    """The overrides in a run's name, less its seed and member, are one cell's (numbers in any spelling); run seed s of
    member m reads as m + s * pool; a name no cell lists, or without a seed, is no run of the study."""
    cells = {
        "none@hi": frozenset({"arm=grpo_none", "optim.lr=0.00025", "optim.updates_per_rollout=8.0"}),
        "moe@base": frozenset({"+rung=moe"}),
    }
    flat = AsRan()
    assert flat.cell_and_seed("arm=grpo_none,optim.lr=2.5e-4,optim.updates_per_rollout=8,seed=10", cells, 1) == (
        "none@hi",
        10,
    )
    assert flat.cell_and_seed("arm=grpo_none,optim.lr=0.0003,optim.updates_per_rollout=8,seed=1", cells, 1) is None
    assert flat.cell_and_seed("arm=grpo_none,optim.lr=0.00025,optim.updates_per_rollout=8", cells, 1) is None
    ladder = AsRan(member="cold_start.seed")
    assert ladder.cell_and_seed("+rung=moe,cold_start.seed=1,seed=3", cells, 2) == ("moe@base", 1 + 3 * 2)
    assert ladder.cell_and_seed("+rung=moe,cold_start.seed=0,seed=3", cells, 2) == ("moe@base", 6)


@pytest.mark.parametrize("name", sorted(AS_RAN))
def test_every_seed_a_re_read_cell_declares_is_one_shipped_run(name: str) -> None:
    study = load_study(PRESETS.parent / "study" / f"{name}.yaml")
    assert study.as_ran is not None
    cells = study.as_ran_cells()
    found = [
        hit
        for p in (ROOT / "results" / name / "runs").iterdir()
        if (hit := study.as_ran.cell_and_seed(p.name, cells, study.member_pool))
    ]
    declared = {(f"{a}@{lv}", s) for a, lv in study.cells() for s in study.seeds(len(study.members), (a, lv))}
    assert len(found) == len(set(found)) == AS_RAN[name] and set(found) == declared


def test_the_rule_reads_a_re_read_sweep_as_its_runs_say() -> None:
    """engine_mismatch's gentle cell: R3 - R2 by seed, computed here from the run folders (their meta.json and
    metrics), is the rule's estimate on its one cold start; one start is too few to decide (3 needed)."""
    study = load_study(PRESETS.parent / "study" / "engine_mismatch.yaml")
    runs = ROOT / "results" / "engine_mismatch" / "runs"
    change: dict[tuple[str, int], float] = {}
    for arm in ("grpo_r2", "grpo_r3"):
        for d in sorted(runs.glob(f"arm={arm},optim.lr=0.00065,seed=*")):
            table = finished_runs(load_results(d))
            seed = json.loads((d / "meta.json").read_text())["seed"]
            change[arm, seed] = float(table["change"].iloc[0])
    by_seed = [change["grpo_r3", s] - change["grpo_r2", s] for s in range(8)]
    row = analyse(study, runs).verdicts.set_index("contrast").loc["r3_minus_r2"]
    assert (row["starts"], row["pairs"]) == (1, 8)
    assert row["estimate"] == pytest.approx(sum(by_seed) / 8, abs=1e-12)
    assert (row["verdict"], row["reason"]) == ("inconclusive", "pool limit reached with 1 start, fewer than 3")


def test_a_re_read_sweep_is_not_launched(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("study_cli", ROOT / "experiments" / "study.py")
    assert spec is not None and spec.loader is not None
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    with pytest.raises(SystemExit, match="re-reads runs its presets made \\(as_ran\\): launch those presets"):
        cli.main(["phase", "--runs", str(Path("/nonexistent"))])
