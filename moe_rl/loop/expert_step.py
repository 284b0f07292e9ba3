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

On the route instruments' steps, under either mode, it also observes each expert's activity
(`optim/expert_step/active`, `move_active`: in which updates an expert received any token, and how far it moved in
those), the instrument of the 1/sqrt(p_e) prediction: an expert active in a share p_e of updates keeps an AdamW
second moment near p_e g^2, so on the updates it is used it moves about 1/sqrt(p_e) as far as a busy one.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from moe_rl.algos.optimizers import load_aware_scale
from moe_rl.loop.step_metrics import WEIGHT_SUFFIX
from moe_rl.metrics.names import OPTIM_EXPERT_ACTIVE, OPTIM_EXPERT_MOVE_ACTIVE
from moe_rl.models.knobs import expert_rows
from moe_rl.routing import RouteRecorder
from moe_rl.routing.expert_load import expert_counts, expert_step_rms

Snapshot = Callable[[nn.Module], "list[Tensor] | None"]  # the experts' weights, one row per expert (None: none)


def _like(p: Tensor, t: Tensor) -> Tensor:
    """`t` (broadcastable to `p`) as `p` holds it: distributed like an FSDP2 DTensor parameter, else on its device."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        return distribute_tensor(t.to(p.to_local().device), p.device_mesh, p.placements)
    return t.to(p.device)


class ExpertStep:
    """The update's expert step: `counting()` around the update's forward records the routes the experts receive,
    `scaled(total)` around the optimizer's step rescales each expert's move (`load_aware`) and, on an instrumented
    update, measures each expert's activity into `observed`; under `plain` on other updates both do nothing.
    `experts` snapshots the expert weights for the instrument (None, or a model without stackable experts: off)."""

    def __init__(self, model: nn.Module, mode: str = "plain", experts: Snapshot | None = None) -> None:
        self.model = model
        # per MoE layer: (parameter, its expert or None for a packed (E, ...) tensor)
        self.rows = expert_rows(model, f"optim.expert_step={mode}") if mode == "load_aware" else None
        self.experts = experts if experts is not None and experts(model) is not None else None
        self._recorder: RouteRecorder | None = None
        self._observing = False
        self.observed: dict[str, float] = {}  # the last update's activity metrics ({} unless observed)

    def counting(self, instruments: bool = False) -> contextlib.AbstractContextManager:
        """Around the update's forward, after any replay is armed: records the routes the experts receive (under
        `load_aware`, or to observe the experts on an update of the instruments)."""
        self._observing, self.observed = instruments and self.experts is not None, {}
        if self.rows is None and not self._observing:
            self._recorder = None
            return contextlib.nullcontext()
        self._recorder = RouteRecorder(self.model)
        return self._recorder

    def scaled(self, total: Callable[[Tensor], Tensor]) -> contextlib.AbstractContextManager:
        """Around the optimizer's step: each expert's move scaled by its share of the counted tokens, pooled by
        `total` (a collective: call this on every process, whether or not the step then runs), and observed."""
        if self._recorder is None:
            return contextlib.nullcontext()
        return self._stepped(total(expert_counts(self._recorder.routes)))

    @contextlib.contextmanager
    def _stepped(self, counts: Tensor) -> Iterator[None]:
        before = self.snapshot() if self.rows is not None else None
        experts = self.experts(self.model) if self.experts is not None and self._observing else None
        yield
        if before is not None:
            self.rescale(before, counts)
        if experts is not None and self.experts is not None:
            self.observed = expert_activity(expert_step_rms(experts, self.experts(self.model) or []), counts)

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


def expert_activity(rms: Tensor, tokens: Tensor) -> dict[str, float]:
    """One update's `optim/expert_step/active` and `move_active` per (layer, expert): whether expert e of layer l
    received any of the update's (token, slot) assignments (`tokens` (L, E), pooled over processes), and its move
    RMS in the update (`rms` (L, E), `expert_step_rms`), weighted by that activity so the step keeps the mean over
    the updates in which it was active (`WEIGHT_SUFFIX`)."""
    out: dict[str, float] = {}
    for (layer, expert), n in zip(itertools.product(*map(range, tokens.shape)), tokens.reshape(-1).tolist()):
        suffix = f"layer_{layer}/expert_{expert}"
        out[OPTIM_EXPERT_ACTIVE + suffix] = float(n > 0)
        out[OPTIM_EXPERT_MOVE_ACTIVE + suffix] = float(rms[layer, expert])
        out[OPTIM_EXPERT_MOVE_ACTIVE + suffix + WEIGHT_SUFFIX] = float(n > 0)
    return out
