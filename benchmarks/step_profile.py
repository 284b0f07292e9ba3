"""Where an RL step's time goes, phase by phase, against the same model's bare work (the floor).

    python benchmarks/step_profile.py [--models default,fine] [--repeats 9] [--threads 1] [--replay r3]
                                      [--route-every K] [--split-rows S] [--compile]

For each model (`default`: qwen3_moe, 8 experts, top-2, 2 MoE layers; `fine`: the `qwen3_moe_fine`
preset, 64 experts of width 16, top-8, 4 MoE layers) it times `moe_rl.train.Trainer.step` split
into phases and, interleaved with it, the floor of each phase on a copy of the same model:

    phase              what the harness does                     floor (bare work)
    generate           rollout.generate: sampling + route record  a bare KV-cache sampling loop
    rollout other      tokenising, decoding, rewards               -
    old pass           old_pass: no-grad forward + records         plain no-grad model(...) forward
    forward            update minus the phases below               plain model(...) + token log-probs
    ratio split        the split's no-grad forward per update      plain no-grad model(...) + log-probs
                       under the other routing (+ its records)     on the update's rows
    backward           loss.backward                               backward of a plain loss
    optimizer          clip_grad_norm_ + AdamW + scheduler         AdamW.step
    route bookkeeping  route assembly, route/* comparisons         -
    metrics            ratio stats, entropy, aggregation, rest     -

The ratio split (docs/design.md §3) is an instrument the floor would not run, so it is its own phase
with its own floor (the same no-grad forward without hooks, on as many rows); `step` is the harness over
the floor of every phase.

The route instruments and the split run on the steps that are multiples of `metrics.route_every` (K),
the split on `metrics.split_rows` (S) rows of each update (moe_rl.config.MetricsConfig); `--route-every`
and `--split-rows` set them (default: the config's defaults; `--split-rows 0`: all rows). Three blocks
per model:
- `route step`: the phase table of a step that runs the instruments, its split on S rows, against the
  floor with the split on S rows; `step w/o split` the same less the split on both sides; `split on/off`
  such a step with its split over one without (`replay.split_every=0`), both uninstrumented;
- `other steps`: the phase table of a step between route steps (a large K) against the floor without
  the split, and `step`, its ratio: what a run at a large K costs per step;
- `mean step`: a run's step averaged over K steps (K - 1 other steps and one route step, uninstrumented)
  over the floor averaged the same way, `split on/off` the same with and without the split; and, for
  comparison, `all rows, K=1`: every step a route step with the split on all rows (the loop before
  `metrics`), over its floor, and its split on/off.

`--compile` profiles a `compile=true` run against a floor that is compiled too (each its own torch.compile of the
same weights, inductor, `dynamic=True`): the same table for compiled runs. Comparing its absolute times with an
eager profile's is not a measure (they run in different processes, at different loads); the runs-per-hour ratio
of compiled to eager is `benchmarks/sweep_throughput.py`'s.

Harness steps and floor steps alternate (ABBA order), so when the machine is loaded (other jobs,
sweeps at higher priority) the load hits both alike; every figure is a median over repeats and
every ratio the median of per-repeat ratios. By default the clock is this process's CPU time
(`--clock cpu`, with one torch thread), which time-slicing by other jobs does not inflate;
`--clock wall` gives elapsed time. Absolute times on a loaded machine are not comparable across
runs (cache and frequency effects remain); the ratios are the figures to quote.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers

import moe_rl.loop.step_metrics as step_module
import moe_rl.train as train_module
from moe_rl.config import TrainConfig
from moe_rl.loop.compiled import compile_policy
from moe_rl.rollout.generate import position_ids, token_logp
from moe_rl.routing import RoutedPass
from moe_rl.train import Trainer

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
now = CLOCKS["cpu"]

MODELS = {
    "default": {},
    "fine": {"num_experts": 64, "top_k": 8, "num_layers": 4, "moe_intermediate_size": 16},
}
PHASES = (
    "generate",
    "rollout other",
    "old pass",
    "forward",
    "ratio split",
    "backward",
    "optimizer",
    "route bookkeeping",
    "metrics",
)
FLOORED = {
    "generate": "generate",
    "old pass": "old pass",
    "forward": "forward",
    "ratio split": "ratio split",
    "backward": "backward",
    "optimizer": "optimizer",
}
# What the loop calls, booked by where it comes from: every function that `moe_rl.train` or its metric
# assembly (`moe_rl.loop.step_metrics`) imports from `moe_rl.routing` is route bookkeeping, every one from the
# metric modules is metrics. Other helpers are named here, with the loop module that calls them; a name
# missing there is an error (a refactor renamed it), not a phase that silently stops being timed.
LOOP_MODULES = (train_module, step_module)
ROUTE_MODULES = ("moe_rl.routing",)
METRIC_MODULES = ("moe_rl.metrics.ratio_stats", "moe_rl.metrics.partial", "moe_rl.algos.advantages")
NAMED = {
    (train_module, "generate"): "generate",
    (train_module, "token_entropy"): "metrics",
    (step_module, "aggregate"): "metrics",
}


def phase_functions() -> dict[tuple[Any, str], str]:
    """{(loop module, name): phase} for every function the step's phases are timed through."""
    phases = {}
    for module in LOOP_MODULES:
        for name, fn in vars(module).items():
            if not inspect.isfunction(fn):
                continue
            if fn.__module__.startswith(ROUTE_MODULES):
                phases[module, name] = "route bookkeeping"
            elif fn.__module__.startswith(METRIC_MODULES):
                phases[module, name] = "metrics"
    missing = [f"{module.__name__}.{name}" for module, name in NAMED if not hasattr(module, name)]
    if missing:
        raise AttributeError(f"no {missing}: update step_profile.py's phase lists")
    phases.update(NAMED)
    return phases


