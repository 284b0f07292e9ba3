"""Run a declared study (`experiments/conf/study/NAME.yaml`, `moe_rl.studies.design`) look by look.

    python experiments/study.py NAME --dry-run            # the declaration's multiruns, nothing run
    python experiments/study.py NAME [--jobs 2] [--runs results] [--look K]

One Hydra multirun of `experiments/train.py` per cell (arm@level) over the seeds of the look's starts, into
<runs>/NAME/runs/<arm>@<level>/. A look runs the starts up to its declared count (the earlier looks' runs are read,
not rerun), then decides each contrast at that look by the one rule (`moe_rl.studies.declared`) and writes the
study's report into <runs>/NAME/. The looks run in order, stopping after the first at which every contrast has
reached its boundary, else at the last (a floor or a flat reference at an earlier look does not stop it: more starts
can change the means it is read on); `--look K` runs look K alone.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from moe_rl.studies.design import Study, load_study, study_path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STUDIES = HERE / "conf" / "study"


def cell_command(study: Study, arm: str, level: str, starts: int, runs: Path, jobs: int) -> list[str]:
    out = runs / study.name / "runs" / f"{arm}@{level}"
    seeds = ",".join(str(s) for s in study.seeds(starts, (arm, level)))
    return [
        sys.executable,
        "experiments/train.py",
        "-m",
        *study.run_overrides(arm, level),
        f"experiment={study.name}",
        f"out_dir={out}",
        f"seed={seeds}",
        "progress=false",
        "threads=1",
        "hydra/launcher=joblib",
        f"hydra.launcher.n_jobs={jobs}",
    ]


def run_look(study: Study, look: int, runs: Path, jobs: int, dry_run: bool) -> list[str]:
    """Every cell's multirun for the look's starts; the cells where a run failed (the others still run, and the
    look is decided on the pairs that finished)."""
    starts = study.design.looks[look]
    print(f"== {study.name}: look {look + 1} of {len(study.design.looks)}, {starts} starts", flush=True)
    failed = []
    for arm, level in study.cells():
        if not study.seeds(starts, (arm, level)):  # every seed of this look skipped as the study ran (`not_run`)
            continue
        cmd = cell_command(study, arm, level, starts, runs, jobs)
        print(f"[{arm}@{level}] " + " ".join(cmd[2:]), flush=True)
        if not dry_run and subprocess.run(cmd, cwd=ROOT).returncode != 0:
            failed.append(f"{arm}@{level}")
            print(f"{study.name}: a run of {arm}@{level} failed (its status.json says why); going on", flush=True)
    return failed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="a study declared in experiments/conf/study/")
    ap.add_argument("--runs", type=Path, default=Path("results"), help="runs land in <runs>/NAME/runs")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--look", type=int, default=None, help="run look K (1-based) only; default: each look in turn")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--studies", type=Path, default=STUDIES, help="the folder of declarations")
    args = ap.parse_args(argv)
    args.runs = args.runs.resolve()  # the runs are launched from the repository root and read from here
    try:
        study = load_study(study_path(args.name, args.studies))
    except ValueError as err:
        sys.exit(f"error: {err}")
    from moe_rl.studies.declared import analyse, decided
    from moe_rl.studies.declared_report import write_study_report

    looks = range(len(study.design.looks))
    if args.look is not None:
        if not 1 <= args.look <= len(looks):
            sys.exit(f"error: --look {args.look}: {study.name} declares looks 1..{len(looks)}")
        looks = range(args.look - 1, args.look)
    failed: list[str] = []
    for look in looks:
        failed += run_look(study, look, args.runs, args.jobs, args.dry_run)
        if args.dry_run:
            continue
        result = analyse(study, args.runs / study.name / "runs")
        write_study_report(study, result, args.runs / study.name)
        print(result.verdicts.to_string(index=False), flush=True)
        if decided(result):
            print(
                f"{study.name}: every contrast reached its boundary or its last look at look {look + 1}; stopping",
                flush=True,
            )
            break
    if failed:
        sys.exit(f"{study.name}: runs failed in {sorted(set(failed))}; rerun the same command to retry them")


if __name__ == "__main__":
    main()
