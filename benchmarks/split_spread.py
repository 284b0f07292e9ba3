"""How far the ratio split moves when it scores a subsample of each update's rows, against the seed spread.

    python benchmarks/split_spread.py [--arms grpo_none,grpo_r2] [--steps 40] [--every 2] [--sizes 4,8,12,16,24]
                                      [--draws 20] [--results results/compare]

The ratio split (`ratio/split/*`, `clip/flipped_share`; docs/design.md §3) is a population statistic of
an update's tokens, so a random subset of the update's rows estimates it (`metrics.split_rows`). This
measures what that costs in precision. It runs the `compare` setting (the default model and config,
`numerics=avx2`, one thread, its own cold start) for `--steps` steps per arm with every instrument on
every step and the split on all rows. On every `--every`-th step it keeps each update's inputs to the
split (`ratio_split_parts`: the two passes' log-probs, the old pass's, the mask, the route-change flags,
the loss's clipping, per row) and recomputes the step's split keys from S rows of each update, drawn by
`split_subsample` (what the loop draws with) from `--draws` generators; the training itself is not
touched. Per key and S:

- `sub sd`: the sd over the draws of the step's value, median over the kept steps;
- `seed sd`: the sd over the shipped seeds of the same arm at the same step
  (`--results`/runs/*/metrics.parquet), median over the same steps (`all steps`: over every step);
- `ratio`: sub sd / seed sd, the median over the kept steps of the per-step ratio.

A subsample is within the seed spread where `ratio` <= 1: the split at S rows moves less between draws
than it does between seeds of the same arm. Keys of the whole step and their off-policy companions
(`/offpolicy`, updates 2..N, what the summaries read for N > 1).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import transformers

import moe_rl.loop.step_metrics as step_module
from moe_rl.config import TrainConfig
from moe_rl.loop.step_metrics import WEIGHT_SUFFIX, aggregate, split_subsample
from moe_rl.metrics.names import SPLIT_KEYS, offpolicy_key
from moe_rl.metrics.ratio_stats import ratio_split_finalize, ratio_split_parts, ratio_split_weights
from moe_rl.train import Trainer

ARMS = {
    "grpo_none": ("grpo", "none"),
    "grpo_r2": ("grpo", "r2"),
    "gspo_none": ("gspo", "none"),
    "gspo_r2": ("gspo", "r2"),
}


def config(arm: str, args: argparse.Namespace, out_dir: Path) -> TrainConfig:
    """The `compare` preset's run of `arm` (experiments/conf/preset/compare.yaml), every instrument on every
    row; the sizes the flags change (the smoke test's)."""
    cfg = TrainConfig(out_dir=str(out_dir / arm), seed=args.seed, numerics=args.numerics, threads=1, progress=False)
    cfg.algo.name, cfg.replay.mode = ARMS[arm]
    cfg.metrics.route_every, cfg.metrics.split_rows = 1, None
    if args.prompts:
        cfg.rollout.prompts_per_step, cfg.rollout.group_size = args.prompts, args.group
        cfg.task.max_new_tokens, cfg.cold_start.band = args.max_new_tokens, [0.0, 1.0]
    if args.cold_start_steps:
        cfg.cold_start.max_steps = cfg.cold_start.eval_every = args.cold_start_steps
    return cfg


def split_metrics(inputs: list[dict[str, torch.Tensor]], picks: list[torch.Tensor | None]) -> dict[str, float]:
    """The step's split keys (and their `/offpolicy`) from its updates' split inputs, each on rows `picks`."""
    updates = []
    for kwargs, pick in zip(inputs, picks):
        chosen = {k: v if pick is None else v[pick] for k, v in kwargs.items()}
        parts = ratio_split_parts(**chosen)
        weights = ratio_split_weights(parts)
        updates.append({**ratio_split_finalize(parts), **{k + WEIGHT_SUFFIX: w for k, w in weights.items()}})
    return aggregate(updates)


def record(arm: str, args: argparse.Namespace, root: Path) -> dict[int, list[dict[str, torch.Tensor]]]:
    """{step: each update's full-row split inputs} of the kept steps of one run of `arm`."""
    trainer = Trainer(config(arm, args, root))
    calls: list[dict[str, torch.Tensor]] = []
    original = step_module.ratio_split_parts

    def keep(**kwargs: Any):
        calls.append({k: v.detach().clone() for k, v in kwargs.items()})
        return original(**kwargs)

    kept: dict[int, list[dict[str, torch.Tensor]]] = {}
    step_module.ratio_split_parts = keep
    try:
        for step in range(1, args.steps + 1):
            calls.clear()
            logged = trainer.step(step)
            if step % args.every == 0:
                kept[step] = list(calls)
                again = split_metrics(kept[step], [None] * len(calls))  # the full rows reproduce the logged keys
                assert all(again[k] == logged[k] or again[k] != again[k] for k in again if k in logged), step
    finally:
        step_module.ratio_split_parts = original
    return kept


def seed_sd(results: Path, arm: str) -> pd.DataFrame:
    """sd over the shipped seeds of `arm` per (step, key) of the split keys (rows: step, columns: key)."""
    algo, replay = ARMS[arm]
    frames = [
        pd.read_parquet(p)
        for p in sorted((results / "runs").glob(f"algo={algo},replay={replay},seed=*/metrics.parquet"))
    ]
    if not frames:
        raise SystemExit(f"no shipped runs of {arm} under {results}/runs")
    df = pd.concat(frames)
    keys = [*SPLIT_KEYS, *(offpolicy_key(k) for k in SPLIT_KEYS)]
    df = df[df["key"].isin(keys)]
    return df.pivot_table(index=["step", "key"], columns="seed", values="value").std(axis=1, ddof=1).unstack("key")


def report(arm: str, kept: dict[int, list], sd_seed: pd.DataFrame, args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    rows_per_update = len(next(iter(kept.values()))[0]["mask"])
    keys = [k for k in (*SPLIT_KEYS, *(offpolicy_key(k) for k in SPLIT_KEYS)) if k in sd_seed.columns]
    sub: dict[tuple[int, str], list[float]] = defaultdict(list)  # (S, key) -> per-step sd over draws
    ratio: dict[tuple[int, str], list[float]] = defaultdict(list)
    for step, inputs in kept.items():
        for S in sizes:
            draws = []
            for d in range(args.draws):
                generator = torch.Generator().manual_seed(d * 1_000_003 + step)
                picks = [split_subsample(len(x["mask"]), S, generator) for x in inputs]
                draws.append(split_metrics(inputs, picks))
            for key in keys:
                values = [m[key] for m in draws if key in m and m[key] == m[key]]
                if len(values) < 2 or step not in sd_seed.index or not sd_seed.loc[step, key] > 0:
                    continue
                sd = statistics.stdev(values)
                sub[S, key].append(sd)
                ratio[S, key].append(sd / sd_seed.loc[step, key])
    steps = sorted(kept)
    print(
        f"\n== {arm}: {len(steps)} steps ({steps[0]}..{steps[-1]}, every {args.every}), {rows_per_update} rows per "
        f"update, {args.draws} draws per S; seed sd over the shipped seeds at the same steps =="
    )
    print(f"{'key':<38}{'seed sd':>10}{'all steps':>10}" + "".join(f"{'S=' + str(S):>18}" for S in sizes))
    print(f"{'':<38}{'':>10}{'':>10}" + "".join(f"{'sub sd  ratio':>18}" for _ in sizes))
    for key in keys:
        here = statistics.median(sd_seed.loc[[s for s in steps if s in sd_seed.index], key].dropna())
        everywhere = sd_seed[key].dropna().median()
        cells = "".join(
            f"{statistics.median(sub[S, key]):10.4f}{statistics.median(ratio[S, key]):8.2f}"
            if sub[S, key]
            else f"{'-':>18}"
            for S in sizes
        )
        print(f"{key:<38}{here:10.4f}{everywhere:10.4f}{cells}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="grpo_none,grpo_r2", help=f"comma-separated, of {list(ARMS)}")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=2, help="keep every this many steps")
    parser.add_argument("--sizes", default="4,8,12,16,24", help="rows per update the subsamples keep")
    parser.add_argument("--draws", type=int, default=20, help="subsamples per step and size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=Path("results/compare"))
    parser.add_argument("--numerics", default="avx2", help="compare's; native where torch already ran (tests)")
    parser.add_argument("--prompts", type=int, default=None, help="smaller rollouts (tests): prompts per step")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--cold-start-steps", type=int, default=None, help="at most this many (default: compare's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        for arm in args.arms.split(","):
            kept = record(arm, args, Path(tmp))
            report(arm, kept, seed_sd(args.results, arm), args)


if __name__ == "__main__":
    main()
