"""`compile=true`: the policy compiled in place with torch.compile (inductor), so every pass of the loop runs it
compiled: the rollout's prefill and decoding steps, the old pass, the updates' forward and backward, the ratio
split and the evaluations. Route recording and replay keep working: the route hooks (`moe_rl.routing.hooks.
RouteHooks`) are registered on the routers and the model once, before the model is compiled, and Dynamo traces
them into the graphs; a route context opens by joining them, never by registering a hook, so the graphs guard on
which contexts are open and on their state, and a new context of a kind already seen reuses its graph.

Dynamo's default is not to guard on module hooks (`skip_nnmodule_hook_guards`): a graph traced before a hook was
registered would keep running without it. The route hooks never change, but transformers registers its output
capture hooks the first time a pass asks for router logits (the updates' aux-loss and z-loss terms), so a
compiled run turns those guards on (`benchmarks/compile_probe.py` shows both settings).

One compiled model serves passes that differ in grad mode, in train or eval mode, in the route contexts open and
in their inputs (a KV cache or not), and Dynamo keeps one graph per such variant (11 in an R2 run whose route
instruments and evaluations run every 2nd step, all traced by its 4th step, none breaking:
tests/test_compiled.py), with dynamic batch and sequence sizes (`dynamic=True`: no recompiling as rollouts change
shape). Inductor's cache (`TORCHINDUCTOR_CACHE_DIR`, default /tmp/torchinductor_<user>) is shared by every process
on the machine, so a sweep's later runs reuse the kernels its first run generated; and a process's later runs
trace nothing (a second run in one process traced no new graph), so a joblib multirun pays the tracing once per
worker (docs/performance.md).

A compiled run is its own numerics domain: inductor generates its own kernels (fusing what ATen runs as separate
ops, in another order of floating-point operations), so its numbers leave the eager run's in the last bits and
then by seed-to-seed amounts. Under a pinned `numerics`, inductor's vector width is pinned to AVX2's 256 bits as
ATen's kernels are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from torch import nn

from moe_rl.routing.hooks import RouteHooks
from moe_rl.routing.layers import find_moe_layers

if TYPE_CHECKING:
    from moe_rl.config import TrainConfig

log = logging.getLogger(__name__)

# Dynamo's per-function limit on compiled variants (8 by default) is below what the loop compiles; past it Dynamo
# falls back to eager silently, so the limit is raised well above a run's count.
RECOMPILE_LIMIT = 64
BACKEND = "inductor"  # tests trace with "eager" (Dynamo's graphs run by ATen: the eager numbers, bitwise)


def refuse_compile(*, engine: str, world_size: int) -> str | None:
    """Why `compile=true` cannot apply to this run (None when it can): the run logs it, records `compiled: false`
    in its meta and runs eager."""
    if engine != "hf":
        return f"rollout.engine={engine} generates with its own kernels from its own copy of the weights"
    if world_size > 1:
        return f"a run over {world_size} processes (FSDP2 or DDP) is not compiled by the harness"
    return None


def _configure(numerics: str) -> None:
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    dynamo_config.skip_nnmodule_hook_guards = False  # a graph per set of hooks, never one that ignores them
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    if numerics != "native":
        inductor_config.cpp.simdlen = 256  # the pinned kernels' AVX2 width (moe_rl.run.folder.PINNED_ENV)


def compile_policy(model: nn.Module, *, numerics: str) -> None:
    """Compile `model` in place (`nn.Module.compile`): its parameters, state dict and hooks stay as they are."""
    _configure(numerics)
    if find_moe_layers(model, required=False):
        RouteHooks.of(model)  # the route hooks the graphs trace, registered before the first of them
    model.compile(backend=BACKEND, dynamic=True)


def compiled_forward(model: nn.Module, *, numerics: str) -> Callable[..., Any]:
    """A compiled wrapper of `model` (`cold_start.compile`: the warm-up's SFT steps), sharing its parameters; the
    model itself stays eager (the warm-up's greedy evaluations)."""
    import torch

    _configure(numerics)
    return torch.compile(model, backend=BACKEND, dynamic=True)


def compile_run(models: Iterable[nn.Module], cfg: TrainConfig, world_size: int) -> bool:
    """`compile=true`: each distinct model of `models` (the policy, the rollout's copy) compiled in place; False,
    with a warning, where the run cannot be compiled (`refuse_compile`): it runs eager."""
    refusal = refuse_compile(engine=cfg.rollout.engine, world_size=world_size)
    if refusal is not None:
        log.warning("compile=true: %s; the run is eager", refusal)
        return False
    for model in {id(m): m for m in models}.values():
        compile_policy(model, numerics=cfg.numerics)
    return True
