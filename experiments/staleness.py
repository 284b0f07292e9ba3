"""Run the staleness study (`experiments/conf/preset/staleness.yaml`, `moe_rl.studies.staleness`).

    python experiments/staleness.py                       # runs into results/staleness/runs, axis by axis
    python experiments/staleness.py --dry-run             # print the multiruns and stop
    python experiments/staleness.py --jobs 2 --runs runs  # 2 runs at a time, into runs/staleness/runs

One Hydra multirun of `experiments/train.py` (`+preset=staleness`) per value of an axis (its arms x the preset's seeds);
the base point (S = 1, k = 0) first, one run per arm and seed shared by both axes. Rerunning resumes: a finished run is read.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from moe_rl.studies import staleness as st

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def command(
    arms: tuple[str, ...], overrides: list[str], seeds: tuple[int, ...], results_dir: Path, jobs: int
) -> list[str]:
    cmd = [sys.executable, str(HERE / "train.py"), "-m", "+preset=staleness", f"out_dir={results_dir}/staleness/runs"]
    cmd += ["progress=false", "threads=1", "hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"]
    cmd.append("arm=" + ",".join(arms))
    return [*cmd, *overrides, "seed=" + ",".join(str(s) for s in seeds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=ROOT / "results", help="runs land in <runs>/staleness/runs")
    ap.add_argument("--presets", type=Path, default=HERE / "conf" / "preset")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    spec = st.load_spec(args.presets)
    for arms, overrides in st.jobs(spec):
        cmd = command(arms, overrides, spec.seeds, args.runs, args.jobs)
        print(" ".join(cmd[1:]), flush=True)
        if not args.dry_run:
            code = subprocess.run(cmd, cwd=ROOT).returncode
            if code != 0:
                sys.exit(f"staleness: the multirun of {','.join(arms)} {' '.join(overrides)} exited {code}")


if __name__ == "__main__":
    main()
