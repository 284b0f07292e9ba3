"""What torch.compile would give the update step, and whether route recording and replay survive it.

    python benchmarks/compile_probe.py [--batch 32] [--seq 20] [--repeats 15] [--backend inductor] [--dynamic]
                                       [--hooks-only]

On the default model (qwen3_moe, 8 experts, top-2, 2 MoE layers), one thread, it times a forward and backward of a
token log-prob loss three ways, interleaved (ABC order per repeat, CPU time of this process, medians):
- `eager`: the model as the harness runs it;
- `full`: the whole model compiled in place (`nn.Module.compile`, shapes static);
- `regional`: each decoder layer's attention, norms and experts compiled apart (`dynamic=True`), the routers and
  their hooks left eager: the compile that cannot disturb the hooks;
and prints `eager / full` and `eager / regional` (above 1: compiled is faster).

Then it checks the hooks under the fully compiled model, on fresh inputs of one shape, after one pass with no hook
(as the loop's rollout samples on most steps): a RouteRecorder, a second one (a new context object, as every pass of
the loop makes), a RoutedPass that replays permuted routes, and two recorded KV-cache samplings, each against the
same context on the eager model. It prints, per check, whether the context got the eager routes (`yes`) or none or
others (`NO`), twice: with Dynamo's default of no guards on module hooks (`skip_nnmodule_hook_guards`: the graph
traced without hooks keeps serving passes that have them, and the recorder records nothing), and with the guards
on, as `compile=true` sets them (a graph per set of hooks, reused by every new context of the same kind).

`--backend eager` traces with Dynamo and runs the captured graphs without inductor: seconds instead of a
compile, the same hook behaviour, no speed-up (the smoke test's setting).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from moe_rl.models import build_model
from moe_rl.rollout.sampler import sample_loop
from moe_rl.routing import RoutedPass, RouteRecorder, Routes
from moe_rl.routing.layers import find_moe_layers


def compile_regions(model: nn.Module, backend: str) -> int:
    """Compile every child of each decoder layer (and of its MoE block) that holds no router; the count compiled."""
    routers = {id(layer.router) for layer in find_moe_layers(model)}

    def holds_router(module: nn.Module) -> bool:
        return any(id(m) in routers for m in module.modules())

    regions = []
    for layer in model.model.layers:
        for child in layer.children():
            regions += [g for g in child.children() if not holds_router(g)] if holds_router(child) else [child]
    for region in regions:
        region.compile(backend=backend, dynamic=True)
    return len(regions)


def loss_step(model: nn.Module, ids: torch.Tensor) -> None:
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).mean().backward()


def routes_of(model: nn.Module, ids: torch.Tensor, forced: Routes | None = None) -> Routes | None:
    """The routes the experts received in one no-grad pass (None where the context recorded nothing, or a replay
    found it was not applied: RouteReplay raises then)."""
    try:
        with torch.no_grad(), RoutedPass(model, forced) as routed:
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        return routed.used
    except RuntimeError:
        return None


def sampled_routes(model: nn.Module, ids: torch.Tensor) -> Routes | None:
    """The routes recorded over a seeded 4-token KV-cache sampling of `ids` (prefill, then decode steps)."""
    torch.manual_seed(0)
    with torch.no_grad(), RouteRecorder(model) as recorder:
        sample_loop(model, ids, torch.ones_like(ids), max_new_tokens=4, eos_token_id=-1, pad_token_id=0)
    try:
        return recorder.routes
    except RuntimeError:
        return None


def timing(eager: nn.Module, args: argparse.Namespace) -> None:
    """eager, full and regional compile's fwd+bwd times, interleaved; prints the medians and the ratios."""
    full = copy.deepcopy(eager)
    full.compile(backend=args.backend, dynamic=args.dynamic)
    regional = copy.deepcopy(eager)
    n = compile_regions(regional, args.backend)
    ids = torch.randint(3, eager.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    models = {"eager": eager, "full": full, "regional": regional}
    first = {}
    for name, model in models.items():  # the first call compiles
        start = time.process_time()
        loss_step(model, ids)
        first[name] = time.process_time() - start
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            start = time.process_time()
            loss_step(model, ids)
            times[name].append(time.process_time() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"fwd+bwd, batch {args.batch} x {args.seq} tokens, 1 thread, backend {args.backend}, {n} regions")
    for name in models:
        print(f"{name:<9} {1e3 * med[name]:8.2f} ms   first call {first[name]:6.1f} s")
    print(f"eager / full      {med['eager'] / med['full']:.2f}x")
    print(f"eager / regional  {med['eager'] / med['regional']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--backend", default="inductor", choices=("inductor", "eager"))
    parser.add_argument("--dynamic", action="store_true", help="compile the full model with dynamic=True")
    parser.add_argument("--hooks-only", action="store_true", help="only the hook checks (no timing)")
    args = parser.parse_args(argv)
    torch._dynamo.reset()
    eager = build_model("qwen3_moe")
    if not args.hooks_only:
        timing(eager, args)
    for guards in (False, True):  # torch's default, then what compile=true sets (moe_rl.loop.compiled)
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=not guards):
            torch._dynamo.reset()
            model = copy.deepcopy(eager)
            model.compile(backend=args.backend, dynamic=args.dynamic)
            for label, ok in hook_checks(eager, model):
                print(
                    f"hook guards {'on ' if guards else 'off'}, {label:<30} got the eager routes: {'yes' if ok else 'NO'}"
                )


def hook_checks(eager: nn.Module, model: nn.Module) -> list[tuple[str, bool]]:
    """Whether route contexts on the compiled `model` see what they see on `eager`, on fresh inputs of one shape."""
    gen = torch.Generator().manual_seed(1)
    vocab = eager.config.vocab_size
    checks = []
    with torch.no_grad():
        model(input_ids=torch.randint(3, vocab, (4, 9), generator=gen), attention_mask=torch.ones(4, 9).long())
    for label in ("recorder after a hookless pass", "second recorder"):
        x = torch.randint(3, vocab, (4, 9), generator=gen)
        want, got = routes_of(eager, x), routes_of(model, x)
        checks.append((label, got is not None and want is not None and torch.equal(got.indices, want.indices)))
    x = torch.randint(3, vocab, (4, 9), generator=gen)
    native = routes_of(eager, x)
    assert native is not None
    forced = Routes.from_topk(
        (native.indices.long() + 1) % native.num_experts, native.mask, native.layer_map, native.num_experts
    )
    got = routes_of(model, x, forced)
    checks.append(("replayed routes", got is not None and torch.equal(got.indices, forced.indices)))
    for label in ("first sampling", "second sampling"):
        x = torch.randint(3, vocab, (4, 9), generator=gen)
        want, got = sampled_routes(eager, x), sampled_routes(model, x)
        checks.append((label, got is not None and want is not None and torch.equal(got.indices, want.indices)))
    return checks


if __name__ == "__main__":
    main()
