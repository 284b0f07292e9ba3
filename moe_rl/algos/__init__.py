"""Advantages and policy losses as pure functions of tensors (GRPO arXiv 2402.03300, GSPO arXiv 2507.18071,
SAPO arXiv 2511.20347, CISPO arXiv 2506.13585, DPPO arXiv 2602.04879, VESPO arXiv 2602.10693; the off-policy
sequence mask of DeepSeek-V3.2, arXiv 2512.02556)."""

from moe_rl.algos.advantages import group_advantages
from moe_rl.algos.losses import (
    AGG_MODES,
    LOSSES,
    Loss,
    LossFn,
    cispo_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    get_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    offpolicy_sequence_mask,
    sapo_loss,
    vespo_loss,
)

__all__ = [
    "AGG_MODES",
    "LOSSES",
    "Loss",
    "LossFn",
    "cispo_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "get_loss",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "offpolicy_sequence_mask",
    "sapo_loss",
    "vespo_loss",
]
