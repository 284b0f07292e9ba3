"""Overhead of route recording and Routing Replay, measured side by side on CPU.

    python benchmarks/routing_overhead.py [--models default,fine] [--batch 64] [--seq 64] [--repeats 101]
                                          [--clock cpu|wall] [--threads 1]

Prints forward-with-recorder / plain forward and forward+backward-with-replay / plain
forward+backward, each the median ratio over interleaved repeats (plain and hooked runs
alternate so machine noise hits both alike) with a bootstrap 95% interval of that median, and
the stored route bytes per token per MoE layer. `default` is the tiny qwen3_moe (8 experts, top-2,
2 MoE layers), `fine` the `qwen3_moe_fine` preset (64 experts of width 16, top-8, 4 MoE layers);
`--family` measures another family's tiny model. The default clock is this process's CPU time
(with one torch thread), which other jobs on a loaded machine do not inflate.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from moe_rl.models import build_model
from moe_rl.routing import RouteRecorder, RouteReplay

PRESETS = {
    "default": {},
    "fine": {"num_experts": 64, "top_k": 8, "num_hidden_layers": 4, "moe_intermediate_size": 16},
}


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_time(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def median_interval(values: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap 95% percentile interval of the median of `values`."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n_boot))
    return medians[int(0.025 * n_boot)], medians[int(0.975 * n_boot) - 1]


def _paired(base, hooked, repeats: int, timer) -> tuple[list[float], list[float]]:
    """Base times and hooked/base ratios from pairs run in alternating (ABBA) order.

    Each kind of pass gets its own loop, so both members of a pair follow the same kind of work.
    """
    times, ratios = [], []
    for i in range(repeats):
        if i % 2:
            a, b = timer(base), timer(hooked)
        else:
            b, a = timer(hooked), timer(base)
        times.append(a)
        ratios.append(b / a)
    return times, ratios


def overhead(model: torch.nn.Module, x: torch.Tensor, repeats: int, timer=_time) -> dict[str, float]:
    """Recorder and replay overhead of `model` on inputs `x`, as medians of paired ratios.

    `timer(fn) -> seconds`; on CUDA pass one that synchronises (benchmarks/gpu_check.py does).
    """
    with torch.no_grad(), RouteRecorder(model) as rec:
        model(x)
    routes = rec.routes

    def forward() -> None:
        with torch.no_grad():
            model(x)

    def forward_recorded() -> None:
        with torch.no_grad(), RouteRecorder(model) as r:
            model(x)
        _ = r.routes  # assembling the (B, T, L, k) record is part of the cost

    def train_step() -> None:
        model(x).logits.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    def train_step_replayed() -> None:
        with RouteReplay(model, routes):
            model(x).logits.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    for fn in (forward, forward_recorded, train_step, train_step_replayed):  # warm-up
        fn()
    fwd, rec_ratio = _paired(forward, forward_recorded, repeats, timer)
    step, rep_ratio = _paired(train_step, train_step_replayed, repeats, timer)
    return {
        "forward_ms": statistics.median(fwd) * 1e3,
        "forward_backward_ms": statistics.median(step) * 1e3,
        "recorder_overhead": statistics.median(rec_ratio),
        "replay_overhead": statistics.median(rep_ratio),
        "recorder_interval": median_interval(rec_ratio),
        "replay_interval": median_interval(rep_ratio),
        "route_bytes_per_token_layer": routes.bytes_per_token_layer(),
        "num_moe_layers": routes.shape[2],
        "num_experts": routes.num_experts,
        "top_k": routes.shape[3],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,fine", help=f"comma-separated, of {sorted(PRESETS)}")
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=101)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", default="cpu", choices=("cpu", "wall"))
    args = parser.parse_args(argv)  # argv: the smoke tests run main in-process at tiny sizes
    if args.threads:
        torch.set_num_threads(args.threads)
    timer = _cpu_time if args.clock == "cpu" else _time
    print(
        f"clock: {args.clock} time; plain and hooked passes alternate (ABBA), so load from other jobs hits both "
        "alike; ratios are medians of paired runs with bootstrap 95% intervals"
    )
    for preset in args.models.split(","):
        model = build_model(args.family, **PRESETS[preset])
        x = torch.randint(
            3, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
        )
        r = overhead(model, x, args.repeats, timer)
        L, k = r["num_moe_layers"], r["top_k"]
        (rec_lo, rec_hi), (rep_lo, rep_hi) = r["recorder_interval"], r["replay_interval"]
        print(
            f"\n{preset}: model={args.family} experts_impl={model.config._experts_implementation} "
            f"batch={args.batch}x{args.seq} MoE layers={L} experts={r['num_experts']} k={k} "
            f"threads={torch.get_num_threads()} repeats={args.repeats}"
        )
        print(f"plain forward            median {r['forward_ms']:8.1f} ms")
        print(f"plain forward+backward   median {r['forward_backward_ms']:8.1f} ms")
        print(
            f"recorder / plain forward              {r['recorder_overhead']:.3f}x  [{rec_lo:.3f}, {rec_hi:.3f}]"
            "  (target <= 1.03x)"
        )
        print(
            f"replay fwd+bwd / plain fwd+bwd        {r['replay_overhead']:.3f}x  [{rep_lo:.3f}, {rep_hi:.3f}]"
            "  (target <= 1.05x)"
        )
        print(f"route bytes per token per MoE layer   {r['route_bytes_per_token_layer']}  (target <= k = {k})")


if __name__ == "__main__":
    main()
