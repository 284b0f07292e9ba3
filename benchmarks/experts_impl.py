"""Which transformers experts implementation is fastest (and correct) on this device.

    python benchmarks/experts_impl.py [--family qwen3_moe] [--batch 64] [--seq 16] [--repeats 9]

For each implementation prints the max |logits - eager logits| and the median forward and
forward+backward time relative to `eager`, from interleaved repeats. The result justifies
`moe_rl.models.default_experts_implementation`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe_rl.models import EXPERTS_IMPLEMENTATIONS, build_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)  # argv: the smoke tests run main in-process at tiny sizes
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {
        impl: build_model(args.family, experts_implementation=impl).to(device) for impl in EXPERTS_IMPLEMENTATIONS
    }
    x = torch.randint(3, 64, (args.batch, args.seq), device=device)
    with torch.no_grad():
        reference = models["eager"](x).logits

    def timed(fn) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    fwd = {impl: [] for impl in models}
    step = {impl: [] for impl in models}
    for _ in range(args.repeats + 1):
        for impl, model in models.items():
            with torch.no_grad():
                fwd[impl].append(timed(lambda: model(x)))  # noqa: B023 (called at once, in this iteration)
            step[impl].append(timed(lambda: model(x).logits.pow(2).mean().backward()))  # noqa: B023 (likewise)
            model.zero_grad(set_to_none=True)
    print(f"device={device} family={args.family} batch={args.batch}x{args.seq} threads={torch.get_num_threads()}")
    base_f, base_s = statistics.median(fwd["eager"][1:]), statistics.median(step["eager"][1:])
    for impl, model in models.items():
        with torch.no_grad():
            err = (model(x).logits - reference).abs().max().item()
        f, s = statistics.median(fwd[impl][1:]), statistics.median(step[impl][1:])
        print(
            f"{impl:11s} max|diff|={err:.1e}  forward {f / base_f:5.2f}x  fwd+bwd {s / base_s:5.2f}x  "
            f"({f * 1e3:.1f} / {s * 1e3:.1f} ms)"
        )


if __name__ == "__main__":
    main()