class PhaseClock:
    """Seconds per phase; `wrap` times a callable into a phase. Calls made inside a scope (`old pass`,
    `update`, `ratio split`, which nest) are also booked under `<scope> <phase>` for every open scope, so
    each scope's own work is what is left."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.scopes: list[str] = []

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            outer = [s for s in self.scopes if s != phase]  # the scopes open when the call began
            start = now()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = now() - start
                self.seconds[phase] += dt
                for scope in outer:
                    self.seconds[f"{scope} {phase}"] += dt

        return timed

    def wrap_scope(self, scope: str, fn):
        def scoped(*args, **kwargs):
            self.scopes.append(scope)
            try:
                return fn(*args, **kwargs)
            finally:
                self.scopes.pop()

        return self.wrap(scope, scoped)


@contextmanager
def instrumented(trainer: Trainer, clock: PhaseClock):
    """Time the step's phases by wrapping what `moe_rl.train` calls; everything is restored after."""
    phases = phase_functions()
    saved_module = {key: getattr(*key) for key in phases}
    saved_props = {name: getattr(RoutedPass, name) for name in ("native", "used", "scores", "margins")}
    saved_backward, saved_clip = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_
    try:
        for (module, name), phase in phases.items():
            setattr(module, name, clock.wrap(phase, saved_module[module, name]))
        for name, prop in saved_props.items():
            setattr(RoutedPass, name, property(clock.wrap("route bookkeeping", prop.fget)))
        torch.Tensor.backward = clock.wrap("backward", saved_backward)
        torch.nn.utils.clip_grad_norm_ = clock.wrap("optimizer", saved_clip)
        trainer.optimizer.step = clock.wrap("optimizer", trainer.optimizer.step)
        trainer.optimizer.zero_grad = clock.wrap("optimizer", trainer.optimizer.zero_grad)
        trainer.scheduler.step = clock.wrap("optimizer", trainer.scheduler.step)
        trainer.rollout = clock.wrap("rollout", trainer.rollout)
        trainer.old_pass = clock.wrap_scope("old pass", trainer.old_pass)
        trainer.update = clock.wrap_scope("update", trainer.update)
        trainer.other_routing_logp = clock.wrap_scope("ratio split", trainer.other_routing_logp)
        yield
    finally:
        for (module, name), fn in saved_module.items():
            setattr(module, name, fn)
        for name, prop in saved_props.items():
            setattr(RoutedPass, name, prop)
        torch.Tensor.backward, torch.nn.utils.clip_grad_norm_ = saved_backward, saved_clip
        for attr in ("rollout", "old_pass", "update", "other_routing_logp"):
            trainer.__dict__.pop(attr, None)
        for attr in ("step", "zero_grad"):
            trainer.optimizer.__dict__.pop(attr, None)
        trainer.scheduler.__dict__.pop("step", None)


