"""Run by tests/test_distributed.py under `torchrun --nproc_per_node=2`: replay on FSDP2-sharded routers.

Each rank replays random routes on its own rows with gradient checkpointing on; the sharded gradients must
equal the mean of the two ranks' gradients of an unsharded copy, with one route record per layer and
pass, and the replay applied in the forward and in the recomputation. Prints "ok" per rank.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from moe_rl.loop.distributed import shutdown
from moe_rl.models import build_model
from moe_rl.routing import RouteRecorder, RouteReplay, Routes, find_moe_layers


def inputs(rank: int) -> torch.Tensor:
    return torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(10 + rank))


def routes(model, rank: int) -> Routes:
    layers = find_moe_layers(model)
    E, k = layers[0].num_experts, layers[0].top_k
    g = torch.Generator().manual_seed(20 + rank)
    topk = torch.rand(2, 10, len(layers), E, generator=g).argsort(-1)[..., :k]
    return Routes.from_topk(topk, None, [layer.decoder_layer for layer in layers], E)


def grads(model, rank: int, replay: bool) -> dict[str, torch.Tensor]:
    model.zero_grad()
    if replay:
        with RouteReplay(model, routes(model, rank)):
            model(inputs(rank)).logits.pow(2).mean().backward()
    else:
        model(inputs(rank)).logits.pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_model("qwen3_moe")
    model.train()
    reference_model = copy.deepcopy(model)
    per_rank = [grads(reference_model, r, replay=True) for r in range(2)]
    reference = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in per_rank[0]}  # FSDP averages
    native = [grads(reference_model, r, replay=False) for r in range(2)]

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    layers = find_moe_layers(model)
    assert type(layers[0].router.weight).__name__ == "DTensor"
    forced = routes(model, rank)
    replay = RouteReplay(model, forced, record_native=True)  # the attach-time rule check gathers the weight
    calls: list[int] = []
    counters = [layer.router.register_forward_hook(lambda m, a, o: calls.append(1)) for layer in layers]
    with replay, RouteRecorder(model) as rec:
        model(inputs(rank)).logits.pow(2).mean().backward()
    for handle in counters:
        handle.remove()
    assert len(calls) == 2 * len(layers), calls  # forward + recomputation in backward
    assert len(rec.records) == 1 and torch.equal(rec.routes.indices, forced.indices)
    assert replay.passes == 1
    for name, param in model.named_parameters():
        got = param.grad.full_tensor()
        torch.testing.assert_close(got, reference[name], rtol=1e-5, atol=1e-7, msg=name)
    gap = max((native[rank][n] - per_rank[rank][n]).abs().max().item() for n in reference)
    assert gap > 1e-4, gap  # replay changes the gradients, so the comparison above can fail
    print(f"rank {rank} ok", flush=True)
    shutdown()  # what a run does at exit (`Dist` registers it with atexit): without it 1 exit in 10 aborts


if __name__ == "__main__":
    main()
