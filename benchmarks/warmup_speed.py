"""Warm-ups of the same pool members under named settings, side by side: SFT steps, band, CPU time per start in band.

    python benchmarks/warmup_speed.py --study length_edge --level L16 --members 1100..1107 \
        --setting before= --setting "after=cold_start.n_train=192000 cold_start.compile=true" [--jobs 2]

A member's warm-up is the one a run of the declared study's cell at `--level` starts from (its preset, the level's
task, the study's pool: `warm_member`, as the run itself warms it: one thread, the preset's numerics, the member's
task seed), with the setting's overrides added (space-separated; `before=` adds none). Each (member, setting) warms
in a fresh process into a cache folder of its own, so nothing is read from an earlier warm-up; `--jobs` run at a
time, in member order, each member's settings in one order and the next member's in the reverse (ABBA), so a slow
spell of the machine hits both. `--per-process K` warms K members in turn in one process, as a study's worker warms
the members of its runs (a compiled warm-up then compiles once per process: the next member's model reuses the
graphs). Inductor compiles in the warm-up's own process (`TORCHINDUCTOR_COMPILE_THREADS=1`), so a warm-up's CPU time
(user + system, the process's and its children's) holds the compile where it paid one.

Prints each warm-up's SFT steps, where it stopped, whether it ended in band, its covariates and its CPU seconds;
then per setting the starts in band, the SFT steps, CPU seconds per SFT step and per start in band, and each later
setting's CPU per start in band against the first's (above 1: the later is faster), with a 95% bootstrap interval
over the members (in CPU seconds and in SFT steps, which the machine's load does not move). `--out FILE` writes the
rows as CSV.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, resource, sys
from pathlib import Path
from moe_rl.forecast import compose_config
from moe_rl.loop.cold_start import COVARIATES, warm_member

def cpu():
    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)

for overrides in json.loads(sys.argv[1]):
    start = cpu()
    cfg = compose_config(overrides)
    info = warm_member(cfg)
    cov = json.loads((Path(cfg.cold_start.cache_dir) / info["key"] / COVARIATES).read_text())
    counts = cov["pass_counts"]
    zero = (counts[0] + counts[-1]) / max(sum(counts), 1)
    print("RESULT " + json.dumps({**info, "cpu_s": cpu() - start, "sampled_reward": cov["sampled_reward"],
                                  "zero_variance": zero}), flush=True)
"""


def member_list(text: str) -> list[int]:
    if ".." in text:
        first, _, last = text.partition("..")
        return list(range(int(first), int(last) + 1))
    return [int(x) for x in text.split(",")]


