"""Runs per hour: the same small sweep, eager and compiled, as 2 jobs of 1 thread and as 1 job of 2 threads.

    python benchmarks/sweep_throughput.py [--arms grpo_none,grpo_r2] [--seeds 0,1,2,3] [--steps 60]
                                          [--modes eager,compiled] [--layouts 2x1,1x2] [--repeats 1]
                                          [--length L] [--set KEY=VALUE ...] [--keep DIR]

Each setting is one Hydra multirun of `experiments/train.py` over arms x seeds (8 runs of the default model by
default), launched as the studies launch theirs (`moe_rl.studies.launch`: the joblib launcher, `progress=false`):
`eager` or `compile=true`, and a layout `JxT`, J runs at a time of T torch threads each. Every setting's runs land in
a fresh temporary folder (`--keep DIR`: under DIR, kept), so none is skipped as finished. The clock is the multirun's wall time, start to end, so it
holds what a sweep pays: the processes' start, the cold start's cache read, the compile (paid once per joblib worker
process, since a worker's later runs reuse its compiled graphs) and the evaluations. It prints each setting's wall
time and runs per hour, then, per repeat and as medians over repeats, compiled/eager runs per hour for each layout
and 2x1/1x2 for each mode (above 1: the first is faster).

Settings run in one order and then the reverse on odd repeats (ABBA), so a slow spell of the machine hits both sides
of a ratio. Quote the ratios; the absolute rates vary with the machine and its load.

`--length L` runs the length study's task at responses of L digits (`+preset=length`, its task overrides and
its `stable` level lr at L; seeds should be pool members whose start is in band on this machine); `--set` adds any
override to every run (e.g. `--set model=qwen3_moe_fine`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_rl.run.launch import finished_status
from moe_rl.studies.length import load_spec

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "experiments" / "train.py"
PRESETS = ROOT / "experiments" / "conf" / "preset"


def length_overrides(length: int) -> list[str]:
    """The length study's run at L digits: its preset, its task overrides at L and its `stable` level's lr at L."""
    spec = load_spec(PRESETS)
    if length not in spec.lengths:
        raise SystemExit(f"--length {length}: the length study has lengths {list(spec.lengths)}")
    return ["+preset=length", *spec.task_overrides(length), f"optim.lr={spec.levels['stable'].lr[length]}"]


def parse_layout(text: str) -> tuple[int, int]:
    jobs, _, threads = text.partition("x")
    if not (jobs.isdigit() and threads.isdigit() and int(jobs) > 0 and int(threads) > 0):
        raise SystemExit(f"layout {text!r}: expected JxT, e.g. 2x1 (J runs at a time, T threads each)")
    return int(jobs), int(threads)


def sweep_command(args: argparse.Namespace, mode: str, layout: str, out_dir: Path) -> list[str]:
    jobs, threads = parse_layout(layout)
    cmd = [sys.executable, str(TRAIN), "-m"]
    cmd += length_overrides(args.length) if args.length else []
    cmd += [
        f"out_dir={out_dir}",
        f"{'arm' if args.length else '+arm'}={args.arms}",  # the length preset's defaults list holds an arm
        f"seed={args.seeds}",
        f"steps={args.steps}",
        f"compile={str(mode == 'compiled').lower()}",
        f"threads={threads}",
        "progress=false",
        "hydra/launcher=joblib",
        f"hydra.launcher.n_jobs={jobs}",
        *args.set,
    ]
    return cmd


def run_sweep(cmd: list[str], log: Path) -> float:
    """Wall seconds of one multirun; its output goes to `log`, and a failure exits naming it."""
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"the sweep exited {code}: {' '.join(cmd[1:])}\n{log.read_text()[-2000:]}")
    return seconds


def finished_runs(out_dir: Path) -> int:
    return sum(finished_status(run, None) is not None for run in out_dir.iterdir() if run.is_dir())


def ratio_lines(rate: dict[tuple[str, str], list[float]], args: argparse.Namespace) -> list[str]:
    """compiled/eager per layout and first layout / other layouts per mode: per repeat, then the median."""
    modes, layouts = args.modes.split(","), args.layouts.split(",")
    pairs = [
        (f"compiled / eager, {layout}", ("compiled", layout), ("eager", layout))
        for layout in layouts
        if {"compiled", "eager"} <= set(modes)
    ]
    pairs += [
        (f"{layouts[0]} / {other}, {mode}", (mode, layouts[0]), (mode, other))
        for mode in modes
        for other in layouts[1:]
    ]
    lines = []
    for label, a, b in pairs:
        ratios = [x / y for x, y in zip(rate[a], rate[b])]
        each = ", ".join(f"{r:.2f}" for r in ratios)
        lines.append(f"{label:<28} {statistics.median(ratios):.2f}x  (runs per hour; per repeat: {each})")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="grpo_none,grpo_r2")
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--layouts", default="2x1,1x2")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--length", type=int, default=None, help="the length study's task at L digits")
    parser.add_argument("--set", action="append", default=[], help="an override for every run (repeatable)")
    parser.add_argument("--keep", default=None, help="keep each setting's runs and log under this folder")
    args = parser.parse_args(argv)
    for mode in args.modes.split(","):
        if mode not in ("eager", "compiled"):
            raise SystemExit(f"mode {mode!r}: expected eager or compiled")
    if args.keep and Path(args.keep).exists() and any(Path(args.keep).iterdir()):
        raise SystemExit(f"--keep {args.keep}: not empty (its finished runs would be skipped, not timed)")
    settings = [(mode, layout) for mode in args.modes.split(",") for layout in args.layouts.split(",")]
    for _, layout in settings:
        parse_layout(layout)
    n_runs = len(args.arms.split(",")) * len(args.seeds.split(","))
    task = f"the length task at L = {args.length}" if args.length else "the default task"
    print(
        f"{n_runs} runs per sweep ({args.arms} x seeds {args.seeds}), {args.steps} steps, {task}; "
        f"{args.repeats} repeat(s) of {len(settings)} settings, wall clock",
        flush=True,
    )
    rate: dict[tuple[str, str], list[float]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory(prefix="sweep_throughput_") as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for repeat in range(args.repeats):
            for mode, layout in settings if repeat % 2 == 0 else settings[::-1]:
                out_dir = Path(tmp) / f"{repeat}_{mode}_{layout}"
                seconds = run_sweep(sweep_command(args, mode, layout, out_dir), Path(tmp) / f"{out_dir.name}.log")
                done = finished_runs(out_dir)
                if done != n_runs:
                    raise SystemExit(f"{mode} {layout}: {done} of {n_runs} runs finished")
                rate[(mode, layout)].append(n_runs / seconds * 3600)
                print(
                    f"{mode:<8} {layout:<4} repeat {repeat}: {seconds:7.1f} s  {rate[(mode, layout)][-1]:6.1f} runs/h",
                    flush=True,
                )
    print("-- medians --")
    for mode, layout in settings:
        print(f"{mode:<8} {layout:<4} {statistics.median(rate[(mode, layout)]):6.1f} runs/h")
    for line in ratio_lines(rate, args):
        print(line)


if __name__ == "__main__":
    main()
