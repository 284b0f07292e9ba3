"""What the loop sets up around the policy for RL: the router knobs on the cold start's model, the
optimizer over its parameter groups with the learning-rate schedule, and the updates' forward with the
router loss terms. Every piece is the loop's plain behaviour at the defaults (bitwise: one AdamW group,
the plain teacher-forced forward, no extra term); the knobs are `model.router_frozen`,
`model.router_dtype`, `optim.router_lr_scale`, `optim.expert_lr_scale`, `optim.mlp_lr_scale` (moe_rl.models.knobs),
`optim.name` and `optim.eps` (moe_rl.algos.optimizers),
`algo.aux_loss_coef` and `algo.router_z_loss_coef` (moe_rl.algos.router_losses).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from moe_rl.algos.losses import LossMetrics
from moe_rl.algos.optimizers import get_optimizer
from moe_rl.algos.router_losses import add_router_terms
from moe_rl.config import AlgoConfig, ModelConfig, OptimConfig
from moe_rl.loop.expert_step import ExpertStep
from moe_rl.models.knobs import expert_weights, freeze_routers, param_groups, router_parameters, set_router_dtype
from moe_rl.rollout.generate import Rollout, RouterForward, forward_logp, forward_logp_router


class Forward(Protocol):
    """`forward_logp`'s signature; `forward_logp_router` returns a `RouterForward` whose first two are the same."""

    def __call__(
        self, model: PreTrainedModel, rollout: Rollout, rows: slice | Tensor | None = None, *, temperature: float = 1.0
    ) -> tuple[Tensor, Tensor] | RouterForward: ...


def set_router_knobs(model: nn.Module, cfg: ModelConfig, *, fsdp: bool = False) -> None:
    """`model.router_dtype`, then `model.router_frozen`, on the cold start's model, before anything copies
    or wraps it (the rollout and reference copies, DDP/FSDP, which register the parameters that train).
    `fsdp`: the model will be sharded by FSDP2, which holds a decoder layer's parameters in one dtype, so a
    float64 router is refused there (DDP keeps each parameter as it is)."""
    if fsdp and cfg.router_dtype != "float32":
        raise ValueError(
            f"model.router_dtype={cfg.router_dtype} under dist.strategy=fsdp: FSDP2 shards each decoder layer's "
            "parameters in one dtype, and the router's would differ from the rest; use dist.strategy=ddp"
        )
    set_router_dtype(model, cfg.router_dtype)
    if cfg.router_frozen:
        freeze_routers(model)


def build_optimizer(
    model: nn.Module, cfg: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, ExpertStep]:
    """`optim.name` (AdamW with betas (0.9, 0.99) and `optim.eps`, or sign-SGD) over `param_groups` (one group
    unless a `optim.*_lr_scale` says otherwise), the linear warm-up over `optim.warmup_updates` updates, which
    scales every group's learning rate alike, and `optim.expert_step` (moe_rl.loop.expert_step)."""
    scales = dict(router_lr_scale=cfg.router_lr_scale, expert_lr_scale=cfg.expert_lr_scale)
    groups = param_groups(model, cfg.lr, **scales, mlp_lr_scale=cfg.mlp_lr_scale)
    optimizer = get_optimizer(cfg.name)(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.eps)
    warmup = cfg.warmup_updates
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler, ExpertStep(model, cfg.expert_step, experts_snapshot)  # + the experts' activity


def update_forward(cfg: AlgoConfig) -> Forward:
    """The updates' teacher-forced pass: `forward_logp`, or `forward_logp_router` (also the router logits
    and the family's load-balancing loss) when a router loss term is on."""
    return forward_logp_router if cfg.aux_loss_coef > 0 or cfg.router_z_loss_coef > 0 else forward_logp


def with_router_terms(
    loss: Tensor, metrics: LossMetrics, forward: tuple[Tensor, Tensor] | RouterForward, cfg: AlgoConfig
) -> tuple[Tensor, LossMetrics]:
    """`loss` and `metrics` with the router loss terms of `forward` added (`add_router_terms`); unchanged,
    the same objects, when the forward was the plain one (no term on)."""
    if not isinstance(forward, RouterForward):
        return loss, metrics
    return add_router_terms(
        loss,
        metrics,
        mask=forward.mask,
        aux_loss=forward.aux_loss,
        router_logits=forward.router_logits,
        aux_coef=cfg.aux_loss_coef,
        z_coef=cfg.router_z_loss_coef,
    )


# --- what the step's optimizer instruments read --------------------------------------------------------


def full(p: Tensor) -> Tensor:
    """A parameter whole: an FSDP2 shard gathered (`DTensor.full_tensor`, a collective every rank joins)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def routers(model: nn.Module) -> list[nn.Parameter]:
    """The router weights (none for a dense model or a family whose routers the knobs cannot find)."""
    try:
        return router_parameters(model)
    except ValueError:
        return []


def experts_snapshot(model: nn.Module) -> list[Tensor] | None:
    """Copies of every MoE layer's expert weights, one row per expert, made whole (`optim/expert_step`'s
    before and after); None for a dense model or experts `expert_weights` cannot stack."""
    try:
        return expert_weights(model, full)
    except ValueError:
        return None
