"""One run over many processes (DESIGN §6): process group, sharding, row split, exact metric reduction.

    torchrun --nproc_per_node=N experiments/train.py ...      # N processes, one training run
    python experiments/train.py -m hydra/launcher=submitit_slurm hydra.launcher.tasks_per_node=N ...
                                                               # a sweep of such runs on Slurm

Without torchrun (no `WORLD_SIZE` in the environment) `Dist` is inactive and every method below is the
identity, so a plain `python experiments/train.py` run computes bitwise what it did before this module.

Under torchrun (any N, also 1):
- process group: gloo on CPU, NCCL on CUDA (device `cuda:LOCAL_RANK`), with a timeout (`dist.timeout_s`)
  so that a collective whose peer died raises instead of waiting forever;
- model: `dist.strategy=fsdp` (default) shards parameters, gradients and optimizer state with FSDP2
  (`fully_shard` on each decoder layer, then the root); `ddp` keeps a full replica per rank and wraps the
  training forward in DistributedDataParallel;
- rows: the P prompts of a step are split into W contiguous blocks of whole groups (W must divide P).
  A rank samples, scores, normalises advantages, runs the old pass and keeps the routes of its block only,
  so R2/R3 replay is rank-local and no route crosses ranks. Sampling is per row: global row i draws from
  its own stream keyed by (seed, step, i) (`rollout.generate(row_keys=...)`), and generation stops when
  every row of every rank has ended, so the rollouts of a config (tokens, widths, routes) do not depend on W. (A plain `python` run keeps its historical stream, one sampler for the whole batch,
  so it matches a torchrun run in distribution, not token for token.)
- updates: the global permutation of the P*G rows is cut into N mini-batches exactly as in one process,
  and each rank runs its own rows of each mini-batch (a rank with none runs one masked row, so that every
  rank joins the collectives). The loss is rescaled by W * n_local / n_global, so the mean of the ranks'
  gradients that FSDP/DDP compute is the gradient of the one-process loss of that mini-batch.
- metrics: every logged value is what one process would log for the global batch: flip rates from global
  counts, ratio variances from global sums of (r-1), (r-1)^2 and counts, maxima as global maxima, rewards
  and margins gathered in global row order (`reduce_update`, `reduce_rollout`).
- files: rank 0 writes the run directory; every rank writes only its shard of the checkpoint
  (`torch.distributed.checkpoint`), which resumes on the same or on a different world size.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import shutil
import zlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_rl.atomic import write_atomic
from moe_rl.metrics import RATIO_KEYS
from moe_rl.routing import Routes, route_overlap
from moe_rl.routing.compare import shift_summary
from moe_rl.runio import RunWriter

log = logging.getLogger(__name__)

STRATEGIES = ("fsdp", "ddp")
COUNT_PREFIX = "route/flip_vs_margin/"  # per-update counts (train.COUNT_PREFIX): summed across ranks
POINTER = "checkpoint.json"  # names the last complete sharded checkpoint (written last, atomically)


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def export_submitit_env() -> None:
    """Inside a submitit job of several tasks (Hydra's submitit launcher with `tasks_per_node` > 1 or
    `nodes` > 1, on Slurm or with the local executor) each task is one rank: set the variables torchrun
    would set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) from the job's environment."""
    if launched_by_torchrun() or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    import submitit
    from submitit.helpers import TorchDistributedEnvironment

    if submitit.JobEnvironment().num_tasks > 1:
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)  # LOCAL_RANK picks the GPU


# --- pure helpers: which rows a rank owns, loss weights, sufficient statistics ------------------------


def group_block(num_groups: int, rank: int, world_size: int) -> range:
    """The contiguous block of whole prompt groups owned by `rank` (W must divide the group count)."""
    if num_groups % world_size:
        raise ValueError(f"rollout.prompts_per_step={num_groups} must be divisible by the world size {world_size}")
    per = num_groups // world_size
    return range(rank * per, (rank + 1) * per)


