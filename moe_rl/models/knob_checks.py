"""The router and expert knobs' config checks: in range, and refused, naming the key, for a model that lacks
what a knob acts on (moe_rl.config.validate calls `check_router_knobs`)."""

from __future__ import annotations

from typing import Any

from moe_rl.models import BACKENDS, DENSE_FAMILIES, FAMILIES
from moe_rl.models.knobs import AUX_LOSS_FAMILIES, FLOAT64_ROUTER_FAMILIES, ROUTER_DTYPES, Z_LOSS_FAMILIES


def check_router_knobs(m: Any, o: Any, a: Any, *, engine: str) -> None:
    """The router and expert knobs (moe_rl.models.knobs) in range, and refused, naming the key, for a model
    that lacks what they act on: a dense model has no router or experts, a family without a load-balancing
    loss in transformers gets no `algo.aux_loss_coef`, and so on. A checkpoint of another family is checked
    when it is loaded. `m`, `o`, `a`: the model, optim and algo sections of the config; `engine`: rollout.engine."""
    family = m.family
    if m.router_dtype not in ROUTER_DTYPES:
        raise ValueError(f"model.router_dtype={m.router_dtype!r} is not valid; valid: {sorted(ROUTER_DTYPES)}")
    for key, value in (("algo.aux_loss_coef", a.aux_loss_coef), ("algo.router_z_loss_coef", a.router_z_loss_coef)):
        if value < 0:
            raise ValueError(f"{key}={value} must be >= 0 (0: off)")
    if m.router_frozen and o.router_lr_scale != 1.0:
        raise ValueError(
            f"optim.router_lr_scale={o.router_lr_scale} scales the routers' updates, but model.router_frozen=true "
            "gives them none; set one of the two"
        )
    knobs: tuple[tuple[str, object, object], ...] = (
        ("model.router_frozen", m.router_frozen, False),
        ("model.router_dtype", m.router_dtype, "float32"),
        ("optim.router_lr_scale", o.router_lr_scale, 1.0),
        ("optim.expert_lr_scale", o.expert_lr_scale, 1.0),
        ("optim.expert_step", o.expert_step, "plain"),
        ("algo.aux_loss_coef", a.aux_loss_coef, 0.0),
        ("algo.router_z_loss_coef", a.router_z_loss_coef, 0.0),
    )
    on = [(knob, setting, default) for knob, setting, default in knobs if setting != default]
    if family in DENSE_FAMILIES and on:
        knob, setting, default = on[0]
        raise ValueError(
            f"{knob}={setting!r} acts on the MoE layers' routers or experts, but model.family={family!r} is dense "
            f"(no router, no experts); leave it at {default!r}"
        )
    known = family in FAMILIES or family in BACKENDS  # else a checkpoint's family: checked when it is loaded
    if known and o.mlp_lr_scale != 1.0:
        raise ValueError(f"optim.mlp_lr_scale acts on a dense model's MLPs; model.family={family!r} has experts")
    why = {
        "algo.aux_loss_coef": (
            AUX_LOSS_FAMILIES,
            "transformers' ForCausalLM of this family returns no load-balancing loss (aux_loss)",
        ),
        "algo.router_z_loss_coef": (
            Z_LOSS_FAMILIES,
            "ST-MoE's z-loss bounds the logits of a softmax router; this family's router is not one",
        ),
        "model.router_dtype": (
            FLOAT64_ROUTER_FAMILIES,
            "this family's router computes in float32 whatever its weights' dtype (or has no float64 kernel)",
        ),
    }
    for knob, setting, _ in on:
        if known and knob in why and family not in why[knob][0]:
            raise ValueError(f"{knob}={setting!r} is not supported for model.family={family!r}: {why[knob][1]}")
    if m.router_dtype == "float64" and engine != "hf":
        raise ValueError("model.router_dtype=float64 runs on the transformers model with rollout.engine=hf only")