def parse_setting(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition("=")
    if not sep or not name.isidentifier():
        raise SystemExit(f"setting {text!r}: expected NAME=OVERRIDES, e.g. compiled=cold_start.compile=true or before=")
    return name, overrides.split()


def cell_overrides(study_name: str, level: str) -> list[str]:
    """The overrides of a run of the declared study's first arm at `level`, without its seed."""
    from moe_rl.studies.design import load_study, study_path

    study = load_study(study_path(study_name, ROOT / "experiments" / "conf" / "study"))
    if level not in study.levels:
        raise SystemExit(f"--level {level}: study {study.name} has levels {list(study.levels)}")
    return study.run_overrides(next(iter(study.arms)), level)


def member_lines(rows: list[dict], names: list[str], resamples: int = 4000) -> list[str]:
    """Each later setting against the first, per start in band: the first's CPU seconds (and SFT steps) per start
    in band over the later's, summed over the members both warmed, with a 95% percentile bootstrap interval over
    the members (resampled with replacement, each member's warm-ups under both settings together): the spread that
    which members plateau long gives one run of the benchmark. A resample with no start in band under a setting
    has no ratio and is left out of the interval (the count is printed)."""
    rng = np.random.default_rng(0)
    by = {(r["member"], r["setting"]): r for r in rows}
    lines = []
    for name in names[1:]:
        members = sorted(m for m, s in by if s == names[0] and (m, name) in by)
        if len(members) < 2:
            continue
        picks = rng.integers(0, len(members), size=(resamples, len(members)))
        per_start = {}
        for setting in (names[0], name):
            own = [by[(m, setting)] for m in members]
            in_band = np.array([bool(r["in_band"]) for r in own], dtype=float)
            for what in ("cpu_s", "steps"):
                x = np.array([float(r[what]) for r in own])
                with np.errstate(divide="ignore", invalid="ignore"):
                    per_start[(setting, what)] = (x.sum() / in_band.sum(), x[picks].sum(1) / in_band[picks].sum(1))
        for what, label in (("cpu_s", "CPU s"), ("steps", "SFT steps")):
            with np.errstate(divide="ignore", invalid="ignore"):  # no start in band: no ratio (nan or inf)
                point = per_start[(names[0], what)][0] / per_start[(name, what)][0]
                boot = per_start[(names[0], what)][1] / per_start[(name, what)][1]
            ok = np.isfinite(boot) & (boot > 0)
            lo, hi = np.quantile(boot[ok], [0.025, 0.975]) if ok.any() else (float("nan"), float("nan"))
            dropped = f", {(~ok).sum()} resamples without a start in band left out" if (~ok).any() else ""
            lines.append(
                f"{names[0]} / {name} {label} per start in band: {point:.2f}x [{lo:.2f}, {hi:.2f}] (95% bootstrap "
                f"over {len(members)} members{dropped})"
            )
    return lines


def warm(members: list[list[str]], log: Path) -> list[dict]:
    """Warm-ups of `members` (each its overrides) in turn in one fresh process: one record each."""
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", CHILD, json.dumps(members)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    log.write_text(out.stdout + out.stderr)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or len(lines) != len(members):
        raise SystemExit(f"a warm-up failed ({log}):\n{(out.stdout + out.stderr)[-2000:]}")
    return [json.loads(line.removeprefix("RESULT ")) for line in lines]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", required=True, help="a declared study (experiments/conf/study/NAME.yaml)")
    ap.add_argument("--level", required=True, help="the level whose task the warm-ups are for")
    ap.add_argument("--members", required=True, help="pool members: first..last or a comma-separated list")
    ap.add_argument("--setting", action="append", required=True, help="NAME=OVERRIDES (space-separated), 2 or more")
    ap.add_argument("--set", action="append", default=[], help="an override added to every warm-up")
    ap.add_argument("--jobs", type=int, default=2, help="processes at a time")
    ap.add_argument(
        "--per-process", type=int, default=1, help="members a process warms in turn (a study worker warms several)"
    )
    ap.add_argument("--keep", type=Path, default=None, help="keep the caches and logs under this folder")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as CSV")
    args = ap.parse_args(argv)
    settings = dict(parse_setting(s) for s in args.setting)
    if len(settings) < 2:
        raise SystemExit("give two or more --setting NAME=OVERRIDES")
    base = [*cell_overrides(args.study, args.level), "threads=1", *args.set]
    root = args.keep or Path(tempfile.mkdtemp(prefix="warmup_speed_"))
    root.mkdir(parents=True, exist_ok=True)
    names = list(settings)
    members = member_list(args.members)
    groups = [members[i : i + args.per_process] for i in range(0, len(members), args.per_process)]
    jobs = []
    for i, group in enumerate(groups):
        for name in names if i % 2 == 0 else names[::-1]:
            runs = [
                [*base, *settings[name], f"seed={m}", f"cold_start.cache_dir={root / f'{name}_{m}'}"] for m in group
            ]
            jobs.append((group, name, runs, root / f"{name}_{group[0]}.log"))
    print(
        f"{args.study} {args.level}: {len(members) * len(names)} warm-ups, {args.per_process} per process, "
        f"{args.jobs} processes at a time; {' '.join(base)}",
        flush=True,
    )
    rows = []
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [(g, n, pool.submit(warm, runs, log)) for g, n, runs, log in jobs]
        for group, name, future in futures:
            for member, r in zip(group, future.result(), strict=True):
                rows.append({"member": member, "setting": name, **r})
                print(
                    f"member {member} {name}: {r['steps']} SFT steps, stopped {r['stopped']}, accuracy "
                    f"{r['accuracy']:.3f}{'' if r['in_band'] else ' OUT OF BAND'}, sampled reward "
                    f"{r['sampled_reward']:.3f}, {r['cpu_s']:.0f} CPU s",
                    flush=True,
                )
    print()
    first = None
    for name in names:
        own = [r for r in rows if r["setting"] == name]
        in_band = sum(bool(r["in_band"]) for r in own)
        cpu, steps = sum(r["cpu_s"] for r in own), sum(r["steps"] for r in own)
        per_start = cpu / in_band if in_band else float("nan")
        first = first or per_start
        print(
            f"{name}: {in_band} of {len(own)} in band, {steps} SFT steps, {cpu / steps * 1000:.1f} CPU ms per step, "
            f"{per_start:.0f} CPU s per start in band ({first / per_start:.2f}x the first's)"
        )
    base_rows = {r["member"]: r for r in rows if r["setting"] == names[0]}
    for name in names[1:]:
        ratios = [base_rows[r["member"]]["cpu_s"] / r["cpu_s"] for r in rows if r["setting"] == name]
        print(
            f"{names[0]} / {name} CPU per member: median {statistics.median(ratios):.2f}x "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
    for line in member_lines(rows, names):
        print(line)
    if args.out:
        import pandas as pd

        pd.DataFrame(rows).to_csv(args.out, index=False)
        print(f"rows: {args.out}")


if __name__ == "__main__":
    main()
