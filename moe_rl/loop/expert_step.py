"""`optim.expert_step`: the optimizer's own step (`plain`), or each routed expert's step scaled by its load in
the update (`load_aware`).

Under `load_aware`, with n_e the tokens routed to expert e in an update (the routes the experts received: the
replayed ones under replay; every slot of every real input token, pooled over the processes), each expert's
update `w_after - w_before` is scaled by `s_e = min(1, n_e / mean_e n_e)` after the optimizer's step
(`moe_rl.algos.optimizers.load_aware_scale`): an expert routed fewer tokens than its layer's mean moves in
proportion, where AdamW alone moves it about as far as a busy one (its second moment is as small as its
gradient). Experts at s_e = 1 keep the optimizer's values bit for bit. Packed (E, ...) experts and per-expert
modules are addressed through `moe_rl.models.knobs.expert_rows`; a family whose experts are held otherwise is
refused when the optimizer is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from moe_rl.algos.optimizers import load_aware_scale
from moe_rl.models.knobs import expert_rows
from moe_rl.routing import RouteRecorder
from moe_rl.routing.load import expert_counts


def _like(p: Tensor, t: Tensor) -> Tensor:
    """`t` (broadcastable to `p`) as `p` holds it: distributed like an FSDP2 DTensor parameter, else on its device."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        return distribute_tensor(t.to(p.to_local().device), p.device_mesh, p.placements)
    return t.to(p.device)


class ExpertStep:
    """The update's expert step: `counting()` around the update's forward records the routes the experts receive,
    `scaled(total)` around the optimizer's step rescales each expert's move; both do nothing under `plain`."""

    def __init__(self, model: nn.Module, mode: str = "plain") -> None:
        self.model = model
        # per MoE layer: (parameter, its expert or None for a packed (E, ...) tensor)
        self.rows = expert_rows(model, f"optim.expert_step={mode}") if mode == "load_aware" else None
        self._recorder: RouteRecorder | None = None

    def counting(self) -> contextlib.AbstractContextManager:
        """Around the update's forward, after any replay is armed: records the routes the experts receive."""
        if self.rows is None:
            return contextlib.nullcontext()
        self._recorder = RouteRecorder(self.model)
        return self._recorder

    def scaled(self, total: Callable[[Tensor], Tensor]) -> contextlib.AbstractContextManager:
        """Around the optimizer's step: each expert's move scaled by its share of the counted tokens, pooled by
        `total` (a collective: call this on every process, whether or not the step then runs)."""
        if self.rows is None or self._recorder is None:
            return contextlib.nullcontext()
        return self._rescaled(total(expert_counts(self._recorder.routes)))

    @contextlib.contextmanager
    def _rescaled(self, counts: Tensor) -> Iterator[None]:
        before = self.snapshot()
        yield
        self.rescale(before, counts)

    def snapshot(self) -> list[list[Tensor]]:
        """The expert parameters before the optimizer's step."""
        return [[p.detach().clone() for p, _ in layer] for layer in self.rows or []]

    @torch.no_grad()
    def rescale(self, before: list[list[Tensor]], counts: Tensor) -> Tensor:
        """Scale each expert's step since `before` by its factor from (L, E) `counts`; returns the factors."""
        scale = load_aware_scale(counts)  # (L, E) float64
        for layer, olds, s in zip(self.rows or [], before, scale):
            for (p, expert), old in zip(layer, olds):
                if expert is not None:  # one expert's module: one factor
                    if s[expert] < 1:
                        p.copy_(old + (p - old) * s[expert].item())
                    continue
                shape = (-1,) + (1,) * (p.dim() - 1)  # row e of a packed tensor is expert e's
                factor, moved = (_like(p, x.view(shape)) for x in (s.to(p.dtype), s < 1))
                p.copy_(torch.where(moved, old + (p - old) * factor, p))
        return scale
