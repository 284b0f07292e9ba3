"""Time per RL step: the harness's own loop vs TRL's GRPOTrainer, interleaved, with the phase split.

    python benchmarks/trl_vs_harness.py [--prompts 16] [--group 8] [--max-new-tokens 8] [--updates 4]
                                        [--repeats 6] [--warmup 1] [--arms none,r2] [--threads N]
                                        [--route-every K] [--split-rows S]

One RL step = sample G completions for each of P prompts, score them, one old-policy pass, then N
optimizer updates on N mini-batches of the rollout batch. Both sides get the same cold-start model
(a copy), the same prompts in the same order, the same sampling (temperature 1, no top-k/top-p),
fp32, no gradient checkpointing, the same optimizer settings and the GRPO loss (eps 0.2 / 0.27, no KL,
no load-balancing loss). In TRL terms: per_device_train_batch_size = P*G/N, steps_per_generation = N,
num_iterations = 1, gradient_accumulation_steps = 1, so TRL also computes old log-probs once per
rollout and takes N optimizer steps. Arm `none` runs plain `GRPOTrainer`; arms `r2`/`r3` run
`moe_rl.integrations.trl.MoeGRPOTrainer` against the harness in the same replay mode.

The two loops alternate inside one process: a TRL callback runs one harness step after every N TRL
optimizer steps, so machine noise hits both alike. TRL's time per step is the wall time between
those callbacks (its whole loop: data loading, generation, scoring, updates, optimizer, logging);
its phases come from timing its methods. Prints the median over steps of TRL time / harness time.
`--clock cpu` times this process's CPU time instead of elapsed time: with `--threads 1` it is not
inflated when other jobs share the machine.

The harness runs at the config's defaults unless told otherwise: its route instruments and ratio split
on the steps that are multiples of `metrics.route_every` (`--route-every`), the split on
`metrics.split_rows` rows of each update (`--split-rows`, 0: all; `--route-every 1 --split-rows 0` is every
instrument on every step and row). TRL logs no route instruments. Beside the median of the per-step ratios
(which a route step every K > 2 steps does not move), the report gives the ratio of the mean step times over
the window and how many of its harness steps ran the instruments: run `--repeats` of at least K for a
window that holds one.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers
import trl
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from moe_rl.config import TrainConfig
from moe_rl.integrations.trl import MoeGRPOTrainer, algo_args, task_reward
from moe_rl.train import Trainer

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["wall"]


def timed(base: type) -> type:
    """`base` with its generation, scoring, old-logp pass and training steps timed into `self.phases`."""

    class Timed(base):
        def _generate_and_score_completions(self, inputs):
            start = clock()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.phases["score"] += clock() - start

        def _generate_single_turn(self, *args, **kwargs):
            start = clock()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.phases["generate"] += clock() - start

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            start = clock()
            try:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            finally:
                if not torch.is_grad_enabled():  # the old-policy pass (beta = 0: no reference pass)
                    self.phases["old_logp"] += clock() - start

        def training_step(self, *args, **kwargs):
            start = clock()
            try:
                return super().training_step(*args, **kwargs)
            finally:
                self.phases["training_step"] += clock() - start

    Timed.__name__ = f"Timed{base.__name__}"
    return Timed


def _timed_call(fn, phases: dict[str, float], name: str):
    def call(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += clock() - start

    return call


class Interleave(TrainerCallback):
    """After every N TRL optimizer steps (one RL step), time it and run one harness step."""

    def __init__(self, updates: int, harness: Trainer) -> None:
        self.updates, self.harness = updates, harness
        self.trl_rows: list[dict[str, float]] = []
        self.harness_rows: list[dict[str, float]] = []
        self.trainer = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.mark = clock()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.updates:
            return
        now = clock()
        phases = dict(self.trainer.phases)
        self.trainer.phases.clear()
        self.trl_rows.append({"total": now - self.mark, **phases})
        rl_step = state.global_step // self.updates  # TRL just consumed the prompts of this step
        phases: dict[str, float] = defaultdict(float)
        harness = self.harness
        for name in ("rollout", "old_pass", "update"):  # timed with the benchmark's clock
            setattr(harness, name, _timed_call(getattr(harness, name), phases, name))
        try:
            start = clock()
            self.harness.step(rl_step)
            total = clock() - start
        finally:
            for name in ("rollout", "old_pass", "update"):
                harness.__dict__.pop(name, None)
        self.harness_rows.append(
            {"total": total, "rollout": phases["rollout"], "old_logp": phases["old_pass"], "update": phases["update"]}
        )
        self.mark = clock()


def harness_config(args: argparse.Namespace, replay: str, out_dir: Path) -> TrainConfig:
    cfg = TrainConfig(
        out_dir=str(out_dir),
        steps=args.repeats + args.warmup,
        progress=False,
        snapshot_every=0,
        eval_size=16,
        threads=args.threads,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    cfg.algo.name, cfg.replay.mode = "grpo", replay
    cfg.task.name, cfg.task.max_new_tokens = "reversal", args.max_new_tokens
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = args.prompts, args.group
    cfg.optim.updates_per_rollout, cfg.optim.lr = args.updates, args.lr
    cfg.cold_start.band = [0.15, 1.0]
    cfg.cold_start.max_steps, cfg.cold_start.eval_every = args.cold_start_steps, 25
    if args.route_every is not None:
        cfg.metrics.route_every = args.route_every
    if args.split_rows is not None:
        cfg.metrics.split_rows = args.split_rows or None
    return cfg


def run_arm(args: argparse.Namespace, replay: str, root: Path) -> tuple[list[dict], list[dict]]:
    harness = Trainer(harness_config(args, replay, root / f"harness_{replay}"))
    steps = args.repeats + args.warmup
    # TRL draws the prompts in dataset order (shuffle_dataset=False): RL step s gets the harness's step-s prompts.
    rows = [example for s in range(1, steps + 1) for example in harness.prompts_for(s)]
    batch = args.prompts * args.group
    config = GRPOConfig(
        output_dir=str(root / f"trl_{replay}"),
        per_device_train_batch_size=batch // args.updates,
        steps_per_generation=args.updates,
        num_iterations=1,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        max_steps=steps * args.updates,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        shuffle_dataset=False,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        log_level="error",
        seed=0,
        **algo_args("grpo"),
    )
    base = GRPOTrainer if replay == "none" else MoeGRPOTrainer
    extra = {} if replay == "none" else {"routing_replay": replay}
    trainer = timed(base)(
        model=copy.deepcopy(harness.policy).train(),
        args=config,
        processing_class=harness.tokenizer,
        train_dataset=Dataset.from_list(rows),
        reward_funcs=task_reward("reversal"),
        **extra,
    )
    trainer.phases = defaultdict(float)
    callback = Interleave(args.updates, harness)
    callback.trainer = trainer
    trainer.add_callback(callback)
    trainer.train()
    return callback.trl_rows[args.warmup :], callback.harness_rows[args.warmup :]


def report(replay: str, trl_rows: list[dict], harness_rows: list[dict], args: argparse.Namespace) -> None:
    med = lambda rows, key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    h_other = [r["total"] - r["rollout"] - r["old_logp"] - r["update"] for r in harness_rows]
    t_rollout = [r["score"] - r["old_logp"] for r in trl_rows]
    t_fwd_bwd = [r["training_step"] - r["score"] for r in trl_rows]
    t_loop = [r["total"] - r["training_step"] for r in trl_rows]
    ratios = [t["total"] / h["total"] for t, h in zip(trl_rows, harness_rows)]
    trl_name = "GRPOTrainer" if replay == "none" else f"MoeGRPOTrainer({replay})"
    print(
        f"\n== replay {replay}: harness Trainer.step vs TRL {trl_name}, median seconds per RL step "
        f"over {len(ratios)} interleaved steps =="
    )
    lines = [
        ("rollout: generate + decode + rewards", med(harness_rows, "rollout"), statistics.median(t_rollout)),
        ("  of which model.generate", float("nan"), med(trl_rows, "generate")),
        ("old-logp pass", med(harness_rows, "old_logp"), med(trl_rows, "old_logp")),
        (f"{args.updates} updates: forward + backward", float("nan"), statistics.median(t_fwd_bwd)),
        (f"{args.updates} updates: optimizer + loop + logging", float("nan"), statistics.median(t_loop)),
        (
            f"{args.updates} updates, all",
            med(harness_rows, "update"),
            statistics.median(f + o for f, o in zip(t_fwd_bwd, t_loop)),
        ),
        ("other (metrics, bookkeeping)", statistics.median(h_other), 0.0),
        ("total", med(harness_rows, "total"), med(trl_rows, "total")),
    ]
    print(f"{'phase':<42}{'harness':>10}{'TRL':>10}{'TRL/harness':>13}")
    for name, h, t in lines:
        ratio = t / h if h and h == h and t == t else float("nan")
        fmt = lambda x: f"{x:10.3f}" if x == x else f"{'-':>10}"  # noqa: E731
        print(f"{name:<42}{fmt(h)}{fmt(t)}{ratio:13.2f}" if ratio == ratio else f"{name:<42}{fmt(h)}{fmt(t)}{'':>13}")
    print(
        f"time-per-step ratio TRL/harness (median of {len(ratios)} paired steps): {statistics.median(ratios):.2f}"
        f"  [min {min(ratios):.2f}, max {max(ratios):.2f}]"
    )
    every = args.route_every or TrainConfig().metrics.route_every
    routed = sum(step % every == 0 for step in range(args.warmup + 1, args.warmup + len(ratios) + 1))
    mean_ratio = sum(t["total"] for t in trl_rows) / sum(h["total"] for h in harness_rows)
    print(
        f"mean-time ratio TRL/harness over the {len(ratios)} steps: {mean_ratio:.2f}  "
        f"({routed} of them ran the route instruments, metrics.route_every={every})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--cold-start-steps", type=int, default=200)
    parser.add_argument("--arms", default="none,r2", help="comma-separated replay modes")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--route-every", type=int, default=None, help="metrics.route_every (default: the config's)")
    parser.add_argument(
        "--split-rows", type=int, default=None, help="metrics.split_rows (default: the config's; 0: all rows)"
    )
    parser.add_argument(
        "--clock",
        default="wall",
        choices=tuple(CLOCKS),
        help="wall: elapsed time; cpu: this process's CPU time (use with --threads 1 on a loaded machine)",
    )
    args = parser.parse_args(argv)  # argv: the smoke tests run main in-process at tiny sizes
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    print(
        f"qwen3_moe tiny (2 MoE layers, 8 experts, top-2), reversal task: {args.prompts} prompts x {args.group} "
        f"completions, <= {args.max_new_tokens} new tokens, {args.updates} updates per rollout; {device}, "
        f"{torch.get_num_threads()} torch threads, {args.clock} clock; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl.__version__}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for replay in args.arms.split(","):
            trl_rows, harness_rows = run_arm(args, replay, Path(tmp))
            report(replay, trl_rows, harness_rows, args)


if __name__ == "__main__":
    main()
