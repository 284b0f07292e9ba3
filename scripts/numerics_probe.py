#!/usr/bin/env python3
"""Digest the CPU kernels a moe_rl run uses, so two machines can say which op first differs.

Run it pinned, in the project's venv, from the project root (docs/numerics.md):
  ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 \
    .venv/bin/python scripts/numerics_probe.py > mine.json
then compare with a digest file made on another CPU (tests/data/numerics_probe/ keeps the verified ones):
  .venv/bin/python scripts/numerics_probe.py --compare tests/data/numerics_probe/<other>.json
Each entry hashes the exact bytes of one op's output on seeded inputs at the shapes the default
model uses (tokens 128 x 20, hidden 64, 8 experts, top-2, vocab 128).
"""

import hashlib
import json
import platform
import sys

import torch
import torch.nn.functional as F

torch.set_num_threads(1)


def h(t):
    t = t.detach().contiguous()
    return hashlib.sha256(
        t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()
    ).hexdigest()[:16]


def g(seed, *shape, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype)


def probes():
    out = {}
    N, H, E, K, V = 128 * 20, 64, 8, 2, 128
    x, w, b = g(1, N, H), g(2, 3 * H, H), g(3, 3 * H)
    out["randn"] = h(x)
    out["linear_nobias"] = h(F.linear(x, w))
    out["linear_bias_addmm"] = h(F.linear(x, w, b))
    out["matmul_small_32x64x32"] = h(g(4, 32, 64) @ g(5, 64, 32))
    out["matmul_tall_2560x64x128"] = h(x @ g(6, H, V))
    out["bmm_attn_scores"] = h(torch.bmm(g(7, 128 * 4, 20, 16), g(8, 128 * 4, 16, 20)))
    q, k, v = g(9, 128, 4, 20, 16), g(10, 128, 4, 20, 16), g(11, 128, 4, 20, 16)
    out["sdpa_causal"] = h(F.scaled_dot_product_attention(q, k, v, is_causal=True))
    logits = g(12, N, V)
    out["softmax"] = h(torch.softmax(logits, -1))
    out["log_softmax"] = h(torch.log_softmax(logits, -1))
    out["exp"] = h(torch.exp(logits))
    out["log"] = h(torch.log(logits.abs() + 1))
    out["rsqrt_mean_rmsnorm"] = h(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    out["silu"] = h(F.silu(x))
    out["sigmoid"] = h(torch.sigmoid(x))
    out["sum_reduce"] = h(x.sum(0))
    out["mean_reduce_last"] = h(x.mean(-1))
    r = torch.softmax(x @ g(13, H, E), -1)
    vals, idx = torch.topk(r, K, -1)
    out["router_topk_vals"] = h(vals)
    out["router_topk_idx"] = h(idx)
    # expert compute as a grouped matmul where torch has it, else per-expert loops
    xe = g(14, 64, H)
    we = g(15, E, H, 32)
    offs = torch.tensor([8 * (i + 1) for i in range(E)], dtype=torch.int32)
    try:
        out["grouped_mm"] = h(torch._grouped_mm(xe, we, offs=offs))
    except Exception as e:  # noqa: BLE001
        out["grouped_mm"] = f"unavailable: {type(e).__name__}"
    out["index_add"] = h(
        torch.zeros(N, H).index_add_(0, torch.randint(0, N, (N,), generator=torch.Generator().manual_seed(16)), x)
    )
    # backward of a linear layer: grad weight is a transposed matmul
    xw = x.clone().requires_grad_(True)
    ww = w.clone().requires_grad_(True)
    F.linear(xw, ww).square().mean().backward()
    out["linear_grad_w"] = h(ww.grad)
    out["linear_grad_x"] = h(xw.grad)
    # AdamW step
    p = torch.nn.Parameter(g(17, 1000))
    opt = torch.optim.AdamW([p], lr=3e-4)
    p.grad = g(18, 1000)
    opt.step()
    out["adamw_step"] = h(p)
    # the harness's own default model: logits and a backward on fixed tokens
    try:
        from moe_rl.models import build_model

        m = build_model("qwen3_moe", seed=0).train()
        ids = torch.randint(0, m.config.vocab_size, (128, 20), generator=torch.Generator().manual_seed(19))
        lo = m(input_ids=ids).logits
        out["model_logits"] = h(lo)
        lo.float().log_softmax(-1).mean().backward()
        out["model_grad_router0"] = h(
            next(pp.grad for n, pp in m.named_parameters() if "gate" in n and pp.grad is not None)
        )
        out["model_grad_embed"] = h(m.get_input_embeddings().weight.grad)
    except Exception as e:  # noqa: BLE001
        out["model"] = f"unavailable: {type(e).__name__}: {e}"
    return out


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    import os

    mine = {
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "env": {
            k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")
        },
        "mkldnn": torch.backends.mkldnn.is_available(),
        "digests": probes(),
    }
    if len(sys.argv) > 2 and sys.argv[1] == "--compare":
        other = json.load(open(sys.argv[2]))
        print(f"this: {mine['cpu']} ({mine['capability']}); other: {other['cpu']} ({other['capability']})")
        for k, v in mine["digests"].items():
            o = other["digests"].get(k)
            print(f"{'same  ' if o == v else 'DIFFER'} {k}")
    else:
        print(json.dumps(mine, indent=1))
