"""Rollout throughput of the vLLM engine vs the harness's own sampling, on the same model and batch.

    .venv/bin/python benchmarks/engine_throughput.py                 # CPU: default and fine-grained geometry
    python benchmarks/engine_throughput.py --device cuda --gpu-model # GPU: official vLLM, ~1.2B Qwen3-MoE shape

Prints completion tokens per second of `moe_rl.rollout.generate.generate` (transformers model, KV cache) and of
`moe_rl.rollout.engine.VllmEngine.generate` (in-process vLLM, routes recorded by both), and their ratio as the
median over interleaved ABBA pairs, so that load drifting on a shared machine hits both sides alike.
Both sample with temperature 1 until EOS or `--new-tokens`; tokens are counted from each rollout's
response mask, so early EOS does not flatter either side.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe_rl.models import build_model
from moe_rl.rollout.engine import VllmEngine
from moe_rl.rollout.generate import generate
from moe_rl.tasks.tokenizer import make_tokenizer

# A Qwen3-MoE-shaped model of ~1.2B parameters (24 layers x 64 experts of width 256 at top-8, hidden 1024,
# 16 heads of 64 with 4 KV heads): Qwen3-30B-A3B's router geometry at 1/25 of its size, for a GPU run.
GPU_MODEL = dict(
    num_layers=24,
    num_experts=64,
    top_k=8,
    hidden_size=1024,
    moe_intermediate_size=256,
    head_dim=64,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=3072,
    max_position_embeddings=1024,
)
GEOMETRIES = {
    "default": dict(head_dim=32),  # the engine preset qwen3_moe_engine
    "fine": dict(head_dim=32, num_experts=64, top_k=8, num_layers=4, moe_intermediate_size=16),  # qwen3_moe_fine
}


def completion_tokens(rollout) -> int:
    return int(rollout.response_mask.sum())


def bench(name: str, overrides: dict, args: argparse.Namespace) -> float:
    tokenizer = make_tokenizer()
    dtype = getattr(torch, args.dtype)
    model = build_model("qwen3_moe", vocab_size=len(tokenizer), **overrides).to(args.device, dtype)
    engine = VllmEngine(model, dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization)
    alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    g = torch.Generator().manual_seed(0)
    prompts = [
        "".join(alphabet[i] for i in torch.randint(len(alphabet), (args.prompt_len,), generator=g))
        for _ in range(args.prompts)
    ]
    keys = [(0, 0, i) for i in range(args.prompts * args.group_size)]

    def run_hf() -> float:
        t = time.perf_counter()
        out = generate(model, tokenizer, prompts, group_size=args.group_size, max_new_tokens=args.new_tokens, seed=0)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return completion_tokens(out) / (time.perf_counter() - t)

    def run_engine() -> float:
        t = time.perf_counter()
        out = engine.generate(
            tokenizer, prompts, row_keys=keys, group_size=args.group_size, max_new_tokens=args.new_tokens
        )
        return completion_tokens(out) / (time.perf_counter() - t)

    run_hf(), run_engine()  # warm-up: the engine compiles its sampler on the first call
    hf, eng = [], []
    for i in range(args.pairs):  # ABBA
        for fn, acc in ((run_hf, hf), (run_engine, eng)) if i % 2 == 0 else ((run_engine, eng), (run_hf, hf)):
            acc.append(fn())
    engine.close()
    ratio = statistics.median(e / h for e, h in zip(eng, hf))
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{name:8s} {params / 1e6:8.1f}M params  generate {statistics.median(hf):9.0f} tok/s  "
        f"engine {statistics.median(eng):9.0f} tok/s  engine/generate {ratio:.2f}x  ({args.pairs} pairs)"
    )
    return ratio


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gpu-model", action="store_true", help="the ~1.2B Qwen3-MoE-shaped model (GPU_MODEL)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.05)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--geometry", choices=[*GEOMETRIES, "all"], default="all", help="CPU geometries to run")
    args = parser.parse_args(argv)
    print(
        f"batch {args.prompts} x {args.group_size} rows, prompt {args.prompt_len}, up to {args.new_tokens} new "
        f"tokens, {args.dtype} on {args.device}"
    )
    geometries = {"gpu_1b": GPU_MODEL} if args.gpu_model else GEOMETRIES
    if not args.gpu_model and args.geometry != "all":
        geometries = {args.geometry: GEOMETRIES[args.geometry]}
    for name, overrides in geometries.items():
        bench(name, overrides, args)


if __name__ == "__main__":
    main()
