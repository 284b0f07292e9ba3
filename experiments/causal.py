"""Run the causal study (`experiments/conf/preset/causal.yaml`, `moe_rl.studies.causal`).

    python experiments/causal.py                       # runs into results/causal/runs, in the preset's order
    python experiments/causal.py --dry-run             # print the multiruns and stop
    python experiments/causal.py --jobs 2 --runs runs  # 2 runs at a time, into runs/causal/runs

One Hydra multirun of `experiments/train.py` (`+preset=causal`) per block, level and lr: its arms (rung files) x the
preset's seeds (6 cold starts x 2 seeds). Rerunning resumes: a finished run is read, not rerun.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from moe_rl.studies import causal

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def command(rungs: tuple[str, ...], lr: float, seeds: tuple[int, ...], results_dir: Path, jobs: int) -> list[str]:
    cmd = [sys.executable, str(HERE / "train.py"), "-m", "+preset=causal", f"out_dir={results_dir}/causal/runs"]
    cmd += ["progress=false", "threads=1", "hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"]
    return [*cmd, "+rung=" + ",".join(rungs), f"optim.lr={lr:.6g}", "seed=" + ",".join(str(s) for s in seeds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=ROOT / "results", help="runs land in <runs>/causal/runs")
    ap.add_argument("--presets", type=Path, default=HERE / "conf" / "preset")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    spec = causal.load_spec(args.presets)
    for level, rungs, lr in causal.jobs(spec):
        cmd = command(rungs, lr, spec.seeds, args.runs, args.jobs)
        print(f"[{level}] " + " ".join(cmd[1:]), flush=True)
        if not args.dry_run:
            code = subprocess.run(cmd, cwd=ROOT).returncode
            if code != 0:
                sys.exit(f"causal: the multirun of {','.join(rungs)} at lr {lr:g} exited {code}")


if __name__ == "__main__":
    main()