def harness_step(trainer: Trainer, step: int) -> dict[str, float]:
    """One `Trainer.step`, split into PHASES (seconds); `total` is the whole step."""
    clock = PhaseClock()
    with instrumented(trainer, clock):
        start = now()
        trainer.step(step)
        total = now() - start
    s = clock.seconds
    out = {
        "generate": s["generate"],
        "rollout other": s["rollout"] - s["generate"],
        "old pass": s["old pass"] - s["old pass route bookkeeping"],
        "backward": s["backward"],
        "optimizer": s["optimizer"],
        "route bookkeeping": s["route bookkeeping"],
        "total": total,
    }
    out["ratio split"] = s["ratio split"] - s["ratio split route bookkeeping"]
    out["forward"] = (
        s["update"]
        - s["update backward"]
        - s["update optimizer"]
        - s["update route bookkeeping"]
        - s["update metrics"]
        - out["ratio split"]
    )
    out["metrics"] = total - sum(out[p] for p in PHASES if p != "metrics")  # the metric functions and the rest
    return out


@contextmanager
def setting(trainer: Trainer, *, route_every: int, split_rows: int | None, split_every: int = 1):
    """`trainer`'s steps with `metrics.route_every`, `metrics.split_rows` and `replay.split_every` set
    (a step that is a multiple of `route_every` runs the route instruments; `split_every=0`: no split)."""
    cfg = trainer.cfg
    saved = cfg.metrics.route_every, cfg.metrics.split_rows, cfg.replay.split_every
    cfg.metrics.route_every, cfg.metrics.split_rows, cfg.replay.split_every = route_every, split_rows, split_every
    try:
        yield
    finally:
        cfg.metrics.route_every, cfg.metrics.split_rows, cfg.replay.split_every = saved


def plain_step(trainer: Trainer, step: int) -> float:
    """Seconds of one uninstrumented `Trainer.step`."""
    start = now()
    trainer.step(step)
    return now() - start


@torch.inference_mode()  # as the harness's sampling loop
def bare_sampling(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
) -> torch.Tensor:
    """The floor of `generate`: prefill, then one KV-cache decode call per token, sampling from the
    last logits; no recording, no stopping checks, no stored logits."""
    cache = transformers.DynamicCache(config=model.config)
    positions = position_ids(attention_mask)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    next_pos = positions[:, -1:] + 1
    tokens = [input_ids]
    for i in range(max_new_tokens):
        probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)
        token = torch.multinomial(probs, 1)
        tokens.append(token)
        if i + 1 == max_new_tokens:
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
        out = model(
            input_ids=token,
            attention_mask=attention_mask,
            position_ids=next_pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        next_pos = next_pos + 1
    return torch.cat(tokens, dim=1)


def floor_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer: Trainer,
    rollout,
    step: int,
    new_tokens: int,
    split_rows: int | None,
) -> dict[str, float]:
    """The bare work of one step on `model`: sampling as many tokens as the harness's rollout had,
    one no-grad forward over the batch, N plain forward/backward/AdamW updates, and the ratio split's
    floor, one more no-grad forward per update: `ratio split` on `split_rows` of its rows (None: all),
    `ratio split, all rows` on all of them (neither is in the other phases)."""
    cfg = trainer.cfg
    enc = trainer.tokenizer(
        [e["prompt"] for e in trainer.prompts_for(step)], return_tensors="pt", padding=True, add_special_tokens=False
    )
    ids = enc["input_ids"].repeat_interleave(cfg.rollout.group_size, 0)
    mask = enc["attention_mask"].repeat_interleave(cfg.rollout.group_size, 0)
    out: dict[str, float] = defaultdict(float)
    t = now()
    bare_sampling(model, ids, mask, new_tokens, cfg.rollout.temperature)
    out["generate"] = now() - t
    inputs, targets = rollout.inputs, rollout.targets
    attn = rollout.attention_mask[:, :-1]
    t = now()
    with torch.no_grad():
        model(input_ids=inputs, attention_mask=attn, position_ids=position_ids(attn))
    out["old pass"] = now() - t
    model.train()
    for rows in torch.arange(len(rollout)).chunk(cfg.optim.updates_per_rollout):
        t0 = now()
        logits = model(input_ids=inputs[rows], attention_mask=attn[rows], position_ids=position_ids(attn[rows])).logits
        loss = (
            -(token_logp(logits, targets[rows]) * rollout.response_mask[rows]).sum() / rollout.response_mask[rows].sum()
        )
        t1 = now()
        loss.backward()
        t2 = now()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = now()
        out["forward"] += t1 - t0
        out["backward"] += t2 - t1
        out["optimizer"] += t3 - t2
        for phase, scored in (("ratio split", rows[:split_rows]), ("ratio split, all rows", rows)):
            t = now()
            with torch.no_grad():
                logits = model(
                    input_ids=inputs[scored], attention_mask=attn[scored], position_ids=position_ids(attn[scored])
                ).logits
                token_logp(logits, targets[scored])
            out[phase] += now() - t
    model.eval()
    return out


