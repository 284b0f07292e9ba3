"""Run the length study (`experiments/conf/preset/length.yaml`, `moe_rl.studies.length`).

    python experiments/length.py                       # runs into results/length/runs, in the preset's order
    python experiments/length.py --dry-run             # print the multiruns and stop
    python experiments/length.py --jobs 2 --runs runs  # 2 runs at a time, into runs/length/runs
    python experiments/length.py --blocks 1,2          # only blocks 1 and 2 (the preset's run order)
    python experiments/length.py --lengths 4,16        # only these lengths

One Hydra multirun of `experiments/train.py` (`+preset=length`) per block, level and length: its arms x the block's
seeds, at the length's level lr, with the task overrides that pin the length. The pool members the runs start from
are warmed first (`--jobs` at a time); a seed whose member's warm-up ended outside its band is skipped (a start RL
cannot move either way; the study leaves such runs out of every contrast). Rerunning resumes: a finished run is read,
not rerun, and a seed whose runs are all finished is neither warmed nor launched.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from moe_rl.run.launch import finished_status, short_name
from moe_rl.studies import length
from moe_rl.studies.launch import multirun, run_multiruns

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def command(
    spec: length.Spec, size: int, arms: tuple[str, ...], lr: float, seeds: tuple[int, ...], runs: Path, jobs: int
) -> list[str]:
    cmd = multirun(HERE / "train.py", "length", runs, jobs)
    cmd += [*spec.task_overrides(size), "arm=" + ",".join(arms), f"optim.lr={lr:.6g}"]
    return [*cmd, "seed=" + ",".join(str(s) for s in seeds)]


def finished(runs: Path, overrides: list[str], arm: str, lr: float, seed: int) -> bool:
    """Whether the run of `arm` at `seed` has finished in <runs>/length/runs (its folder named as Hydra's multirun
    names it: the sorted overrides, `short_name`)."""
    name = short_name(",".join(sorted([*overrides, f"arm={arm}", f"optim.lr={lr:.6g}", f"seed={seed}"])))
    return finished_status(runs / "length" / "runs" / name, None) is not None


def member_overrides(overrides: list[str], seed: int) -> list[str]:
    """The Hydra overrides of a run of the preset at `seed` (one thread, as `multirun` launches it)."""
    return ["+preset=length", *overrides, f"seed={seed}", "threads=1"]


def warm(overrides: list[str], conf: Path) -> dict:
    """Warm (or read) the pool member a run of `overrides` starts from, its progress logged (a worker process)."""
    import logging

    from moe_rl.forecast import compose_config
    from moe_rl.loop.cold_start import warm_member

    cfg = compose_config(overrides, conf)  # (Hydra's compose configures logging: set it after)
    logging.basicConfig(level=logging.INFO, format=f"[warm-up seed {cfg.seed}] %(message)s", force=True)
    return warm_member(cfg)


def live_seeds(
    overrides: list[str], seeds: tuple[int, ...], *, jobs: int, warm_first: bool, label: str, conf: Path
) -> tuple[int, ...]:
    """`seeds` less those whose pool member's warm-up ended outside its band (a start RL cannot move either way),
    warming the members first (`jobs` at a time, in fresh processes) when `warm_first`; prints each member's state."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from moe_rl.forecast import compose_config
    from moe_rl.loop.cold_start import cached_member

    runs = {s: member_overrides(overrides, s) for s in seeds}
    states: dict[int, dict | None]
    if warm_first:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            states = dict(zip(runs, pool.map(warm, runs.values(), [conf] * len(runs)), strict=True))
    else:
        states = {s: cached_member(compose_config(o, conf)) for s, o in runs.items()}
    for s, st in states.items():
        state = "not warmed" if st is None else f"{st['steps']} SFT steps, accuracy {st['accuracy']:.3f}"
        print(f"{label} seed {s}: start {state}" + ("" if st is None or st["in_band"] else ", out of band: skipped"))
    return tuple(s for s, st in states.items() if st is None or st["in_band"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=ROOT / "results", help="runs land in <runs>/length/runs")
    ap.add_argument("--presets", type=Path, default=HERE / "conf" / "preset")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--blocks", default=None, help="run only these blocks (1-based, in the preset's order), e.g. 1,2")
    ap.add_argument("--lengths", default=None, help="run only these lengths, comma-separated (e.g. 4,16)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    os.chdir(ROOT)  # the warm-ups read and fill the cold-start cache where the runs will (relative to the root)
    spec = length.load_spec(args.presets)
    if args.blocks is not None:
        spec = length.only_blocks(spec, [int(b) for b in args.blocks.split(",")])
    lengths = None if args.lengths is None else {int(x) for x in args.lengths.split(",")}
    parts = []
    for level, size, arms, lr, seeds in length.jobs(spec):
        if lengths is not None and size not in lengths:
            continue
        label = f"[{level} L={size}]"
        over = spec.task_overrides(size)
        seeds = tuple(s for s in seeds if not all(finished(args.runs, over, a, lr, s) for a in arms))
        if not seeds:
            print(f"{label} every run finished")
            continue
        seeds = live_seeds(over, seeds, jobs=args.jobs, warm_first=not args.dry_run, label=label, conf=HERE / "conf")
        if seeds:
            parts.append(
                (
                    label + " ",
                    f"{','.join(arms)} at lr {lr:g}",
                    command(spec, size, arms, lr, seeds, args.runs, args.jobs),
                )
            )
    run_multiruns(parts, study="length", cwd=ROOT, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
