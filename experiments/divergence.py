"""Run the divergence frontier (`experiments/conf/preset/divergence.yaml`, `moe_rl.studies.divergence`).

    python experiments/divergence.py                      # runs into results/divergence/runs, rows in the preset's order
    python experiments/divergence.py --dry-run            # print the multiruns and stop
    python experiments/divergence.py --jobs 2 --runs runs # 2 runs at a time, into runs/divergence/runs
    python experiments/divergence.py --families qwen3_moe # only the MoE model's rows (and the lr^2 N block)

One Hydra multirun of `experiments/train.py` (`+preset=divergence`) per row: the row's lrs x the preset's seeds at
its N, then the lr^2 N block (the law's rows at its N). Rerunning resumes: a finished run is read, not rerun.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_rl.studies import divergence as dv
from moe_rl.studies.launch import multirun, run_multiruns

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def command(job: dv.Job, results_dir: Path, jobs: int) -> list[str]:
    cmd = multirun(HERE / "train.py", "divergence", results_dir, jobs)
    cmd.append(f"arm={job.arm}")
    if job.family != dv.REFERENCE[0]:
        cmd.append(f"model={job.family}")  # the model file of each family the study runs is named after it
    cmd.append("optim.lr=" + ",".join(f"{lr:g}" for lr in job.lrs))
    if job.N != job.default_N:
        cmd.append(f"optim.updates_per_rollout={job.N}")
    cmd.append("seed=" + ",".join(str(s) for s in job.seeds))
    return cmd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=ROOT / "results", help="runs land in <runs>/divergence/runs")
    ap.add_argument("--presets", type=Path, default=HERE / "conf" / "preset")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--families", nargs="+", default=None, help="only the rows of these model families (default: all)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    spec = dv.load_spec(args.presets)
    parts = [
        ("", f"{job.family}:{job.arm} at N = {job.N}", command(job, args.runs, args.jobs))
        for job in dv.jobs(spec)
        if args.families is None or job.family in args.families
    ]
    run_multiruns(parts, study="divergence", cwd=ROOT, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