def floor_total(floor: dict[str, float], split: str | None) -> float:
    """A floor step's seconds with the split phase `split` (None: no split)."""
    return sum(v for k, v in floor.items() if not k.startswith("ratio split")) + (floor[split] if split else 0.0)


def config(model: str, args: argparse.Namespace, out_dir: Path) -> TrainConfig:
    cfg = TrainConfig(
        out_dir=str(out_dir / model), steps=10**6, progress=False, snapshot_every=0, eval_size=16, threads=args.threads
    )
    cfg.replay.mode = args.replay
    cfg.compile = args.compile
    cfg.task.max_new_tokens = args.max_new_tokens
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = args.prompts, args.group
    cfg.optim.updates_per_rollout = args.updates
    cfg.cold_start.band = [0.0, 1.0]  # profiling needs a policy that emits EOS, not a good one
    cfg.cold_start.max_steps, cfg.cold_start.eval_every = args.cold_start_steps, args.cold_start_steps
    for key, value in MODELS[model].items():
        setattr(cfg.model, key, value)
    return cfg


def phase_table(harness_rows: list[dict], floor_rows: list[dict], split: str | None) -> None:
    """The phases' medians (harness ms, share, floor ms, harness/floor) and the step's, over `floor_rows`
    with the split phase `split` (None: none); with a split, also the step less it on both sides."""
    total = statistics.median(r["total"] for r in harness_rows)
    print(f"{'phase':<20}{'harness ms':>12}{'share':>8}{'floor ms':>10}{'harness/floor':>15}")
    floors = [{**f, "ratio split": f[split] if split else 0.0} for f in floor_rows]
    for phase in PHASES:
        h = statistics.median(r[phase] for r in harness_rows)
        share = statistics.median(r[phase] / r["total"] for r in harness_rows)
        if phase in FLOORED and all(r[FLOORED[phase]] > 0 for r in floors):
            f = statistics.median(r[FLOORED[phase]] for r in floors)
            ratio = statistics.median(hr[phase] / fr[FLOORED[phase]] for hr, fr in zip(harness_rows, floors))
            print(f"{phase:<20}{h * 1e3:12.1f}{share:8.1%}{f * 1e3:10.1f}{ratio:14.2f}x")
        else:
            print(f"{phase:<20}{h * 1e3:12.1f}{share:8.1%}{'-':>10}{'-':>15}")
    totals = [floor_total(f, split) for f in floor_rows]
    ratio = statistics.median(h["total"] / f for h, f in zip(harness_rows, totals))
    print(f"{'step':<20}{total * 1e3:12.1f}{'100%':>8}{statistics.median(totals) * 1e3:10.1f}{ratio:14.2f}x")
    if split:  # the step's other phases alone, over their floors
        rest = [h["total"] - h["ratio split"] for h in harness_rows]
        rest_floor = [floor_total(f, None) for f in floor_rows]
        ratio = statistics.median(h / f for h, f in zip(rest, rest_floor))
        h, f = statistics.median(rest), statistics.median(rest_floor)
        print(f"{'step w/o split':<20}{h * 1e3:12.1f}{'':>8}{f * 1e3:10.1f}{ratio:14.2f}x")


def ratio_line(label: str, pairs: list[tuple[float, float]]) -> None:
    """`label`, the medians of both sides (ms) and the median of the per-repeat ratios."""
    a, b = (statistics.median(p[j] for p in pairs) for j in (0, 1))
    ratio = statistics.median(x / y for x, y in pairs)
    print(f"{label:<20}{a * 1e3:12.1f}{'':>8}{b * 1e3:10.1f}{ratio:14.2f}x")


