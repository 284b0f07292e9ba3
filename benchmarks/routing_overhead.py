"""Overhead of route recording and Routing Replay, measured side by side on CPU.

    python benchmarks/routing_overhead.py [--family qwen3_moe] [--batch 64] [--seq 64] [--repeats 15]

Prints forward-with-recorder / plain forward and forward+backward-with-replay / plain
forward+backward, each the median ratio over interleaved repeats (plain and hooked runs
alternate so machine noise hits both alike), and the stored route bytes per token per MoE layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe_rl.models import build_model
from moe_rl.routing import RouteRecorder, RouteReplay


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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
        r.routes  # assembling the (B, T, L, k) record is part of the cost

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
        "route_bytes_per_token_layer": routes.bytes_per_token_layer(),
        "num_moe_layers": routes.shape[2],
        "num_experts": routes.num_experts,
        "top_k": routes.shape[3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=101)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build_model(args.family)
    x = torch.randint(3, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    r = overhead(model, x, args.repeats)
    L, k = r["num_moe_layers"], r["top_k"]
    print(f"model={args.family} experts_impl={model.config._experts_implementation} batch={args.batch}x{args.seq} "
          f"MoE layers={L} experts={r['num_experts']} k={k} threads={torch.get_num_threads()} repeats={args.repeats}")
    print(f"plain forward            median {r['forward_ms']:8.1f} ms")
    print(f"plain forward+backward   median {r['forward_backward_ms']:8.1f} ms")
    print(f"recorder / plain forward              {r['recorder_overhead']:.3f}x  (target <= 1.03x)")
    print(f"replay fwd+bwd / plain fwd+bwd        {r['replay_overhead']:.3f}x  (target <= 1.05x)")
    print(f"route bytes per token per MoE layer   {r['route_bytes_per_token_layer']}  (target <= k = {k})")


if __name__ == "__main__":
    main()
