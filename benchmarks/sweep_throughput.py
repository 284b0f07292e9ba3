"""Runs per hour: one sweep under named settings, as 2 jobs of 1 thread and as 1 job of 2 threads.

    python benchmarks/sweep_throughput.py [--arms grpo_none,grpo_r2 | --block causal_past] [--seeds 0,1,2,3]
                                          [--steps 60] [--setting NAME=OVERRIDES ...] [--layouts 2x1,1x2]
                                          [--repeats 1] [--length L] [--set KEY=VALUE ...] [--keep DIR]

Each setting is one Hydra multirun of `experiments/train.py` over arms x seeds (8 runs of the default model by
default), launched as `experiments/study.py` launches a study's (the joblib launcher, `progress=false`),
with the setting's overrides (space-separated; default: `eager=` and `compiled=compile=true`) and a layout `JxT`,
J runs at a time of T torch threads each. `--block causal_past` sweeps the causal study's moe and anchored arms at
its `past` level (`+preset=causal`, their rungs, the level's lr, 200 steps unless `--steps` says otherwise) in place
of `--arms`. Every setting's runs land in a fresh temporary folder (`--keep DIR`: under DIR, kept), so none is
skipped as finished. The clock is the multirun's wall time, start to end, so it holds what a sweep pays: the
processes' start, the cold start's cache read, the compile (paid once per joblib worker process, since a worker's
later runs reuse its compiled graphs) and the evaluations. It prints each setting's wall time and runs per hour, then,
per repeat and as medians over repeats, each later setting / the first in runs per hour for each layout, and 2x1/1x2
for each setting (above 1: the first is faster); then each later setting / the first run by run (a run's own wall
time, status.json's `wall_s`, the same run under both settings paired): the ratio of their sums with a 95% bootstrap
interval over the runs, a spread that one repeat already gives.

`--clock cpu` times the sweep's processes' CPU time (user + system) instead of the wall clock: runs per CPU-hour,
which other load on the machine inflates far less (at one thread per run). Settings run in one order and then the
reverse on odd repeats (ABBA), so a slow spell of the machine hits both sides
of a ratio. Quote the ratios; the absolute rates vary with the machine and its load.

The instrument schedule's price (docs/performance.md), on the causal block:

    python benchmarks/sweep_throughput.py --block causal_past --seeds 0,1 --layouts 2x1 --repeats 2 \
        --setting off=metrics.update_kl_rows=0 --setting scheduled= --setting every=metrics.update_kl_window=null

`--length L` runs the length study's task at responses of L digits (`+preset=length`, its task overrides and
its `stable` level lr at L; seeds should be pool members whose start is in band on this machine); `--set` adds any
override to every run (e.g. `--set model=qwen3_moe_fine`).
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moe_rl.run.folder import read_status
from moe_rl.run.launch import finished_status
from moe_rl.studies.design import load_study

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "experiments" / "train.py"
PRESETS = ROOT / "experiments" / "conf" / "preset"


def length_overrides(length: int) -> list[str]:
    """The length study's run at L digits: its preset and its `stable_L<L>` level (the task overrides at L and
    the `stable` lr there; experiments/conf/study/length.yaml)."""
    study = load_study(PRESETS.parent / "study" / "length.yaml")
    level = f"stable_L{length}"
    if level not in study.levels:
        raise SystemExit(f"--length {length}: the length study has levels {sorted(study.levels)}")
    return ["+preset=length", *study.levels[level].overrides]


# a named block of a study: its sweep overrides (the arms a multirun sweeps) and its steps
BLOCKS = {"causal_past": (("+preset=causal", "+rung=moe,anchored", "optim.lr=4.0e-4"), 200)}


def parse_setting(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition("=")
    if not sep or not name.isidentifier():
        raise SystemExit(f"setting {text!r}: expected NAME=OVERRIDES, e.g. compiled=compile=true or eager=")
    return name, overrides.split()


def parse_layout(text: str) -> tuple[int, int]:
    jobs, _, threads = text.partition("x")
    if not (jobs.isdigit() and threads.isdigit() and int(jobs) > 0 and int(threads) > 0):
        raise SystemExit(f"layout {text!r}: expected JxT, e.g. 2x1 (J runs at a time, T threads each)")
    return int(jobs), int(threads)


def sweep_overrides(args: argparse.Namespace) -> list[str]:
    """The swept overrides: the block's, or the arms (after the length study's run at L where `--length`)."""
    if args.block:
        return list(BLOCKS[args.block][0])
    arms = f"{'arm' if args.length else '+arm'}={args.arms}"  # the length preset's defaults list holds an arm
    return [*(length_overrides(args.length) if args.length else []), arms]


def run_count(overrides: list[str]) -> int:
    """Runs a multirun over `overrides` makes: the product of their comma-separated value counts."""
    return math.prod(len(o.partition("=")[2].split(",")) for o in overrides)


def sweep_command(args: argparse.Namespace, setting: list[str], layout: str, out_dir: Path) -> list[str]:
    jobs, threads = parse_layout(layout)
    cmd = [sys.executable, str(TRAIN), "-m", *sweep_overrides(args)]
    cmd += [
        f"out_dir={out_dir}",
        f"seed={args.seeds}",
        f"steps={args.steps}",
        f"threads={threads}",
        "progress=false",
        "hydra/launcher=joblib",
        f"hydra.launcher.n_jobs={jobs}",
        *setting,
        *args.set,
    ]
    return cmd


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children, the sweep's processes among them."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_sweep(cmd: list[str], log: Path, clock: str = "wall") -> float:
    """Seconds of one multirun (`clock` wall: start to end; cpu: the CPU time of its processes, which other load on
    the machine inflates far less); its output goes to `log`, and a failure exits naming it."""
    start, cpu = time.perf_counter(), children_cpu()
    with log.open("w") as out:
        code = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start if clock == "wall" else children_cpu() - cpu
    if code != 0:
        raise SystemExit(f"the sweep exited {code}: {' '.join(cmd[1:])}\n{log.read_text()[-2000:]}")
    return seconds


def finished_runs(out_dir: Path) -> int:
    return sum(finished_status(run, None) is not None for run in out_dir.iterdir() if run.is_dir())


def run_key(folder: str, dropped: set[str]) -> str:
    """A run folder's name (Hydra's override list, `key=value` joined by commas) less the overrides of `dropped`."""
    return ",".join(t for t in folder.split(",") if t.partition("=")[0] not in dropped)


def run_seconds(out_dir: Path, setting: list[str]) -> dict[str, float]:
    """Each finished run's own wall time (its status.json `wall_s`: the loop, a worker's compile included, not the
    process's start), keyed by `run_key` less the setting's overrides, so that the same run under two settings has
    one key."""
    dropped = {o.partition("=")[0] for o in setting}
    return {
        run_key(run.name, dropped): read_status(run)["wall_s"]
        for run in out_dir.iterdir()
        if run.is_dir() and finished_status(run, None) is not None
    }


def paired_lines(
    seconds: dict[tuple[str, str], list[dict[str, float]]], names: list[str], layouts: list[str], resamples: int = 4000
) -> list[str]:
    """Each later setting / the first per layout, run by run: the runs' own wall times summed under the first over
    the same runs' under the later (a ratio of runs per hour of the runs' loops, each run paired with itself, over
    every repeat), with a 95% percentile bootstrap interval over the paired runs, resampled within each arm (a
    run's key less its seed): a spread that one repeat already gives. A worker's compile lands on its first runs,
    so the resampling moves it too."""
    rng = np.random.default_rng(0)
    lines = []
    for layout in layouts:
        for name in names[1:]:
            paired = [
                (key, first[key], later[key])
                for first, later in zip(seconds[(names[0], layout)], seconds[(name, layout)])
                for key in sorted(first.keys() & later.keys())
            ]
            if len(paired) < 2:
                continue
            pairs = np.array([(a, b) for _, a, b in paired])
            # resampled within each arm (the key less its seed), so every resample is the block's own mix of arms
            _, arm = np.unique([run_key(key, {"seed"}) for key, _, _ in paired], return_inverse=True)
            groups = [np.flatnonzero(arm == a) for a in range(arm.max() + 1)]
            picks = np.concatenate([rng.choice(g, size=(resamples, len(g))) for g in groups], axis=1)
            boot = pairs[picks, 0].sum(axis=1) / pairs[picks, 1].sum(axis=1)
            lo, hi = np.quantile(boot, [0.025, 0.975])
            label = f"{name} / {names[0]}, {layout}"
            lines.append(
                f"{label:<28} {pairs[:, 0].sum() / pairs[:, 1].sum():.2f}x  [{lo:.2f}, {hi:.2f}] (runs per hour of "
                f"the runs' loops, {len(pairs)} runs paired; 95% bootstrap interval over them)"
            )
    return lines


def ratio_lines(rate: dict[tuple[str, str], list[float]], names: list[str], layouts: list[str]) -> list[str]:
    """Each later setting / the first per layout and the first layout / each other per setting: per repeat, then
    the median."""
    pairs = [
        (f"{name} / {names[0]}, {layout}", (name, layout), (names[0], layout))
        for layout in layouts
        for name in names[1:]
    ]
    pairs += [
        (f"{layouts[0]} / {other}, {name}", (name, layouts[0]), (name, other))
        for name in names
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
    parser.add_argument("--steps", type=int, default=None, help="60, or the block's")
    parser.add_argument("--setting", action="append", default=[], help="NAME=OVERRIDES (repeatable)")
    parser.add_argument("--block", choices=sorted(BLOCKS), default=None, help="a study block in place of --arms")
    parser.add_argument("--layouts", default="2x1,1x2")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--length", type=int, default=None, help="the length study's task at L digits")
    parser.add_argument("--set", action="append", default=[], help="an override for every run (repeatable)")
    parser.add_argument("--keep", default=None, help="keep each setting's runs and log under this folder")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the sweep processes' CPU time")
    args = parser.parse_args(argv)
    if args.block and args.length:
        raise SystemExit("--block and --length: choose one")
    if args.block and args.steps is None:
        args.steps = BLOCKS[args.block][1]
    args.steps = args.steps or 60
    named = dict(parse_setting(text) for text in args.setting or ["eager=", "compiled=compile=true"])
    if args.keep and Path(args.keep).exists() and any(Path(args.keep).iterdir()):
        raise SystemExit(f"--keep {args.keep}: not empty (its finished runs would be skipped, not timed)")
    layouts = args.layouts.split(",")
    settings = [(name, layout) for name in named for layout in layouts]
    for layout in layouts:
        parse_layout(layout)
    swept = sweep_overrides(args)
    n_runs = run_count([o for o in swept if "," in o] + [f"seed={args.seeds}"])
    what = (
        f"block {args.block}"
        if args.block
        else f"the length task at L = {args.length}"
        if args.length
        else "the default task"
    )
    described = "; ".join(f"{name}: {' '.join(o) or 'defaults'}" for name, o in named.items())
    print(
        f"{n_runs} runs per sweep ({' '.join(swept)} x seeds {args.seeds}), {args.steps} steps, {what}; "
        f"{args.repeats} repeat(s) of {len(settings)} settings ({described}), {args.clock} clock",
        flush=True,
    )
    rate: dict[tuple[str, str], list[float]] = {s: [] for s in settings}
    seconds_by_run: dict[tuple[str, str], list[dict[str, float]]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory(prefix="sweep_throughput_") as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for repeat in range(args.repeats):
            for name, layout in settings if repeat % 2 == 0 else settings[::-1]:
                out_dir = Path(tmp) / f"{repeat}_{name}_{layout}"
                cmd = sweep_command(args, named[name], layout, out_dir)
                seconds = run_sweep(cmd, Path(tmp) / f"{out_dir.name}.log", args.clock)
                done = finished_runs(out_dir)
                if done != n_runs:
                    raise SystemExit(f"{name} {layout}: {done} of {n_runs} runs finished")
                rate[(name, layout)].append(n_runs / seconds * 3600)
                seconds_by_run[(name, layout)].append(run_seconds(out_dir, named[name]))
                print(
                    f"{name:<10} {layout:<4} repeat {repeat}: {seconds:7.1f} s  {rate[(name, layout)][-1]:6.1f} runs/h",
                    flush=True,
                )
    print("-- medians --")
    for name, layout in settings:
        print(f"{name:<10} {layout:<4} {statistics.median(rate[(name, layout)]):6.1f} runs/h")
    for line in ratio_lines(rate, list(named), layouts):
        print(line)
    for line in paired_lines(seconds_by_run, list(named), layouts):
        print(line)


if __name__ == "__main__":
    main()
