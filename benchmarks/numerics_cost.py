"""What pinned numerics cost: RL step time under `numerics=avx2` and `numerics=portable` over the CPU's own kernels.

    python benchmarks/numerics_cost.py [--models default,fine] [--repeats 5] [--steps 4]

The pin must be set before torch computes, so each measurement is a fresh process (one torch thread)
that builds a Trainer, runs one warm-up step and times `--steps` steps by its own CPU time. Native and
pinned processes alternate (the order rotates each repeat), so load on the machine hits all alike; the
figures to quote are the medians of the per-repeat ratios pinned / native. Cold starts are cached in a temporary folder per model
and setting (a pinned run trains its own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from moe_rl.run.folder import OVERRIDING_ENV, PINNED_ENV  # noqa: E402

MODELS = {
    "default": {},
    "fine": {"num_experts": 64, "top_k": 8, "num_layers": 4, "moe_intermediate_size": 16},
}


def measure(model: str, numerics: str, steps: int, cache: str, sizes: dict[str, int]) -> float:
    """CPU seconds per step of `steps` steps after a warm-up, in this process."""
    import dataclasses

    from moe_rl.config import ModelConfig, TrainConfig
    from moe_rl.train import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(out_dir=out, steps=steps + 1, progress=False, threads=1, numerics=numerics)
        cfg.model = dataclasses.replace(ModelConfig(), **MODELS[model])
        cfg.cold_start = dataclasses.replace(cfg.cold_start, cache_dir=cache)
        if sizes.get("prompts"):
            cfg.rollout.prompts_per_step, cfg.rollout.group_size = sizes["prompts"], sizes["group"]
            cfg.task.max_new_tokens, cfg.optim.updates_per_rollout = sizes["max_new_tokens"], sizes["updates"]
        if sizes.get("cold_start_steps"):
            cfg.cold_start.max_steps = cfg.cold_start.eval_every = sizes["cold_start_steps"]
        trainer = Trainer(cfg)
        trainer.step(1)
        start = time.process_time()
        for step in range(2, steps + 2):
            trainer.step(step)
        return (time.process_time() - start) / steps


def _child(model: str, numerics: str, steps: int, cache: str, sizes: dict[str, int]) -> float:
    code = (
        "import sys, json; from benchmarks.numerics_cost import measure; "
        "print(json.dumps(measure(*sys.argv[1:3], int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in {*PINNED_ENV["avx2"], *OVERRIDING_ENV}:
        env.pop(key, None)  # the native process runs the CPU's own kernels
    out = subprocess.run(
        [sys.executable, "-c", code, model, numerics, str(steps), cache, json.dumps(sizes)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,fine")
    parser.add_argument("--repeats", type=int, default=5, help="ABBA pairs per model")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process")
    parser.add_argument("--prompts", type=int, default=0, help="prompts per step (0: the config default)")
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=2)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--cold-start-steps", type=int, default=0, help="cap the cold start (0: to its band)")
    args = parser.parse_args(argv)
    sizes = {
        "prompts": args.prompts,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "updates": args.updates,
        "cold_start_steps": args.cold_start_steps,
    }
    modes = ("native", *PINNED_ENV)
    with tempfile.TemporaryDirectory() as cache:
        for model in args.models.split(","):
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for i in range(args.repeats):
                order = modes[i % len(modes) :] + modes[: i % len(modes)]
                for numerics in order:
                    times[numerics].append(_child(model, numerics, args.steps, cache, sizes))
            parts = [f"native {statistics.median(times['native']) * 1e3:.1f} ms per step"]
            for mode in PINNED_ENV:
                ratios = [p / n for p, n in zip(times[mode], times["native"])]
                parts.append(
                    f"{mode} / native {statistics.median(ratios):.3f} (range {min(ratios):.3f} to {max(ratios):.3f})"
                )
            print(f"{model}: {'; '.join(parts)}; medians of {args.repeats} rotations, CPU time", flush=True)


if __name__ == "__main__":
    main()
