"""Rerun a sample of a shipped experiment's runs and say whether they reproduce.

    python -m moe_rl.reproduce RESULTS_DIR [--runs K] [--out DIR] [--jobs J] [--compile] [--current-code]

Picks K finished runs across the folder's cells and arms (one per group in turn, lowest seed first),
reruns each with its recorded `config.yaml` in a fresh process (its own cold start, in a cache of its
own) and with the code that made it: its recorded commit, and where its tree was dirty the patch stored beside
it (`moe_rl.run.code`), rebuilt in a temporary folder; a run whose code cannot be rebuilt (no commit, a commit
this repository lacks, a dirty tree with no stored patch) reruns with this checkout's code, and the line naming
each run's code says so (`--current-code`: this checkout's for every run). It prints per run and outcome: shipped, rerun, their difference and the seed-level spread of
that outcome among the shipped runs of the same group.

What to expect (docs/reproducing.md): a run with `numerics=avx2` reruns bitwise on a CPU of the same
vendor and model with the same library versions (not across vendors); a `native` run reruns bitwise only
on a CPU of the same kernel set; elsewhere a run diverges from the last bit on, so that its rerun is, at worst, another draw from the
distribution the seeds sample. The test is that worst case: the difference of two independent draws
has variance 2 sigma^2, and sigma is estimated by the sd of the n shipped seeds of the run's group, so
(shipped - rerun) / (sqrt(2) sd_seed) follows Student's t with n - 1 degrees of freedom; each |shipped -
rerun| must lie within t * sqrt(2) * sd_seed, t the two-sided quantile at 0.05 Bonferroni-corrected over
all comparisons (a prediction interval for one new draw). The last line says which holds; the exit status is 0
when the reruns are bitwise equal or within seed variation, 1 otherwise. `--compile` reruns with compile=true,
whose kernels are inductor's: a numerics domain of its own, so its reruns are held to the seed-variation test,
never to bits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    from moe_rl.config import TrainConfig

OUTCOMES = ("start_accuracy", "final_accuracy", "reward_auc", "token_var", "flip_rate")
GROUP_EXCLUDE = ("run", "seed")


def finished_runs(results_dir: Path) -> pd.DataFrame:
    """Outcomes of every finished run under `results_dir` (run, run_dir, run keys, OUTCOMES)."""
    from moe_rl import analysis
    from moe_rl.analysis.load import INCOMPLETE_STATUSES, run_key_columns

    df = analysis.load_results(results_dir)
    outcomes = analysis.run_outcomes(df).set_index("run")
    for name in ("token_var", "flip_rate"):
        outcomes[name] = analysis.variant_per_run(df, analysis.SUMMARY_METRICS[name], "auto")
    outcomes = outcomes.reset_index()
    outcomes = outcomes[~outcomes["status"].isin(INCOMPLETE_STATUSES)].reset_index(drop=True)
    outcomes.attrs["groups"] = group_columns(outcomes, run_key_columns(df))
    return outcomes


def group_columns(outcomes: pd.DataFrame, keys: list[str]) -> list[str]:
    """The run keys among `keys` that vary across runs, except the seed: one group = one cell and arm."""
    keys = [c for c in keys if c not in GROUP_EXCLUDE and c in outcomes]
    return [c for c in keys if outcomes[c].astype(str).nunique() > 1]


def choose(outcomes: pd.DataFrame, k: int, groups: list[str]) -> pd.DataFrame:
    """K runs spread over the groups: each group's lowest seed first, then the next seeds in turn."""
    ranked = outcomes.sort_values([*groups, "seed"] if groups else ["seed"]).copy()
    ranked["turn"] = ranked.groupby(groups).cumcount() if groups else range(len(ranked))
    return ranked.sort_values(["turn", *groups]).head(k).drop(columns="turn").reset_index(drop=True)


def recorded_config(config_path: str | Path) -> TrainConfig:
    """The TrainConfig of a recorded config.yaml (its folders aside). A run recorded before the `metrics`
    section ran every route instrument on every step and row, so it gets those settings, not the defaults."""
    from omegaconf import OmegaConf

    from moe_rl.config import TrainConfig
    from moe_rl.run.identity import ADDED_DEFAULTS

    recorded = OmegaConf.to_container(OmegaConf.load(config_path))
    if not isinstance(recorded, dict):
        raise ValueError(f"{config_path} is not a run config (a mapping)")
    recorded = {k: v for k, v in recorded.items() if k not in ("out_dir", "results_dir")}
    recorded.setdefault("metrics", dict(ADDED_DEFAULTS["metrics"]))
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), recorded))
    assert isinstance(cfg, TrainConfig)
    return cfg


def rerun(config_path: str, out_dir: str, cache_dir: str, compiled: str = "false") -> str:
    """One run from a recorded config.yaml into `out_dir` (runs in a fresh process: numerics pin there);
    `compiled` "true": with compile=true, inductor's numerics domain (docs/performance.md)."""
    from moe_rl.train import train

    cfg = recorded_config(config_path)
    cfg = dataclasses.replace(
        cfg,
        out_dir=out_dir,
        progress=False,
        compile=cfg.compile or compiled == "true",
        cold_start=dataclasses.replace(cfg.cold_start, cache_dir=cache_dir),
    )
    return str(train(cfg)["status"])


