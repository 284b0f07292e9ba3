"""Resident memory of a long run: peak RSS at step 100 and at step 1000 (issue: flat memory).

    python benchmarks/long_run_memory.py [--steps 1000] [--out /tmp/moe_rl_memory]

Metric rows are streamed to disk at every checkpoint (`metrics/part-*.parquet`) and route
snapshots are written as they are taken, so RSS should not grow with the number of steps.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import time
from pathlib import Path

from moe_rl.config import TrainConfig
from moe_rl.train import Trainer


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class MeasuredTrainer(Trainer):
    marks: dict[int, tuple[float, float]] = {}

    def step(self, step: int) -> dict[str, float]:
        metrics = super().step(step)
        if step in (10, 100, 1000) or step == self.cfg.steps:
            now = rss_mib()  # the kernel updates ru_maxrss lazily: it can trail the current RSS by a page or so
            self.marks[step] = (max(peak_rss_mib(), now), now)
        return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--out", default="/tmp/moe_rl_memory")
    parser.add_argument(
        "--cold-start-steps",
        type=int,
        default=None,
        help="cap the cold start and accept any accuracy (default: the config's cold start)",
    )
    parser.add_argument("--eval-every", type=int, default=250)
    args = parser.parse_args(argv)  # argv: the smoke tests run main in-process at tiny sizes
    shutil.rmtree(args.out, ignore_errors=True)
    cfg = TrainConfig(
        out_dir=args.out,
        steps=args.steps,
        eval_every=args.eval_every,
        eval_size=16,
        snapshot_every=50,
        checkpoint_every=50,
        progress=False,
    )
    if args.cold_start_steps is not None:
        cfg.cold_start.band = [0.0, 1.0]
        cfg.cold_start.max_steps = cfg.cold_start.eval_every = args.cold_start_steps
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 4, 4
    cfg.optim.updates_per_rollout = 2
    start = time.perf_counter()
    MeasuredTrainer(cfg).run()
    print(f"{args.steps} steps in {time.perf_counter() - start:.0f} s")
    for step, (peak, now) in sorted(MeasuredTrainer.marks.items()):
        print(f"step {step:5d}: peak RSS {peak:7.1f} MiB   current RSS {now:7.1f} MiB")
    marks = MeasuredTrainer.marks
    if 100 in marks and args.steps in marks:
        print(f"peak RSS step {args.steps} / step 100: {marks[args.steps][0] / marks[100][0]:.3f}x")


if __name__ == "__main__":
    main()
