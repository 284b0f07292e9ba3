"""Router loss terms added to the policy loss: the family's load-balancing loss and ST-MoE's router z-loss.

Both are off by default (the harness's runs train the router by the policy gradient alone); frameworks
differ here: NeMo-RL turns the load-balancing loss off for GRPO, TRL turns it on at 0.001.

- `algo.aux_loss_coef` x the family's own load-balancing loss (Switch Transformer, arXiv 2101.03961,
  eqs. 4-6), as transformers computes it: the `aux_loss` a family's ForCausalLM returns when called
  with `output_router_logits=True`, over the tokens its attention mask keeps (pads do not count). No copy
  of it lives here.
- `algo.router_z_loss_coef` x ST-MoE's router z-loss (arXiv 2202.08906, eq. 5): the mean over valid
  tokens and MoE layers of `logsumexp(router logits)^2`, which keeps the router logits small (ST-MoE
  uses 1e-3).

Both are computed on the rows of the update (all tokens the attention mask keeps: prompt and completion)
and logged, unscaled, as `loss/aux` and `loss/router_z`; `loss` is the sum that is minimised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moe_rl.algos.losses import LossMetrics
from moe_rl.metrics.names import LOSS_AUX, LOSS_ROUTER_Z


def router_z_loss(router_logits: Sequence[Tensor], mask: Tensor) -> Tensor:
    """ST-MoE's router z-loss (arXiv 2202.08906, eq. 5): mean over valid tokens and MoE layers of
    `logsumexp_e(logits[t, e])^2`.

    router_logits: one (B*T, E) tensor per MoE layer, rows batch-major (b * T + t), as transformers'
    `output_router_logits` returns them; mask (B, T), nonzero on valid tokens. Computed in the logits'
    dtype; 0 when no token is valid.
    """
    if not router_logits:
        raise ValueError("router_z_loss needs the router logits of at least one MoE layer")
    valid = mask.reshape(-1).bool()
    total = torch.zeros((), dtype=router_logits[0].dtype, device=router_logits[0].device)
    for logits in router_logits:
        if logits.shape[0] != valid.numel():
            raise ValueError(f"router logits have {logits.shape[0]} rows, the mask {valid.numel()} tokens")
        z = torch.logsumexp(logits, dim=-1)
        total = (
            total + torch.where(valid.to(z.device), z.square(), torch.zeros((), dtype=z.dtype, device=z.device)).sum()
        )
    count = valid.sum() * len(router_logits)
    return total / count.clamp(min=1).to(total.device)


def add_router_terms(
    loss: Tensor,
    metrics: LossMetrics,
    *,
    mask: Tensor,
    aux_loss: Tensor | None,
    router_logits: Sequence[Tensor] | None,
    aux_coef: float,
    z_coef: float,
) -> tuple[Tensor, LossMetrics]:
    """`loss` plus `aux_coef` x the family's load-balancing loss `aux_loss` and `z_coef` x the router z-loss
    of `router_logits` (each only where its coefficient is > 0), and `metrics` with `loss/aux` and
    `loss/router_z` (unscaled), each weighed by the valid tokens of `mask` (B, T).

    Raises ValueError when a term is asked for and the forward did not return its input (a family whose
    ForCausalLM has no load-balancing loss, or no router logits)."""
    values, weights = dict(metrics), dict(metrics.weights)
    tokens = float(mask.sum())
    if aux_coef > 0:
        if aux_loss is None or not isinstance(aux_loss, Tensor):
            raise ValueError("algo.aux_loss_coef > 0, but the model returned no load-balancing loss (aux_loss)")
        loss = loss + aux_coef * aux_loss.to(loss)
        values[LOSS_AUX], weights[LOSS_AUX] = float(aux_loss.detach()), tokens
    if z_coef > 0:
        if not router_logits:
            raise ValueError("algo.router_z_loss_coef > 0, but the model returned no router logits")
        z = router_z_loss(router_logits, mask)
        loss = loss + z_coef * z.to(loss)
        values[LOSS_ROUTER_Z], weights[LOSS_ROUTER_Z] = float(z.detach()), tokens
    return loss, LossMetrics(values, weights, metrics.clipped)
