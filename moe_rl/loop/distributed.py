"""One run over many processes (docs/design.md §6): process group, sharding, row split, pooled metrics.

    torchrun --nproc_per_node=N experiments/train.py ...      # N processes, one training run
    python experiments/train.py -m hydra/launcher=submitit_slurm hydra.launcher.tasks_per_node=N ...
                                                               # a sweep of such runs on Slurm

Every run is a world: a plain `python experiments/train.py` run and `torchrun --nproc_per_node=1` are a
world of size 1 (no process group, no sharding, every collective the identity) and run the same code,
so they log bitwise the same metrics. In a world of W > 1 processes:
- process group: gloo on CPU, NCCL on CUDA (device `cuda:LOCAL_RANK`), with a timeout (`timeout_s`)
  so that a collective whose peer died raises instead of waiting forever;
- model: `strategy="fsdp"` (default) shards parameters, gradients and optimizer state with FSDP2
  (`fully_shard` on each decoder layer, then the root); `ddp` keeps a full replica per rank and wraps the
  training forward in DistributedDataParallel;
- rows: the P prompts of a step are split into W contiguous blocks of whole groups (W must divide P).
  A rank samples, scores, normalises advantages, runs the old pass and keeps the routes of its block only,
  so R2/R3 replay is rank-local and no route crosses ranks. Sampling draws what one process would draw
  for the whole batch (`moe_rl.rollout.sampler.GlobalRows`), so the rollouts of a config do not depend on W.
- updates: the global permutation of the P*G rows is cut into N mini-batches exactly as in one process,
  and each rank runs its own rows of each mini-batch (a rank with none runs one masked row, so that every
  rank joins the collectives). The loss is rescaled by W * n_local / n_global, so the mean of the ranks'
  gradients that FSDP/DDP compute is the gradient of the one-process loss of that mini-batch.
- metrics: each metric is a `moe_rl.metrics.partial.Partial` of this rank's rows, pooled by `merge` (sums added,
  maxima taken, rows concatenated in rank order) and finalized by the same function as in one process.
- files: rank 0 writes the run directory; every rank writes only its shard of the checkpoint
  (`torch.distributed.checkpoint`), which resumes on any world size (a world of size 1 included).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_rl.algos import get_loss
from moe_rl.metrics.partial import Partial, pool
from moe_rl.rollout.sampler import GlobalRows
from moe_rl.run.atomic import write_atomic
from moe_rl.run.folder import (
    POINTER,
    SINGLE_CHECKPOINT,
    RunWriter,
    check_identity,
    check_run_dir,
    load_checkpoint,
    save_checkpoint,
)

log = logging.getLogger(__name__)

STRATEGIES = ("fsdp", "ddp")


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


# --- the process group and the model -----------------------------------------------------------------


class Dist:
    """This process's place in the run: rank `rank` of `world_size` (1 without torchrun, or with one process)."""

    def __init__(self, strategy: str = "fsdp", timeout_s: float = 1800.0, device: str = "cpu") -> None:
        export_submitit_env()
        self.strategy = strategy
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.dummy = False  # the current mini-batch has no row on this rank: one masked row stands in
        if launched_by_torchrun():
            self.world_size = int(os.environ["WORLD_SIZE"])
        if not self.active:  # a world of size 1: nothing to shard, nothing to pool
            return
        if strategy not in STRATEGIES:
            raise ValueError(f"dist.strategy={strategy!r} is not valid; valid: {list(STRATEGIES)}")
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = str(device).startswith("cuda")
        if cuda:
            torch.cuda.set_device(self.local_rank)  # "cuda" now means this rank's device
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
            atexit.register(shutdown)  # kept across the runs of a multirun in this process
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.comm_device = torch.device("cuda", self.local_rank) if cuda else torch.device("cpu")

    @property
    def active(self) -> bool:
        """More than one process: a process group, sharded weights, pooled metrics."""
        return self.world_size > 1

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def meta(self) -> dict[str, Any]:
        """What `meta.json` records about the world (the strategy only where there is something to shard)."""
        return {"world_size": self.world_size, "strategy": self.strategy} if self.active else {"world_size": 1}

    def check(self, prompts_per_step: int, *, algo: str, agg: str, beta: float) -> None:
        """Refuse what this world cannot run exactly, before any work."""
        group_block(prompts_per_step, self.rank, self.world_size)
        if self.active and beta > 0 and get_loss(algo).seq_mean_policy and agg == "token-mean":
            raise ValueError(
                f"algo.name={algo!r} with algo.agg='token-mean' and algo.beta>0 mixes a per-sequence "
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

    @contextmanager
    def writer_first(self) -> Iterator[None]:
        """Rank 0 runs the block before the other ranks do, so they find what it wrote (the cold start's
        cache entry, which transformers' `save_pretrained` writes on torch.distributed rank 0 only)."""
        if not self.is_writer:
            self.barrier()
        yield
        if self.is_writer:
            self.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # --- rows ------------------------------------------------------------------------------------------

    def shard(self, examples: list[dict]) -> list[dict]:
        """This rank's block of whole prompts of a step (all of them in a world of size 1)."""
        return [examples[i] for i in group_block(len(examples), self.rank, self.world_size)]

    def first_row(self, prompts_per_step: int, group_size: int) -> int:
        """Global index of this rank's first rollout row."""
        return group_block(prompts_per_step, self.rank, self.world_size).start * group_size

    def batch_rows(self, prompts_per_step: int, group_size: int) -> GlobalRows:
        """Where this rank's rollout rows sit in the step's batch, for sampling as the whole batch would."""
        return GlobalRows(self.first_row(prompts_per_step, group_size), prompts_per_step * group_size, self.any)

    def any(self, flag: bool) -> bool:
        """True when `flag` is True on some rank."""
        if not self.active:
            return flag
        return bool(self._all_reduce(torch.tensor([float(flag)]), dist.ReduceOp.MAX)[0].item())

    def global_rows(self, local_count: int) -> int:
        return local_count * self.world_size

    def chunks(self, minibatches: Sequence[Tensor], first: int, count: int) -> Iterator[Tensor]:
        """This rank's local rows of each global mini-batch. A mini-batch with none of them yields local row 0
        with `self.dummy` set, so the rank still joins the forward and backward collectives at zero weight."""
        for rows in minibatches:
            mine = local_rows(rows, first, count)
            self.dummy = mine.numel() == 0
            yield mine if not self.dummy else torch.zeros(1, dtype=rows.dtype)
        self.dummy = False

    def scale_loss(self, loss: Tensor, count: float) -> Tensor:
        """`loss` times W * n_local / n_global, with `count` this rank's denominator of the loss (n_local).

        FSDP's reduce-scatter and DDP's all-reduce average the ranks' gradients; scaling each rank's loss
        by this share makes that average the gradient of the one-process loss of the global mini-batch.
        A world of size 1 returns `loss` itself.
        """
        if not self.active:
            return loss
        n = 0.0 if self.dummy else count
        total = self._all_reduce(torch.tensor([n], dtype=torch.float64), dist.ReduceOp.SUM)[0].item()
        return loss * (self.world_size * n / total if total else 0.0)

    # --- pooled metrics --------------------------------------------------------------------------------

    def merge(self, parts: Partial) -> Partial:
        """Every rank's `parts` pooled (`moe_rl.metrics.partial.pool`, rows in rank order = global row order). A rank
        whose mini-batch rows are a stand-in (`dummy`) contributes nothing. A world of size 1 returns `parts`."""
        if not self.active:
            return parts
        mine = parts.empty() if self.dummy else parts
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(
            everyone, Partial(*({k: v.cpu() for k, v in d.items()} for d in (mine.sums, mine.maxima, mine.rows)))
        )
        return pool(everyone)

    def total(self, x: Tensor) -> Tensor:
        """`x` summed over every rank (a stand-in mini-batch row adds nothing); a world of size 1 returns `x`."""
        if not self.active:
            return x
        return self._all_reduce(torch.zeros_like(x) if self.dummy else x, dist.ReduceOp.SUM)

    def _all_reduce(self, x: Tensor, op: Any) -> Tensor:
        x = x.to(self.comm_device)
        dist.all_reduce(x, op=op)
        return x.cpu()

    # --- files -----------------------------------------------------------------------------------------

    def writer(self, out_dir: str | Path, keys: dict[str, Any], *, config_hash: str) -> RunWriter:
        """Rank 0's RunWriter; other ranks get one that writes nothing."""
        cls = RunWriter if self.is_writer else SilentWriter
        return cls(out_dir, keys, config_hash=config_hash)

    def save(
        self,
        run_dir: Path,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ref: nn.Module | None,
        extra: dict[str, Any],
    ) -> None:
        """The checkpoint of `step`: model, optimizer, ref and the trainer's `extra` (plain data).

        A world of size 1 writes one file, `checkpoint.pt` (then drops a sharded checkpoint it resumed
        from). A larger world writes a sharded checkpoint (each rank its shard) at `run_dir/checkpoint-<step>`;
        rank 0 then points `checkpoint.json` at it and removes older ones. Either way a kill at any moment
        leaves a complete checkpoint.
        """
        if not self.active:
            save_checkpoint(
                run_dir / SINGLE_CHECKPOINT,
                {
                    **extra,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "ref": ref.state_dict() if ref is not None else None,
                },
            )
            _remove_sharded(run_dir)
            return
        import torch.distributed.checkpoint as dcp

        name = f"checkpoint-{step:07d}"
        dcp.save(_sharded_state(model, optimizer, ref), checkpoint_id=run_dir / name)
        if self.is_writer:
            write_atomic(run_dir / name / "trainer.pt", lambda f: torch.save(extra, f))
            doc = {
                "step": step,
                "path": name,
                "world_size": self.world_size,
                "strategy": self.strategy,
                "config_hash": extra.get("config_hash"),
                "cold_start_key": extra.get("cold_start_key"),
            }
            write_atomic(run_dir / POINTER, json.dumps(doc, indent=1))
            _remove_sharded(run_dir, keep=name)
        self.barrier()

    def load(
        self,
        run_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ref: nn.Module | None,
        *,
        config_hash: str,
        cold_start_key: str | None,
    ) -> dict[str, Any] | None:
        """Load the run's checkpoint into model, optimizer and ref; return the trainer state saved with it,
        or None when there is none. A sharded checkpoint resumes on any world size (DCP reshards, also to
        one process); a `checkpoint.pt` only in a world of size 1. A folder of another run (or a
        `checkpoint.pt` under N > 1) is refused (`check_run_dir`) before any tensor is read."""
        check_run_dir(run_dir, config_hash=config_hash, cold_start_key=cold_start_key, world_size=self.world_size)
        if (run_dir / SINGLE_CHECKPOINT).exists():  # a world of size 1 (check_run_dir refuses it to others)
            state = load_checkpoint(run_dir / SINGLE_CHECKPOINT)
            check_identity(state, run_dir / SINGLE_CHECKPOINT, config_hash=config_hash, cold_start_key=cold_start_key)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            if ref is not None and state["ref"] is not None:
                ref.load_state_dict(state["ref"])
            return state
        pointer = run_dir / POINTER
        if not pointer.exists():
            return None
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        doc = json.loads(pointer.read_text())
        if doc["world_size"] != self.world_size:
            log.info("resharding %s from %d to %d ranks", doc["path"], doc["world_size"], self.world_size)
        state = _sharded_state(model, optimizer, ref)
        dcp.load(state, checkpoint_id=run_dir / doc["path"])
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if ref is not None:
            ref.load_state_dict(state["ref"])
        return torch.load(run_dir / doc["path"] / "trainer.pt", map_location="cpu", weights_only=True)

    def remove_checkpoint(self, run_dir: Path) -> None:
        """Remove the run's checkpoint (rank 0; a finished run keeps none unless asked to)."""
        if self.is_writer:
            (run_dir / SINGLE_CHECKPOINT).unlink(missing_ok=True)
            _remove_sharded(run_dir)


def _remove_sharded(run_dir: Path, keep: str | None = None) -> None:
    """Remove the sharded checkpoint(s) of `run_dir` (all but the folder `keep`; the pointer with them)."""
    if keep is None:
        (run_dir / POINTER).unlink(missing_ok=True)
    for old in run_dir.glob("checkpoint-*"):
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, ref: nn.Module | None) -> dict[str, Any]:
    """What a sharded checkpoint holds: this rank's model and optimizer state (and the reference model)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    if ref is not None:
        state["ref"] = ref.state_dict()
    return state


def world_size_from_env() -> int:
    """The world size this process will join: torchrun's (or a submitit job's) WORLD_SIZE, else 1."""
    export_submitit_env()
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


# How long `shutdown` leaves the GIL free after destroying the process group (see there).
SHUTDOWN_GRACE_S = 0.2


def shutdown() -> None:
    """Destroy the process group at exit (registered with `atexit` by `Dist`), then sleep briefly.

    FSDP's device mesh keeps the gloo group alive past `destroy_process_group`, and one of its worker
    threads may still be freeing the last collective's work, whose tensors are Python objects: that
    needs the GIL, and a thread that asks for it once Python is finalizing is ended, which aborts the
    process ("terminate called without an active exception") after all its work was written. The sleep
    releases the GIL while atexit handlers still run, so the thread finishes first.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(SHUTDOWN_GRACE_S)


class SilentWriter(RunWriter):
    """The writer of ranks other than 0: the same interface, nothing written."""

    def __init__(self, out_dir: str | Path, keys: dict[str, Any], *, config_hash: str = "") -> None:
        self.dir, self.config_hash, self.keys = Path(out_dir), config_hash, keys
        self.parts = self.dir / "metrics"
        self.rows: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.recovered: list[dict[str, Any]] = []
        self.backends: list[Any] = []

    def write_config(self, cfg_dict: dict[str, Any]) -> None: ...

    def close_backends(self, status: str) -> None: ...

    def write_meta(self, **extra: Any) -> None: ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def flush(
        self, status: str, steps_done: int, wall_s: float, error: BaseException | None = None, reason: str | None = None
    ) -> None: ...

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


# What a collective raises when another rank's process is gone (gloo over TCP, NCCL's watchdog)
PEER_LOST_MESSAGES = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Socket Timeout",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
)


def peer_lost(err: BaseException) -> bool:
    """Whether `err` means another rank died under this one (a killed peer breaks the process group),
    so the run is interrupted and resumable like a killed `python` run, not failed by its own fault."""
    if isinstance(err, torch.distributed.DistNetworkError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in PEER_LOST_MESSAGES)