def profile(model: str, args: argparse.Namespace, root: Path) -> None:
    trainer = Trainer(config(model, args, root))
    K = args.route_every or trainer.cfg.metrics.route_every
    S = trainer.cfg.metrics.split_rows if args.split_rows is None else (args.split_rows or None)
    large = 10**9  # a route_every no step reaches: every step is an other step
    floor_model = copy.deepcopy(trainer.policy)
    if args.compile:  # the copy shares the policy's compiled call: the floor gets a compile of its own
        floor_model._compiled_call_impl = None
        compile_policy(floor_model, numerics=trainer.cfg.numerics)
    floor_opt = torch.optim.AdamW(floor_model.parameters(), lr=trainer.cfg.optim.lr, betas=(0.9, 0.99))
    rollout, _, _ = trainer.rollout(1)
    new_tokens = trainer.cfg.task.max_new_tokens
    rows: dict[str, list] = defaultdict(list)
    step = 0

    def nxt() -> int:
        nonlocal step
        step += 1
        return step

    timings = {  # each a step of its own setting; `route`/`other` are the phase-timed ones
        "route": lambda: _with(trainer, 1, S, 1, lambda: harness_step(trainer, nxt())),
        "other": lambda: _with(trainer, large, S, 1, lambda: harness_step(trainer, nxt())),
        "floor": lambda: floor_step(floor_model, floor_opt, trainer, rollout, nxt(), new_tokens, S),
        "on": lambda: _with(trainer, 1, S, 1, lambda: plain_step(trainer, nxt())),
        "off": lambda: _with(trainer, 1, S, 0, lambda: plain_step(trainer, nxt())),
        "plain": lambda: _with(trainer, large, S, 1, lambda: plain_step(trainer, nxt())),
        "all": lambda: _with(trainer, 1, None, 1, lambda: plain_step(trainer, nxt())),
    }
    for i in range(args.warmup + args.repeats):
        order = list(timings) if i % 2 else list(reversed(timings))  # ABBA
        measured = {name: timings[name]() for name in order}
        if i >= args.warmup:
            for name, value in measured.items():
                rows[name].append(value)
    cfg = trainer.cfg
    L, E, k = cfg.model.num_layers, cfg.model.num_experts, cfg.model.top_k
    n = len(rows["floor"])
    print(
        f"\n== {model}: qwen3_moe, {L} MoE layers, {E} experts, top-{k}, replay {args.replay}; "
        f"{args.prompts}x{args.group} rollouts, <= {args.max_new_tokens} new tokens, {args.updates} updates; "
        f"{torch.get_num_threads()} threads{', compiled' if trainer.compiled else ''}; medians of {n} interleaved "
        "repeats =="
    )
    split_label = "all rows" if S is None else f"{S} rows"
    print(f"-- route step (instruments on, split on {split_label} of each update) --")
    phase_table(rows["route"], rows["floor"], "ratio split")
    ratio_line("split on/off", list(zip(rows["on"], rows["off"])))
    print("-- other steps (no instruments: a large metrics.route_every) --")
    phase_table(rows["other"], rows["floor"], None)
    print(f"-- mean step over K={K} steps (metrics.route_every={K}, split_rows={S}) --")

    def mean(other: float, route: float) -> float:
        return ((K - 1) * other + route) / K

    floors = rows["floor"]
    runs = [mean(p, on) for p, on in zip(rows["plain"], rows["on"])]
    ratio_line("step", [(r, mean(floor_total(f, None), floor_total(f, "ratio split"))) for r, f in zip(runs, floors)])
    ratio_line("split on/off", [(r, mean(p, off)) for r, p, off in zip(runs, rows["plain"], rows["off"])])
    print("-- all rows, K=1 (every step a route step, the split on all rows) --")
    ratio_line("step", [(a, floor_total(f, "ratio split, all rows")) for a, f in zip(rows["all"], floors)])
    ratio_line("split on/off", list(zip(rows["all"], rows["off"])))


def _with(trainer: Trainer, route_every: int, split_rows: int | None, split_every: int, fn):
    with setting(trainer, route_every=route_every, split_rows=split_rows, split_every=split_every):
        return fn()


def add_step_options(parser: argparse.ArgumentParser) -> None:
    """The options `config` reads (less `--replay` and `--compile`), and the models and repeats to time."""
    parser.add_argument("--models", default="default,fine")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--cold-start-steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_options(parser)
    parser.add_argument("--replay", default="r3", choices=("none", "r2", "r3"))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--route-every", type=int, default=None, help="metrics.route_every (default: the config's)")
    parser.add_argument(
        "--split-rows", type=int, default=None, help="metrics.split_rows (default: the config's; 0: all rows)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile=true: the harness's policy and the floor's model both compiled (more --warmup: each setting "
        "traces its graphs on its first steps)",
    )
    parser.add_argument(
        "--clock",
        default="cpu",
        choices=tuple(CLOCKS),
        help="cpu: this process's CPU time (robust to other jobs on the machine); wall: elapsed",
    )
    args = parser.parse_args(argv)  # argv: the smoke tests run main in-process at tiny sizes
    global now
    now = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    # The timing wrapper around optimizer.step looks to the scheduler like an override; it is not one.
    warnings.filterwarnings("ignore", message="Seems like `optimizer.step\\(\\)` has been overridden")
    print(
        f"Clock: {args.clock} time. Harness and floor steps alternate (ABBA), so machine load (e.g. sweeps at "
        "higher priority) hits both alike: quote the ratios; absolute times vary with the load."
    )
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            profile(model, args, Path(tmp))


if __name__ == "__main__":
    main()
