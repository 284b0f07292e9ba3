"""Step time and memory per rank of one training step on 1 vs N processes (FSDP2 or DDP), and their ratios.

    python benchmarks/fsdp_scaling.py                      # CPU, gloo: 1 vs 2 processes
    python benchmarks/fsdp_scaling.py --device cuda --nproc 1 2 4 8   # GPUs, NCCL (one GPU per process)

The model is a Qwen3-MoE built to ~50M parameters (hidden 512, 4 layers, 16 experts of width 512, top-2;
`--hidden/--layers/--experts` shrink it),
so parameters, gradients and AdamW's two moments dominate memory. Each configuration runs under torchrun
with the harness's own `moe_rl.loop.distributed.Dist` (the same `fully_shard` wrapping and loss scaling as a
run) on a fixed global batch split across the ranks, and reports per rank:
- `state_mib`: parameter + gradient + optimizer-state bytes held by the rank (local shards of the
  DTensors), the part FSDP divides by N;
- `peak_mib`: peak RSS (CPU; includes the interpreter, torch and the full model built before sharding)
  or `torch.cuda.max_memory_allocated` (CUDA);
- `step_s`: median wall time of a forward, backward and optimizer step.
Not a timed test: run it by hand. On a shared 2-core CPU machine the time ratio mostly measures gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def worker(args: argparse.Namespace) -> None:
    import torch

    from moe_rl.loop.distributed import Dist
    from moe_rl.models import build_model

    d = Dist(args.strategy, 600, args.device)
    model = build_model(
        "qwen3_moe",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_experts=args.experts,
        top_k=2,
        moe_intermediate_size=args.hidden,
        intermediate_size=2 * args.hidden,
    )
    n_params = sum(p.numel() for p in model.parameters())
    model.to(args.device).train()
    train_model = d.wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B = args.batch // d.world_size
    g = torch.Generator().manual_seed(d.rank)
    x = torch.randint(3, 64, (B, args.seq), generator=g).to(args.device)
    times = []
    for i in range(args.warmup + args.steps):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = train_model(input_ids=x).logits.float().pow(2).mean()
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    state = sum(_local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0) for p in model.parameters())
    state += sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row = {
        "rank": d.rank,
        "world": d.world_size,
        "params": n_params,
        "state_mib": state / 2**20,
        "peak_mib": peak,
        "step_s": statistics.median(times),
    }
    Path(args.out, f"rank{d.rank}.json").write_text(json.dumps(row))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp"])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=8, help="global batch (split across the ranks)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size and expert width (dense width: 2x)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)  # argv: the smoke tests run main in-process at tiny sizes
    if args.worker:
        return worker(args)
    results = {}
    for n in args.nproc:
        with tempfile.TemporaryDirectory() as out:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={n}",
                __file__,
                "--worker",
                "--out",
                out,
                "--device",
                args.device,
                "--strategy",
                args.strategy,
                "--batch",
                str(args.batch),
                "--seq",
                str(args.seq),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--hidden",
                str(args.hidden),
                "--layers",
                str(args.layers),
                "--experts",
                str(args.experts),
            ]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            env.setdefault("OMP_NUM_THREADS", "1")
            subprocess.run(cmd, check=True, env=env, cwd=ROOT)
            results[n] = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    base = results[args.nproc[0]][0]
    print(
        f"\n{base['params'] / 1e6:.1f}M parameters, {args.strategy}, {args.device}, global batch {args.batch}x{args.seq}"
    )
    print(
        f"{'procs':>5} {'rank':>4} {'state MiB':>10} {'peak MiB':>9} {'step s':>7} {'state ratio':>11} "
        f"{'peak ratio':>10} {'time ratio':>10}"
    )
    for n, rows in results.items():
        for r in rows:
            print(
                f"{n:>5} {r['rank']:>4} {r['state_mib']:>10.1f} {r['peak_mib']:>9.1f} {r['step_s']:>7.3f} "
                f"{r['state_mib'] / base['state_mib']:>11.3f} {r['peak_mib'] / base['peak_mib']:>10.3f} "
                f"{r['step_s'] / base['step_s']:>10.3f}"
            )


if __name__ == "__main__":
    main()
