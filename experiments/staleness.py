"""Run the staleness study (`experiments/conf/preset/staleness.yaml`, `moe_rl.studies.staleness`).

    python experiments/staleness.py                       # runs into results/staleness/runs, axis by axis
    python experiments/staleness.py --dry-run             # print the multiruns and stop
    python experiments/staleness.py --jobs 2 --runs runs  # 2 runs at a time, into runs/staleness/runs
    python experiments/staleness.py --axis staleness_long --seeds 6-11  # one block, some of its seeds

One Hydra multirun of `experiments/train.py` (`+preset=staleness`) per value of an axis (its arms x its seeds); the
base point (S = 1, k = 0) first, one run per arm and seed shared by the axes of those seeds. Rerunning resumes: a finished run is read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_rl.studies import staleness as st
from moe_rl.studies.launch import multirun, run_multiruns

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def command(
    arms: tuple[str, ...], overrides: list[str], seeds: tuple[int, ...], results_dir: Path, jobs: int
) -> list[str]:
    cmd = multirun(HERE / "train.py", "staleness", results_dir, jobs)
    cmd.append("arm=" + ",".join(arms))
    return [*cmd, *overrides, "seed=" + ",".join(str(s) for s in seeds)]


def seed_range(text: str) -> set[int]:
    """`6-11` or `6,7,9` as a set of seeds."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            return set(range(lo, hi + 1))
        return {int(x) for x in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are 'A-B' or 'A,B,...' (integers), not {text!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=ROOT / "results", help="runs land in <runs>/staleness/runs")
    ap.add_argument("--presets", type=Path, default=HERE / "conf" / "preset")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--axis", action="append", default=[], help="run only this axis (its preset key); repeatable")
    ap.add_argument("--seeds", type=seed_range, help="only these of each axis' seeds, e.g. 6-11 or 6,7")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    spec = st.load_spec(args.presets)
    try:
        todo = st.jobs(spec, tuple(args.axis))
    except ValueError as e:
        ap.error(str(e))
    parts = []
    for arms, overrides, seeds in todo:
        chosen = tuple(s for s in seeds if args.seeds is None or s in args.seeds)
        if chosen:
            label = f"{','.join(arms)} {' '.join(overrides)}"
            parts.append(("", label, command(arms, overrides, chosen, args.runs, args.jobs)))
    if not parts:
        ap.error(f"no declared seed among {sorted(args.seeds or [])}")
    run_multiruns(parts, study="staleness", cwd=ROOT, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
