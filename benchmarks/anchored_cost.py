"""The step time of anchored routing (`replay.mode=anchored`) against no replay and R2, on the default run.

    python benchmarks/anchored_cost.py [--steps 20] [--modes none,r2,anchored] [--clock cpu|wall] [key=value ...]

Builds one trainer per mode from the same config (the defaults, or the `key=value` overrides) and cold
start, runs their steps interleaved (step s of every mode, in an order that alternates from step to step,
so machine noise hits all alike) and prints, per mode, the median ratio of its step time to the first
mode's over the paired steps, with a bootstrap 95% interval, and the same for each phase the loop times
(rollout, old pass, updates). The clock is this process's CPU time with one torch thread by default.
Anchored routing runs the reference's forward beside each of the sampler's (prefill and every decode step)
and one teacher-forced reference pass per step, so its rollout costs about twice no replay's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from routing_overhead import median_interval  # noqa: E402

PHASES = ("time/rollout_s", "time/old_logp_s", "time/update_s")


def trainer(mode: str, overrides: list[str], out: Path):
    from omegaconf import OmegaConf

    from moe_rl.config import TrainConfig
    from moe_rl.train import Trainer

    dotlist = ["progress=false", "threads=1", *overrides, f"replay.mode={mode}", f"out_dir={out / mode}"]
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.from_dotlist(dotlist)))
    assert isinstance(cfg, TrainConfig)
    return Trainer(cfg)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="none,r2,anchored")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args, overrides = parser.parse_known_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    modes = args.modes.split(",")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {mode: trainer(mode, overrides, Path(tmp)) for mode in modes}
        seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        phases: dict[str, dict[str, list[float]]] = {mode: {p: [] for p in PHASES} for mode in modes}
        for step in range(1, args.steps + 1):
            order = modes if step % 2 else modes[::-1]
            for mode in order:
                start = clock()
                metrics = trainers[mode].step(step)
                seconds[mode].append(clock() - start)
                for p in PHASES:
                    phases[mode][p].append(metrics[p])
    base = modes[0]
    print(
        f"{args.steps} paired steps, {args.clock} clock; median step of {base}: {statistics.median(seconds[base]):.3f} s"
    )
    for mode in modes[1:]:
        ratios = [a / b for a, b in zip(seconds[mode], seconds[base])]
        low, high = median_interval(ratios)
        line = f"{mode} / {base}: step {statistics.median(ratios):.2f}x [{low:.2f}, {high:.2f}]"
        for p in PHASES:
            r = [a / b for a, b in zip(phases[mode][p], phases[base][p])]
            line += f"; {p.split('/')[1][:-2]} {statistics.median(r):.2f}x"
        print(line)


if __name__ == "__main__":
    main()
