"""Run the stability frontier by bisection (`experiments/conf/preset/frontier.yaml`, `moe_rl.studies.frontier`).

    python experiments/frontier.py                         # runs into results/frontier, reads results/<source>
    python experiments/frontier.py --dry-run               # print the next probes and stop
    python experiments/frontier.py --runs runs --jobs 2    # runs into runs/frontier

Each probe (one row at one point, its missing seeds) is one Hydra multirun of `experiments/train.py`
(`+preset=frontier`), `--jobs` of them at a time; after each finishes, the row's next probe is decided from every
finished run (the frontier's own and, for the same configs, those of the folders in `SOURCES`). Rerunning resumes:
finished runs are read, not rerun. It stops when every row's edges are located, or at `--max-minutes`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import pandas as pd

from moe_rl import analysis
from moe_rl.metrics.status import RUNNING
from moe_rl.run.folder import read_status
from moe_rl.studies import frontier as fr_

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _finished(run_dir: Path) -> bool:
    """The run wrote its status.json and no longer runs (a finished run, or one that stopped for good)."""
    status = read_status(run_dir).get("status")
    return status is not None and status != RUNNING


class Runs:
    """Finished runs as frontier rows, each folder read once."""

    def __init__(self, own: Path, borrow: list[Path]) -> None:
        self.own = own
        self.rows: dict[str, pd.DataFrame] = {}
        borrowed = [fr_.per_run(analysis.load_results(d, keys=fr_.KEYS)) for d in borrow if d.is_dir()]
        self.borrowed = pd.concat(borrowed, ignore_index=True) if borrowed else None

    def table(self) -> pd.DataFrame:
        if self.own.is_dir():
            for d in sorted(p for p in self.own.iterdir() if p.is_dir() and p.name.startswith("arm=")):
                if d.name not in self.rows and _finished(d) and (d / "metrics.parquet").is_file():
                    self.rows[d.name] = fr_.per_run(analysis.load_results(d, keys=fr_.KEYS))
        frames = [*self.rows.values(), *([self.borrowed] if self.borrowed is not None else [])]
        return fr_.combine(frames)


def command(job: dict, results_dir: Path, cache: Path) -> list[str]:
    cmd = [sys.executable, str(HERE / "train.py"), "-m", "+preset=frontier", f"results_dir={results_dir}"]
    cmd += ["progress=false", "threads=1", f"cold_start.cache_dir={cache}", f"arm={job['arm']}"]
    if job["family"] != fr_.REFERENCE[0]:
        cmd.append(f"model={job['family']}")  # the model file of each family the frontier runs is named after it
    cmd += [f"optim.lr={job['lr']:g}", f"optim.updates_per_rollout={job['N']}", f"seed={fr_.seed_list(job['seeds'])}"]
    return cmd


def _probe(cmd: list[str], log: Path, env: dict[str, str]) -> int:
    """One probe's multirun, its output in `log`; the exit code."""
    with log.open("w") as out:
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode


def _key(job: dict) -> tuple:
    return job["family"], job["arm"], job["lr"], job["N"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, default=ROOT / "results", help="results_dir: runs land in <runs>/frontier")
    ap.add_argument("--borrow", type=Path, default=ROOT / "results", help="where the source folders' runs are")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "cold_start", help="the cold-start cache")
    ap.add_argument("--jobs", type=int, default=2, help="probes at a time (each one process, one thread)")
    ap.add_argument("--max-minutes", type=float, default=float("inf"), help="submit no probe after this long")
    ap.add_argument("--dry-run", action="store_true", help="print the next probes and stop")
    ap.add_argument("--presets", type=Path, default=HERE / "conf" / "preset", help="where frontier.yaml declares it")
    args = ap.parse_args()
    fr = fr_.load_frontier(args.presets)
    own = args.runs / "frontier" / "runs" if (args.runs / "frontier" / "runs").is_dir() else args.runs / "frontier"
    borrow = [args.borrow / s / "runs" for s in fr_.SOURCES if s != "frontier"]
    runs = Runs(own, borrow)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    began, running, failed = time.monotonic(), dict[Future, dict](), set[tuple]()
    logs = args.runs / "frontier" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        while True:
            table = runs.table()
            busy = {_key(j) for j in running.values()} | failed
            jobs = [j for j in fr_.next_jobs(table, fr) if _key(j) not in busy]
            if args.dry_run:
                for j in jobs:
                    print(" ".join(command(j, args.runs, args.cache)[2:]))
                return
            late = time.monotonic() - began > args.max_minutes * 60
            while jobs and len(running) < args.jobs and not late:
                job = jobs.pop(0)
                log = logs / f"{job['arm']},{job['family']},lr={job['lr']:g},N={job['N']}.log"
                print(
                    f"[frontier] {len(table)} runs read; probe {job['family']} {job['arm']} lr={job['lr']:g} "
                    f"N={job['N']} seeds {fr_.seed_list(job['seeds'])} ({job['axis']} axis)",
                    flush=True,
                )
                running[pool.submit(_probe, command(job, args.runs, args.cache), log, env)] = job
            if not running:
                print(f"[frontier] {'every edge located' if not jobs else 'time is up'}; {len(table)} runs", flush=True)
                return
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                job = running.pop(future)
                if future.result() != 0:  # not probed again in this call: its log says why
                    failed.add(_key(job))
                    print(f"[frontier] probe {job['arm']} lr={job['lr']:g} N={job['N']} exited {future.result()}")


if __name__ == "__main__":
    main()