# `rerun` written with what every commit's moe_rl has (TrainConfig, train), so that it runs in a rebuilt tree too
RERUN_IN_TREE = """
import dataclasses, sys
from omegaconf import OmegaConf
from moe_rl.config import TrainConfig
from moe_rl.train import train
config, out_dir, cache_dir, compiled = sys.argv[1:]
recorded = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(config)).items() if k not in ("out_dir", "results_dir")}
cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), recorded))
cold_start = dataclasses.replace(cfg.cold_start, cache_dir=cache_dir)
compile_ = cfg.compile or compiled == "true"
print(train(dataclasses.replace(cfg, out_dir=out_dir, progress=False, compile=compile_, cold_start=cold_start))["status"])
"""


def _rerun_process(config_path: str, out_dir: str, cache_dir: str, compiled: str, tree: str | None = None) -> str:
    """`rerun` in a fresh interpreter (numerics=avx2 pins there), with the code of `tree` (a rebuilt run's code,
    `code_tree`) or else this checkout's; its status, or why it failed."""
    if tree is None:
        cmd, cwd, env = (
            [sys.executable, "-c", "import sys; from moe_rl.reproduce import rerun; print(rerun(*sys.argv[1:]))"],
            None,
            None,
        )
    else:  # the tree first on the path, and as the working folder (which `python -c` puts before it)
        cmd, cwd, env = [sys.executable, "-c", RERUN_IN_TREE], tree, {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(
        [*cmd, config_path, out_dir, cache_dir, compiled], capture_output=True, text=True, check=False, cwd=cwd, env=env
    )
    if out.returncode:
        return f"failed ({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode})"
    return out.stdout.strip().splitlines()[-1]


def code_tree(run_dir: Path, trees: Path) -> tuple[str | None, str]:
    """The folder holding the code the run in `run_dir` ran (its commit and stored patch rebuilt under `trees`, once
    per commit and patch), or None and why this checkout's code reruns it instead."""
    import json

    from moe_rl.run.code import checkout_root, patch_path, rebuild, rebuildable

    repo = checkout_root()
    if repo is None:
        return None, "this checkout is not a git repository: its own code"
    try:
        meta = json.loads((run_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return None, "no readable meta.json: this checkout's code"
    why = rebuildable(run_dir, meta, repo)
    if why is not None:
        return None, f"{why}: this checkout's code"
    sha, digest = meta["git_sha"], meta.get("git_diff")
    dest = trees / (sha[:12] + (f"-{digest[:12]}" if digest else ""))
    if not (dest / "moe_rl").is_dir():
        try:
            rebuild(repo, sha, patch_path(run_dir, digest) if digest else None, dest)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
            shutil.rmtree(dest, ignore_errors=True)  # never reused half-built
            return None, f"its code could not be rebuilt ({err}): this checkout's code"
    return str(dest), f"commit {sha[:10]}" + (f" + patch {digest[:10]}" if digest else "")


def compare(
    shipped: pd.DataFrame, reruns: pd.DataFrame, spread: pd.DataFrame, seeds: pd.DataFrame, alpha: float = 0.05
) -> pd.DataFrame:
    """Long table: run, outcome, shipped, rerun, diff, sd_seed (over `seeds` shipped seeds), t, bound, within."""
    from scipy.stats import t as student_t

    rows = []
    for run in reruns.index:
        for name in OUTCOMES:
            a, b = shipped.loc[run, name], reruns.loc[run, name]
            if pd.isna(a) and pd.isna(b):
                continue
            rows.append(
                {
                    "run": run,
                    "outcome": name,
                    "shipped": a,
                    "rerun": b,
                    "sd_seed": spread.loc[run, name],
                    "n_seeds": int(seeds.loc[run, name]),
                }
            )
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    level = 1 - alpha / (2 * len(table))
    table["diff"] = table["rerun"] - table["shipped"]
    table["bitwise"] = table["rerun"] == table["shipped"]
    table["t"] = [student_t.ppf(level, n - 1) if n > 1 else float("nan") for n in table["n_seeds"]]
    table["bound"] = table["t"] * 2**0.5 * table["sd_seed"]
    table["within"] = table["bitwise"] | (table["diff"].abs() <= table["bound"])
    table["testable"] = table["bitwise"] | table["bound"].notna()  # else no seed spread to judge a change by
    table.attrs["level"] = level
    return table


def seed_spread(outcomes: pd.DataFrame, chosen: pd.DataFrame, groups: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per chosen run, the standard deviation of each outcome across the shipped seeds of its group and
    the number of those seeds; sd NaN (no test) for a group of one seed and for an outcome every seed
    shares (the cold-start accuracy: one cold start serves all seeds, so they say nothing of its spread)."""
    rows, counts = {}, {}
    for _, row in chosen.iterrows():
        same = outcomes
        for c in groups:
            same = same[same[c].astype(str) == str(row[c])]
        rows[row["run"]] = {name: same[name].std(ddof=1) if len(same) > 1 else float("nan") for name in OUTCOMES}
        counts[row["run"]] = {name: int(same[name].notna().sum()) for name in OUTCOMES}
    sd = pd.DataFrame.from_dict(rows, orient="index").replace(0.0, float("nan"))
    return sd, pd.DataFrame.from_dict(counts, orient="index")


def verdict_line(table: pd.DataFrame) -> str:
    if table.empty:
        return "NOTHING TO COMPARE: no outcome was logged by both the shipped runs and the reruns"
    if table["bitwise"].all():
        return f"REPRODUCED BITWISE: all {len(table)} outcomes equal to the last bit"
    untestable = ~table["testable"]
    outside = table[~table["within"] & ~untestable]
    head = (
        f"{len(table)} outcomes of {table['run'].nunique()} runs; bitwise equal {int(table['bitwise'].sum())}; "
        f"test |diff| <= t(n_seeds - 1, {table.attrs.get('level', float('nan')):.4f}) * sqrt(2) * sd_seed"
    )
    if len(outside):
        listed = ", ".join(f"{r.run}:{r.outcome}" for r in outside.itertuples())
        return f"NOT WITHIN SEED VARIATION ({head}): {listed}"
    if untestable.any():
        listed = ", ".join(f"{r.outcome} {r.shipped:.4g} vs {r.rerun:.4g}" for r in table[untestable].itertuples())
        return (
            f"WITHIN SEED VARIATION where testable ({head}); not testable, no seed spread (one seed, or shared by "
            f"every seed like the cold start): {listed}"
        )
    return f"WITHIN SEED VARIATION ({head})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_rl.reproduce", description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path, help="a shipped results folder (searched for runs)")
    parser.add_argument("--runs", type=int, default=3, help="runs to rerun, spread over cells and arms (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="where reruns go (default runs/reproduce/<folder>)")
    parser.add_argument("--cache", type=Path, default=Path(".cache/reproduce"), help="cold-start cache of the reruns")
    parser.add_argument("--jobs", type=int, default=1, help="reruns in parallel (one process each)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="rerun with compile=true: another numerics domain, so expect seed variation, not bits",
    )
    parser.add_argument(
        "--current-code",
        action="store_true",
        help="rerun with this checkout's code, not each run's recorded commit and patch",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    try:
        outcomes = finished_runs(args.results_dir)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if outcomes.empty:
        print(f"error: no finished run under {args.results_dir}", file=sys.stderr)
        return 2
    out = args.out or Path("runs") / "reproduce" / (
        args.results_dir.resolve().name + ("_compiled" if args.compile else "")
    )
    groups = outcomes.attrs["groups"]
    chosen = choose(outcomes, args.runs, groups)
    jobs: dict[str, tuple[str, str, str, str, str | None]] = {}
    with tempfile.TemporaryDirectory(prefix="moe_rl_code_") as trees:
        for run, run_dir in zip(chosen["run"], chosen["run_dir"]):
            config = Path(run_dir) / "config.yaml"
            if not config.is_file():
                print(f"error: {run_dir} has no config.yaml to rerun", file=sys.stderr)
                return 2
            tree, code = (None, "this checkout's code (--current-code)")
            if not args.current_code:
                tree, code = code_tree(Path(run_dir), Path(trees))
            print(f"  {run}: {code}", flush=True)
            # absolute: a rebuilt tree's rerun runs in that tree
            jobs[run] = (
                str(config.absolute()),
                str((out / run).absolute()),
                str(args.cache.absolute()),
                str(args.compile).lower(),
                tree,
            )
        print(f"rerunning {len(jobs)} of {len(outcomes)} runs of {args.results_dir} into {out}:", flush=True)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:  # each rerun in a process of its own
            futures = {pool.submit(_rerun_process, *job): run for run, job in jobs.items()}
            for future in concurrent.futures.as_completed(futures):
                print(f"  {futures[future]}: {future.result()}", flush=True)
    try:
        reruns = finished_runs(out).set_index("run")
    except FileNotFoundError:
        reruns = pd.DataFrame(columns=["run", *OUTCOMES]).set_index("run")
    missing = sorted(set(jobs) - set(reruns.index))
    if missing:
        print(f"NOT REPRODUCED: {len(missing)} rerun(s) did not finish: {', '.join(missing)} (see their status.json)")
        return 1
    shipped = outcomes.set_index("run")
    table = compare(shipped, reruns, *seed_spread(outcomes, chosen, groups))
    with pd.option_context("display.width", 160, "display.max_columns", 20, "display.float_format", "{:.6g}".format):
        print(table.drop(columns=["bitwise"]).to_string(index=False) if len(table) else "(no outcomes)")
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "reproduce.csv", index=False)
    line = verdict_line(table)
    print(line)
    return 0 if line.startswith(("REPRODUCED", "WITHIN")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
