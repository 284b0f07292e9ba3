"""The RL updates' optimizers (`optim.name`) and the load-aware expert step's scale (`optim.expert_step`).

- `adamw`: torch's AdamW, betas (0.9, 0.99), `eps` exposed (`optim.eps`; 1e-8, torch's default, is the loop's
  optimizer bit for bit), its multi-tensor (`foreach`) implementation where every parameter is float32 or float64:
  on CPU the same numbers as the per-tensor loop torch picks there by default, bit for bit (tested), in 0.58x its
  time for the default model (in bfloat16 the two round differently, so there torch's default stays). An expert
  that gets gradient on a share p of the updates keeps a second moment near p g^2, so on the updates it is used
  it moves about 1/sqrt(p) as far as a busy one; a larger eps (1e-6, 1e-5) bounds that step where sqrt(v) is
  small and makes rarely used experts SGD-like.
- `sign`: sign-SGD with decoupled weight decay, stateless, as prime-rl ships it for MoE RL
  (`prime_rl/trainer/optim/sign_sgd.py`, read to confirm the rule): `w <- w - lr wd w - lr sign(g)`, AdamW
  with beta1 = beta2 = 0 and eps -> 0. Every coordinate with a gradient moves by lr, whatever its expert's load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

BETAS = (0.9, 0.99)


class SignSGD(torch.optim.Optimizer):
    """`w <- w - lr * wd * w - lr * sign(g)` per parameter with a gradient (a zero gradient moves only by the
    decay); no state, so a checkpoint holds nothing of it."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"sign-SGD needs lr >= 0 and weight_decay >= 0, got {lr} and {weight_decay}")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if decay:
                    p.add_(p, alpha=-lr * decay)  # decoupled: a subtraction, so fp32 keeps a tiny decay
                p.add_(torch.sign(p.grad), alpha=-lr)
        return loss


def adamw(groups: list[dict[str, Any]], *, lr: float, weight_decay: float, eps: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        groups, lr=lr, weight_decay=weight_decay, betas=BETAS, eps=eps, foreach=exact_foreach(groups)
    )


def exact_foreach(groups: Iterable[Any]) -> bool | None:
    """True (AdamW's foreach implementation, bitwise its per-tensor loop) where every parameter of `groups` (dicts
    with "params", or parameters) is float32 or float64; None (torch's default) otherwise."""
    params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    return True if all(p.dtype in (torch.float32, torch.float64) for p in params) else None


def sign(groups: list[dict[str, Any]], *, lr: float, weight_decay: float, eps: float) -> torch.optim.Optimizer:
    return SignSGD(groups, lr=lr, weight_decay=weight_decay)  # eps: none (a sign has no denominator)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"adamw": adamw, "sign": sign}


def get_optimizer(name: str) -> Callable[..., torch.optim.Optimizer]:
    """The optimizer builder registered under `name`: `(groups, *, lr, weight_decay, eps) -> Optimizer`."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


EXPERT_STEPS = ("plain", "load_aware")  # optim.expert_step: the optimizer's own step, or scaled by load


def check_optim(name: str, expert_step: str, **values: float) -> None:
    """`optim.name` and `optim.expert_step` among the valid ones, and `values` (the other `optim.*` keys by name)
    in range: `lr`, `eps` and each `*_lr_scale` > 0 (model.router_frozen=true, not a scale of 0, freezes the
    routers), `warmup_updates` >= 0."""
    for key, value, valid in (("optim.name", name, OPTIMIZERS), ("optim.expert_step", expert_step, EXPERT_STEPS)):
        if value not in valid:
            raise ValueError(f"{key}={value!r} is not valid; valid: {sorted(valid)}")
    for key, number in values.items():
        if (key in ("lr", "eps") or key.endswith("_lr_scale")) and not number > 0:
            raise ValueError(f"optim.{key}={number} must be > 0")
    if values.get("warmup_updates", 0) < 0:
        raise ValueError(f"optim.warmup_updates={values['warmup_updates']} must be >= 0")


def load_aware_scale(counts: Tensor) -> Tensor:
    """(L, E) factor of each expert's update from (L, E) token counts n_e of this update, per layer:
    `s_e = min(1, n_e / mean_e n_e)`, so an expert routed fewer tokens than the layer's mean moves in
    proportion, a busy one as the optimizer says; a layer that routed no token keeps 1."""
    counts = counts.double()
    mean = counts.mean(dim=-1, keepdim=True)  # (L, 1)
    return torch.where(mean > 0, (counts / mean.clamp(min=1e-300)).clamp(max=1.0), torch.ones_like(counts))
