"""Route recording and Routing Replay on CUDA, per backend: exactness, gradients, overhead.

    python benchmarks/gpu_check.py [--out results/gpu_check] [--batch 64] [--seq 64] [--repeats 21]

For the default family (qwen3_moe, transformers experts) and the megablocks backend (MegaBlocks
dMoE; reported as skipped, with the reason, where it cannot run) it measures on one CUDA device:
- `self_replay_bitwise`: plain, recorded and self-replayed forwards give bitwise-equal logits;
- `forced_routes_applied`: random routes replayed are the routes a recorder then sees;
- `router_grad_rows_nonzero`: fraction of router-weight rows with a non-zero gradient under
  forced routes (1.0: every expert's router row learns);
- `recorder_overhead` and `replay_overhead`: median over interleaved repeats of forward with
  RouteRecorder / plain forward and replayed forward+backward / plain forward+backward, each timed
  to `torch.cuda.synchronize()` (the method of `benchmarks/routing_overhead.py`, on the GPU).
Writes `gpu_check.json` under --out and prints one line per backend.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from moe_rl.models import build_model
from moe_rl.models.megablocks import build_megablocks_model, megablocks_unavailable_reason
from moe_rl.routing import RouteRecorder, RouteReplay, Routes, find_moe_layers

BACKENDS = ("qwen3_moe", "megablocks")


def build(backend: str) -> torch.nn.Module:
    if backend == "megablocks":
        return build_megablocks_model(device="cuda")
    return build_model(backend).to("cuda").eval()


def random_routes(model: torch.nn.Module, B: int, T: int, seed: int = 1) -> Routes:
    layers = find_moe_layers(model)
    E, k = layers[0].num_experts, layers[0].top_k
    topk = torch.rand(B, T, len(layers), E, generator=torch.Generator().manual_seed(seed)).argsort(-1)[..., :k]
    return Routes.from_topk(topk, None, [layer.decoder_layer for layer in layers], E)


def exactness(model: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    with torch.no_grad():
        plain = model(x).logits
        with RouteRecorder(model) as rec:
            recorded = model(x).logits
        with RouteReplay(model, rec.routes):
            replayed = model(x).logits
    routes = random_routes(model, *x.shape)
    with RouteReplay(model, routes), RouteRecorder(model) as used:
        loss = model(x).logits.float().pow(2).mean()
    loss.backward()
    rows = [(layer.weight.grad.norm(dim=1) > 0).float().mean().item() for layer in find_moe_layers(model)]
    model.zero_grad(set_to_none=True)
    return {
        "self_replay_bitwise": bool(torch.equal(plain, recorded) and torch.equal(plain, replayed)),
        "self_replay_max_abs_diff": (plain - replayed).abs().max().item(),
        "forced_routes_applied": bool(
            torch.equal(used.routes.indices.cpu(), routes.indices)
        ),  # recorded on the model device
        "router_grad_rows_nonzero": min(rows),
    }


def _time(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def overhead(model: torch.nn.Module, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """The CPU benchmark's measurement, timed with CUDA synchronisation."""
    from routing_overhead import overhead as measure

    return measure(model, x, repeats, timer=_time)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/gpu_check")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    args = parser.parse_args(argv)  # argv: the smoke tests run main in-process at tiny sizes
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device (torch.cuda.is_available() is False)")

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "batch": args.batch,
        "seq": args.seq,
        "repeats": args.repeats,
        "backends": {},
    }
    try:
        importlib.import_module("megablocks")
        report["megablocks"] = importlib.metadata.version("megablocks")
    except Exception as err:
        report["megablocks"] = f"unavailable: {type(err).__name__}: {err}"
    x = torch.randint(3, 64, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to("cuda")
    for backend in args.backends:
        reason = megablocks_unavailable_reason() if backend == "megablocks" else None
        if reason is not None:
            report["backends"][backend] = {"skipped": reason}
            print(f"{backend:12s} skipped: {reason}")
            continue
        model = build(backend)
        result = {**exactness(model, x[:8, :32]), **overhead(model, x, args.repeats)}
        report["backends"][backend] = result
        fields = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())
        print(f"{backend:12s} " + " ".join(fields))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
