"""Advantages and policy losses as pure functions of tensors (GRPO arXiv 2402.03300, GSPO arXiv 2507.18071,
SAPO arXiv 2511.20347, CISPO arXiv 2506.13585)."""

from moe_rl.algos.advantages import group_advantages
from moe_rl.algos.losses import (
    AGG_MODES,
    LOSSES,
    Loss,
    LossFn,
    cispo_loss,
    get_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    sapo_loss,
)

__all__ = [
    "AGG_MODES",
    "LOSSES",
    "Loss",
    "LossFn",
    "cispo_loss",
    "get_loss",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "sapo_loss",
]