def local_rows(rows: Tensor, first: int, count: int) -> Tensor:
    """Global row ids `rows` owned by the rank holding rows [first, first+count), as local ids, in order."""
    mine = (rows >= first) & (rows < first + count)
    return rows[mine] - first


def loss_counts(algo: str, agg: str, mask: Tensor) -> dict[str, float]:
    """Denominators of the loss terms and clip fractions (`moe_rl.algos.losses`) on these rows.

    policy: GRPO aggregates tokens by `agg`; GSPO and GSPO-token are means over non-empty sequences.
    kl: by `agg`. clip: GSPO counts sequences, the token-level losses count tokens.
    """
    mask = mask.bool()
    tokens, seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    by_agg = tokens if agg == "token-mean" else seqs
    return {"policy": by_agg if algo == "grpo" else seqs, "kl": by_agg, "clip": seqs if algo == "gspo" else tokens,
            "tokens": tokens}


@torch.no_grad()
def ratio_sums(logp: Tensor, old_logp: Tensor, mask: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(sums, maxima) from which `ratio_from_sums` gives `moe_rl.metrics.ratio_stats` of the union of rows.

    Sums of r-1 and (r-1)^2 rather than r and r^2: the variance is then a difference of small numbers
    (no cancellation at r ~ 1) and exactly 0 where every r is exactly 1.
    """
    mask = mask.bool()
    delta = torch.where(mask, logp.double() - old_logp.double(), 0.0)  # (B, T)
    d = delta[mask]
    r1 = torch.expm1(d)  # r - 1
    seq_len = mask.sum(-1)
    nonempty = seq_len > 0
    s1 = torch.expm1(delta.sum(-1)[nonempty] / seq_len[nonempty])  # s_i - 1
    sums = {
        "n": torch.tensor(float(d.numel()), dtype=torch.float64), "r1": r1.sum(), "r1sq": (r1**2).sum(),
        "extreme": (d.abs() > math.log(2.0)).double().sum(), "k3": (torch.exp(-d) - 1.0 + d).sum(),
        "n_seq": nonempty.double().sum(), "s1": s1.sum(), "s1sq": (s1**2).sum(),
    }
    maxima = {"r": torch.exp(d).max() if d.numel() else torch.tensor(-math.inf, dtype=torch.float64)}
    return sums, maxima


def ratio_from_sums(sums: dict[str, float], maxima: dict[str, float]) -> dict[str, float]:
    """RATIO_KEYS from global sums: var = E[(r-1)^2] - E[r-1]^2, ess = (sum r)^2 / (N sum r^2)."""
    n, n_seq = sums["n"], sums["n_seq"]
    if not n:
        return {k: math.nan for k in RATIO_KEYS}
    mean1 = sums["r1"] / n
    sum_r, sum_r2 = sums["r1"] + n, sums["r1sq"] + 2 * sums["r1"] + n
    seq_mean1 = sums["s1"] / n_seq if n_seq else math.nan
    return {
        "ratio/token_var": max(sums["r1sq"] / n - mean1**2, 0.0),
        "ratio/token_max": maxima["r"],
        "ratio/seq_var": max(sums["s1sq"] / n_seq - seq_mean1**2, 0.0) if n_seq else math.nan,
        "ratio/ess": sum_r**2 / (n * sum_r2),
        "ratio/extreme_frac": sums["extreme"] / n,
        "kl/k3": sums["k3"] / n,
    }


@torch.no_grad()
def route_counts(a: Routes, b: Routes) -> dict[str, Tensor]:
    """Counts behind `compare_routes(a, b)`: valid positions, flips and missed experts per layer, token flips."""
    overlap = route_overlap(a, b)  # (B, T, L)
    valid = (a.mask & b.mask.to(a.mask.device)).unsqueeze(-1)  # (B, T, 1)
    flipped = (overlap < a.top_k) & valid
    return {
        "n": valid.sum().double(), "flips": flipped.sum(dim=(0, 1)).double(),  # (L,)
        "missed": ((a.top_k - overlap) * valid).sum(dim=(0, 1)).double(),  # (L,) k - |S_a ∩ S_b|
        "token_flips": flipped.any(-1).sum().double(),
    }


def route_from_counts(counts: dict[str, Any], top_k: int) -> dict[str, float]:
    """`compare_routes` keys from global counts (NaN when no position is valid)."""
    n, flips, missed = counts["n"], list(counts["flips"]), list(counts["missed"])
    per_flip = [f / n if n else math.nan for f in flips]
    per_expert = [m / (top_k * n) if n else math.nan for m in missed]
    out = {"flip_rate": sum(per_flip) / len(per_flip), "expert_flip_frac": sum(per_expert) / len(per_expert),
           "token_flip_rate": counts["token_flips"] / n if n else math.nan}
    for i, (f, e) in enumerate(zip(per_flip, per_expert)):
        out[f"flip_rate/layer_{i}"] = f
        out[f"expert_flip_frac/layer_{i}"] = e
    return out


@torch.no_grad()
def position_sums(a: Routes, b: Routes, response_mask: Tensor, start: int, bucket: int, buckets: int) -> Tensor:
    """(buckets, 2): sum of the per-position fraction of flipped layers and the count of valid response
    positions, per bucket of `bucket` positions counted from `start` (as `train.flip_by_position`)."""
    flipped = (route_overlap(a, b) < a.top_k).double().mean(-1)  # (B, T)
    valid = response_mask.bool() & a.mask & b.mask.to(a.mask.device)
    out = torch.zeros(buckets, 2, dtype=torch.float64)
    for j in range(buckets):
        cols = slice(start + j * bucket, start + (j + 1) * bucket)
        out[j, 0] = (flipped[:, cols] * valid[:, cols]).sum()
        out[j, 1] = valid[:, cols].sum()
    return out


# --- the process group and the model -----------------------------------------------------------------


class Dist:
    """This process's place in the run; inactive (every call the identity) without torchrun."""

    def __init__(self, strategy: str = "fsdp", timeout_s: float = 1800.0, device: str = "cpu") -> None:
        export_submitit_env()
        self.active = launched_by_torchrun()
        self.strategy = strategy
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.dummy = False  # the current mini-batch has no row on this rank: one masked row stands in
        self._warned: set[str] = set()
        if not self.active:
            return
        if strategy not in STRATEGIES:
            raise ValueError(f"dist.strategy={strategy!r} is not valid; valid: {list(STRATEGIES)}")
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = str(device).startswith("cuda")
        if cuda:
            torch.cuda.set_device(self.local_rank)  # "cuda" now means this rank's device
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
            atexit.register(_destroy)  # kept across the runs of a multirun in this process
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.comm_device = torch.device("cuda", self.local_rank) if cuda else torch.device("cpu")

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def meta(self) -> dict[str, Any]:
        """What `meta.json` records about a torchrun launch (nothing for a plain run)."""
        return {"world_size": self.world_size, "strategy": self.strategy} if self.active else {}

    def check(self, cfg: Any) -> None:
        """Refuse configs this launch cannot run exactly, before any work."""
        if not self.active:
            return
        group_block(cfg.rollout.prompts_per_step, self.rank, self.world_size)
        if cfg.algo.beta > 0 and cfg.algo.name != "grpo" and cfg.algo.agg == "token-mean":
            raise ValueError(
                f"algo.name={cfg.algo.name!r} with algo.agg='token-mean' and algo.beta>0 mixes a per-sequence "
                "policy term with a per-token KL term; one loss scale cannot make it exact across ranks. "
                "Use algo.agg=seq-mean-token-mean"
            )

    def wrap(self, model: nn.Module) -> nn.Module:
        """Shard `model` in place (fsdp) and return the module the training forward should call.

        fsdp: `fully_shard` on each decoder layer, then the root; the model itself is that module.
        ddp: a DistributedDataParallel wrapper; generation and no-grad passes use the bare model.
        """
        if not self.active:
            return model
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.local_rank] if self.comm_device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
        from torch.distributed.fsdp import fully_shard

        layers = decoder_layers(model)
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """Unsharded parameters on every rank (e.g. to refresh a rollout copy in another dtype)."""
        if not self.active or self.strategy == "ddp":
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # --- rows ------------------------------------------------------------------------------------------

    def shard(self, examples: list[dict]) -> list[dict]:
        """This rank's block of whole prompts of a step."""
        if not self.active:
            return examples
        return [examples[i] for i in group_block(len(examples), self.rank, self.world_size)]

    def first_row(self, prompts_per_step: int, group_size: int) -> int:
        """Global index of this rank's first rollout row."""
        if not self.active:
            return 0
        return group_block(prompts_per_step, self.rank, self.world_size).start * group_size

    def row_keys(self, seed: int, step: int, prompts_per_step: int, group_size: int) -> list[tuple[int, ...]] | None:
        """Sampling-stream keys (seed, step, global row) of this rank's rows; None: one stream for the batch."""
        if not self.active:
            return None
        first = self.first_row(prompts_per_step, group_size)
        count = prompts_per_step // self.world_size * group_size
        return [(seed, step, first + i) for i in range(count)]

    def global_rows(self, local_count: int) -> int:
        return local_count * self.world_size

    def chunks(self, minibatches: Sequence[Tensor], first: int, count: int) -> Iterator[Tensor]:
        """This rank's local rows of each global mini-batch. A mini-batch with none of them yields local row 0
        with `self.dummy` set, so the rank still joins the forward and backward collectives at zero weight."""
        if not self.active:
            yield from minibatches
            return
        for rows in minibatches:
            mine = local_rows(rows, first, count)
            self.dummy = mine.numel() == 0
            yield mine if not self.dummy else torch.zeros(1, dtype=rows.dtype)
        self.dummy = False

    def loss_share(self, algo: str, agg: str, mask: Tensor) -> float | None:
        """W * n_local / n_global for the policy term's denominator (None: not distributed).

        FSDP's reduce-scatter and DDP's all-reduce average the ranks' gradients; scaling each rank's loss
        by this share makes that average the gradient of the one-process loss of the global mini-batch.
        """
        if not self.active:
            return None
        n = 0.0 if self.dummy else loss_counts(algo, agg, mask)["policy"]
        total = self._all_reduce(torch.tensor([n], dtype=torch.float64), dist.ReduceOp.SUM)[0].item()
        return self.world_size * n / total if total else 0.0

    # --- exact metric reduction ------------------------------------------------------------------------

    def _all_reduce(self, x: Tensor, op: Any) -> Tensor:
        x = x.to(self.comm_device)
        dist.all_reduce(x, op=op)
        return x.cpu()

    def _gather(self, x: Tensor) -> Tensor:
        """Concatenation in rank order (= global row order) of every rank's 1-D `x` (lengths may differ)."""
        x = x.reshape(-1).to(self.comm_device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.comm_device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([x.numel()], device=self.comm_device))
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=x.dtype, device=self.comm_device)
        padded[: x.numel()] = x
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)]).cpu()

    def _reduce(self, sums: dict[str, Tensor], maxima: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Global sums and maxima of named tensors, in two collectives. Every rank must pass the same
        names and shapes; a mismatch (which would pair unrelated numbers) raises on every rank."""
        names = sorted(sums), sorted(maxima)
        key = zlib.crc32(json.dumps([[(k, list(sums[k].shape)) for k in names[0]], names[1]]).encode())
        flat_sum = torch.cat([sums[k].double().reshape(-1).cpu() for k in names[0]] or [torch.zeros(0)])
        flat_max = torch.cat([torch.tensor([key, -key], dtype=torch.float64)]
                             + [maxima[k].double().reshape(-1).cpu() for k in names[1]])
        flat_sum = self._all_reduce(flat_sum, dist.ReduceOp.SUM)
        flat_max = self._all_reduce(flat_max, dist.ReduceOp.MAX)
        if flat_max[0].item() != -flat_max[1].item():
            raise RuntimeError("ranks reduce different metric sets; every rank must log the same keys")
        out_sum, out_max, i = {}, {}, 0
        for k in names[0]:
            n = sums[k].numel()
            values = flat_sum[i : i + n].tolist()
            out_sum[k] = values if sums[k].dim() else values[0]
            i += n
        for k, value in zip(names[1], flat_max[2:].tolist()):
            out_max[k] = value
        return out_sum, out_max

    def _weight(self) -> float:
        return 0.0 if self.dummy else 1.0

    def reduce_update(
        self, metrics: dict[str, float], *, algo: str, agg: str, logp: Tensor, old_logp: Tensor, mask: Tensor,
        routes: dict[str, tuple[Routes, Routes]], positions: tuple[Routes, Routes, int, int, int],
        shift: Tensor | None = None,
    ) -> dict[str, float]:
        """The metrics of one update over the global mini-batch, from this rank's `metrics` and tensors.

        Ratio statistics come from sums, route metrics of each pair in `routes` (`route/<pair>/...`) and the
        per-position flips (`positions` = (native, old, start, bucket, buckets)) from counts, the
        flip-vs-margin counts summed, the router shift (`shift`: this rank's `router_shift_gaps`) from all
        ranks' gaps in row order; loss terms, clip fractions and entropy are means weighted by their
        denominators; `optim/grad_norm` is already global. A key with no declared rule is averaged over
        valid response tokens, with a warning.
        """
        if not self.active:
            return metrics
        w = self._weight()
        counts = loss_counts(algo, agg, mask)
        weights = {"loss": counts["policy"], "loss/policy": counts["policy"], "kl/ref_k3": counts["kl"],
                   "ratio/clipfrac_low": counts["clip"], "ratio/clipfrac_high": counts["clip"],
                   "policy/entropy": counts["tokens"]}
        sums: dict[str, Tensor] = {}
        maxima: dict[str, Tensor] = {}
        r_sums, r_max = ratio_sums(logp, old_logp, mask)
        sums.update({f"ratio.{k}": v * w for k, v in r_sums.items()})
        maxima.update({f"ratio.{k}": v if w else torch.tensor(-math.inf) for k, v in r_max.items()})
        for pair, (a, b) in routes.items():
            sums.update({f"route.{pair}.{k}": v * w for k, v in route_counts(a, b).items()})
        native, old, start, bucket, buckets = positions
        sums["positions"] = position_sums(native, old, mask, start, bucket, buckets) * w
        exact = {"optim/grad_norm"} | set(RATIO_KEYS) | {k for k in metrics if k.startswith("route/")}
        for key, value in metrics.items():
            if key.startswith(COUNT_PREFIX):
                sums[f"count.{key}"] = torch.tensor(value * w, dtype=torch.float64)
            if key in exact:
                continue
            if key not in weights and key not in self._warned:
                self._warned.add(key)
                log.warning("metric %r has no exact reduction across ranks; averaging it over tokens", key)
            n = weights.get(key, counts["tokens"]) * w
            value = 0.0 if not n else value  # NaN of an empty rank must not reach the sum
            sums[f"mean.{key}"] = torch.tensor([value * n, n], dtype=torch.float64)
        total, top = self._reduce(sums, maxima)
        out = {k: v for k, v in metrics.items() if k == "optim/grad_norm"}
        out.update({k[6:]: v for k, v in total.items() if k.startswith("count.")})
        if shift is not None:
            gaps = self._gather(shift.double() if w else shift.new_zeros(0, shift.shape[1]).double())
            summary = shift_summary(gaps.view(-1, shift.shape[1]))
            out.update({f"route/old_vs_new/{k}": v for k, v in summary.items()})
        for key in metrics:
            if f"mean.{key}" in total:
                s, n = total[f"mean.{key}"]
                out[key] = s / n if n else math.nan
        out.update(ratio_from_sums({k[6:]: v for k, v in total.items() if k.startswith("ratio.")},
                                   {k[6:]: v for k, v in top.items() if k.startswith("ratio.")}))
        for pair, (a, _) in routes.items():
            counts_pair = {k.split(".")[-1]: v for k, v in total.items() if k.startswith(f"route.{pair}.")}
            values = {f"route/{pair}/{k}": v for k, v in route_from_counts(counts_pair, a.top_k).items()}
            out.update({k: v for k, v in values.items() if k in metrics})
        for j, (flips, n) in enumerate(total["positions"][i : i + 2] for i in range(0, 2 * buckets, 2)):
            if n:
                out[f"route/old_vs_new/flip_rate/pos_{j * bucket}"] = flips / n
        return out

    def reduce_rollout(
        self, metrics: dict[str, float], *, rewards: Tensor, response_mask: Tensor, logp_gap: Tensor,
        margins: Tensor, margin_mask: Tensor, rollout_vs_old: tuple[Routes, Routes] | None, group_size: int = 1,
    ) -> dict[str, float]:
        """Step-level values over all ranks' rows: rewards and margins gathered in global row order,
        `rollout/*` from sums, `route/rollout_vs_old/*` from counts, `time/*` as the slowest rank's."""
        if not self.active:
            return metrics
        from moe_rl.metrics import margin_stats

        out = dict(metrics)
        all_rewards = self._gather(rewards.double()).to(rewards.dtype)
        out["reward/mean"] = all_rewards.mean().item()
        out["reward/std"] = all_rewards.std(unbiased=False).item()
        if "reward/zero_var_group_frac" in metrics:
            from moe_rl.tasks.rewards import zero_variance_frac

            out["reward/zero_var_group_frac"] = zero_variance_frac(all_rewards, group_size)
        values = margins[margin_mask.to(margins.device)].float()  # (n, L) in row order
        gathered = self._gather(values).view(-1, margins.shape[-1])
        out.update(margin_stats(gathered.unsqueeze(0), torch.ones(1, gathered.shape[0], dtype=torch.bool)))
        mask = response_mask.bool()
        gap = logp_gap.abs().double()
        sums = {"gap": (gap * mask).sum(), "tokens": mask.sum().double(), "mult": (gap.exp() * mask).sum(),
                "over_ln2": ((gap > math.log(2)) & mask).sum().double(),
                "rows": torch.tensor(float(mask.shape[0]), dtype=torch.float64)}
        if rollout_vs_old is not None:
            sums.update({f"route.{k}": v for k, v in route_counts(*rollout_vs_old).items()})
        if "reward/errors" in metrics:
            sums["errors"] = torch.tensor(metrics["reward/errors"], dtype=torch.float64)
        times = {k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items() if k.startswith("time/")}
        total, top = self._reduce(sums, times)
        out["rollout/logp_gap"] = total["gap"] / max(total["tokens"], 1.0)
        out["rollout/token_mult_prob_error"] = total["mult"] / total["tokens"] if total["tokens"] else 1.0
        out["rollout/logp_gap_over_ln2"] = total["over_ln2"] / max(total["tokens"], 1.0)
        out["rollout/response_len"] = total["tokens"] / total["rows"]
        if "errors" in total:
            out["reward/errors"] = total["errors"]
        if rollout_vs_old is not None:
            counts = {k[6:]: v for k, v in total.items() if k.startswith("route.")}
            out.update(
                {f"route/rollout_vs_old/{k}": v for k, v in route_from_counts(counts, rollout_vs_old[0].top_k).items()}
            )
        out.update(top)
        return out

    # --- files -----------------------------------------------------------------------------------------

    def writer(self, out_dir: str | Path, keys: dict[str, Any], *, config_hash: str) -> RunWriter:
        """Rank 0's RunWriter; other ranks get one that writes nothing."""
        cls = RunWriter if self.is_writer else SilentWriter
        return cls(out_dir, keys, config_hash=config_hash)

    def save(self, run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             ref: nn.Module | None, extra: dict[str, Any]) -> None:
        """A sharded checkpoint (each rank writes its shard) at `run_dir/checkpoint-<step>`; rank 0 then
        points `checkpoint.json` at it and removes older ones, so a kill at any moment leaves a complete one."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        name = f"checkpoint-{step:07d}"
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        if ref is not None:
            state["ref"] = ref.state_dict()
        dcp.save(state, checkpoint_id=run_dir / name)
        if self.is_writer:
            write_atomic(run_dir / name / "trainer.pt", lambda f: torch.save(extra, f))
            doc = {"step": step, "path": name, "world_size": self.world_size, "strategy": self.strategy,
                   "config_hash": extra.get("config_hash"), "cold_start_key": extra.get("cold_start_key")}
            write_atomic(run_dir / POINTER, json.dumps(doc, indent=1))
            for old in run_dir.glob("checkpoint-*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)
        self.barrier()

    def load(self, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ref: nn.Module | None, *,
             config_hash: str, cold_start_key: str | None) -> dict[str, Any] | None:
        """Load the checkpoint `checkpoint.json` names into model, optimizer and ref (resharding to this
        world size); return the trainer state saved with it, or None when there is none. The pointer is
        checked before any tensor is read."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if (run_dir / "checkpoint.pt").exists():
            raise ValueError(f"{run_dir} holds a single-process checkpoint (checkpoint.pt); resume it with plain "
                             "python, or use another output directory for the torchrun launch")
        pointer = run_dir / POINTER
        if not pointer.exists():
            return None
        doc = json.loads(pointer.read_text())
        if doc.get("config_hash") != config_hash:
            raise ValueError(f"{pointer} belongs to a run with another config; use another output directory "
                             "or delete this one")
        if doc.get("cold_start_key") != cold_start_key:
            raise ValueError(f"{pointer} was trained from another cold start; delete the run to rerun")
        if doc["world_size"] != self.world_size:
            log.info("resharding %s from %d to %d ranks", doc["path"], doc["world_size"], self.world_size)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        if ref is not None:
            state["ref"] = ref.state_dict()
        dcp.load(state, checkpoint_id=run_dir / doc["path"])
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if ref is not None:
            ref.load_state_dict(state["ref"])
        return torch.load(run_dir / doc["path"] / "trainer.pt", map_location="cpu", weights_only=True)

    def remove_checkpoint(self, run_dir: Path) -> None:
        if self.active and self.is_writer:
            (run_dir / POINTER).unlink(missing_ok=True)
            for old in run_dir.glob("checkpoint-*"):
                shutil.rmtree(old, ignore_errors=True)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def refuse_sharded_checkpoint(run_dir: Path) -> None:
    """A plain `python` run must not restart (and truncate) a directory that torchrun checkpointed."""
    if (Path(run_dir) / POINTER).exists():
        raise ValueError(f"{run_dir} holds a sharded checkpoint of a torchrun launch ({POINTER}); resume it with "
                         "torchrun --nproc_per_node=N experiments/train.py ... (any N that divides the prompts)")


class SilentWriter(RunWriter):
    """The writer of ranks other than 0: the same interface, nothing written."""

    def __init__(self, out_dir: str | Path, keys: dict[str, Any], *, config_hash: str = "") -> None:
        self.dir, self.config_hash, self.keys = Path(out_dir), config_hash, keys
        self.parts = self.dir / "metrics"
        self.rows: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.backends: list[Any] = []

    def write_config(self, cfg_dict: dict[str, Any]) -> None: ...

    def close_backends(self, status: str) -> None: ...

    def write_meta(self, **extra: Any) -> None: ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def flush(self, status: str, steps_done: int, wall_s: float, error: BaseException | None = None) -> None: ...

    def truncate_after(self, step: int) -> None: ...

    def history(self, keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
        # rank 0 reads the parts and broadcasts them; reading here would race its truncate_after's unlinks
        return {k: [] for k in keys}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers FSDP2 shards one by one (transformers' `model.model.layers`)."""
    for path in ("model.layers", "layers", "transformer.h"):
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList) and len(layers):
            return list(layers)
    raise ValueError(f"{type(model).__name__}: no decoder layer list (model.layers) to shard with FSDP2")
