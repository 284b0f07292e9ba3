"""Run the causal study (`experiments/conf/preset/causal.yaml`, `moe_rl.studies.causal`).

    python experiments/causal.py                       # runs into results/causal/runs, in the preset's order
    python experiments/causal.py --dry-run             # print the multiruns and stop
    python experiments/causal.py --jobs 2 --runs runs  # 2 runs at a time, into runs/causal/runs

One Hydra multirun of `experiments/train.py` (`+preset=causal`) per block, level and lr: its arms (rung files) x the
preset's seeds (6 cold starts x 2 seeds). Rerunning resumes: a finished run is read, not rerun.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_rl.studies import causal
from moe_rl.studies.launch import multirun, run_multiruns

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def command(rungs: tuple[str, ...], lr: float, seeds: tuple[int, ...], results_dir: Path, jobs: int) -> list[str]:
    cmd = multirun(HERE / "train.py", "causal", results_dir, jobs)
    return [*cmd, "+rung=" + ",".join(rungs), f"optim.lr={lr:.6g}", "seed=" + ",".join(str(s) for s in seeds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=ROOT / "results", help="runs land in <runs>/causal/runs")
    ap.add_argument("--presets", type=Path, default=HERE / "conf" / "preset")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    spec = causal.load_spec(args.presets)
    parts = [
        (f"[{level}] ", f"{','.join(rungs)} at lr {lr:g}", command(rungs, lr, spec.seeds, args.runs, args.jobs))
        for level, rungs, lr in causal.jobs(spec)
    ]
    run_multiruns(parts, study="causal", cwd=ROOT, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
