"""The fine-grained model's RL step per MoE layer against the default's, for each CPU experts kernel, interleaved.

    python benchmarks/experts_step.py [--repeats 9] [--threads 1] [--models default,fine]

Four trainers (`default`: 8 experts of width 64, top-2, 2 MoE layers; `fine`: 64 of width 16, top-8, 4 layers; each
with `model.experts_implementation` `grouped_mm` and `grouped_mm_cpu`, `moe_rl.models.cpu_experts`) are built as
`benchmarks/step_profile.py` builds its own, each from the same short warm-up per model, and take uninstrumented
`Trainer.step`s in turn, the order reversed every round (ABCD DCBA ...). Printed: each trainer's median step (this
process's CPU time, step_profile's clock); per
model the two kernels' step ratio and whether their trainers hold the same weights after every step (bit for bit,
at one thread); per kernel the fine model's step per MoE layer over the default's (a step / its MoE layers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_profile import MODELS, add_step_options, config, plain_step  # noqa: E402

from moe_rl.train import Trainer  # noqa: E402

KERNELS = ("grouped_mm", "grouped_mm_cpu")


def same_weights(a: Trainer, b: Trainer) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.policy.parameters(), b.policy.parameters(), strict=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_options(parser)  # step_profile's: the models, rollout sizes, warm-up steps, threads and repeats
    args = parser.parse_args(argv)  # argv: the smoke test runs main in-process at tiny sizes
    args.replay, args.compile = "none", False
    models = args.models.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        trainers: dict[tuple[str, str], Trainer] = {}
        for model in models:
            for kernel in KERNELS:
                cfg = config(model, args, Path(tmp) / kernel)
                cfg.cold_start.cache_dir = str(Path(tmp) / "cold")  # one warm-up per model, shared by its kernels
                cfg.model.experts_implementation = kernel
                trainers[model, kernel] = Trainer(cfg)
        seconds: dict[tuple[str, str], list[float]] = {key: [] for key in trainers}
        alike = {model: True for model in models}
        order = list(trainers)
        for step in range(args.repeats + 1):  # the first round warms the allocator and is not counted
            for key in order if step % 2 == 0 else order[::-1]:
                seconds[key].append(plain_step(trainers[key], step))
            for model in models:
                alike[model] &= same_weights(trainers[model, KERNELS[0]], trainers[model, KERNELS[1]])
    median = {key: statistics.median(v[1:]) for key, v in seconds.items()}
    print(f"threads={args.threads} rows={args.prompts}x{args.group} repeats={args.repeats} (median step, ms)")
    for model in models:
        slow, fast = (median[model, k] for k in KERNELS)
        print(
            f"{model:8s} {KERNELS[0]} {1e3 * slow:7.1f}  {KERNELS[1]} {1e3 * fast:7.1f}  "
            f"{KERNELS[1]}/{KERNELS[0]} {fast / slow:.3f}x  same weights after every step: {alike[model]}"
        )
    if {"default", "fine"} <= set(models):
        layers = {m: MODELS[m].get("num_layers", 2) for m in ("default", "fine")}
        for kernel in KERNELS:
            ratio = (median["fine", kernel] / layers["fine"]) / (median["default", kernel] / layers["default"])
            print(f"fine/default per MoE layer, {kernel}: {ratio:.3f}x")


if __name__ == "__main__":
    main()
