"""Routing Replay (R2/R3) and the docs/design.md §3 `route/*` and `ratio/*` metrics inside TRL's `GRPOTrainer`.

    from moe_rl.integrations.trl import MoeGRPOTrainer, algo_args, task_reward
    args = GRPOConfig(..., num_iterations=2, **algo_args("gspo"))
    trainer = MoeGRPOTrainer(model=model, args=args, reward_funcs=task_reward("reversal"),
                             train_dataset=data, processing_class=tokenizer, routing_replay="r2")

`MoeGRPOTrainer` is a small subclass: TRL's loss code runs unchanged; the subclass only wraps the
policy forwards TRL already makes with `RouteReplay` / `RouteRecorder` and carries the routes with
the batch. Supported: trl>=1.16,<1.17 (it overrides private methods whose contracts change between
minor releases), transformers generation (not vLLM, not continuous batching), text-only models.

Where the routes come from and go (TRL's forward is over `cat(prompt_ids, completion_ids)`, prompts
left-padded, completions right-padded, shape (B, T) with T = P + C; routes use that layout):
- generation (`_generate_single_turn`): a `RouteRecorder` around `generate` gives routes of
  positions 0..P+n-2; the last generated token is never fed back, so it has no route.
- old-policy pass (inside `_generate_and_score_completions`, only where TRL computes
  `old_per_token_logps`: `num_iterations > 1` or `steps_per_generation > gradient_accumulation_steps`):
  recorded; under R3 it replays the generation routes (as the harness does).
- the routes are stored as tensors in the batch dict TRL returns, so TRL's shuffle and split into
  `steps_per_generation` mini-batches keep them on their rows;
- every update forward (`compute_loss`) replays R2: the old-pass routes, R3: the generation routes,
  with a recorder nested inside that sees the routes actually used. The hooks stay registered until
  after `backward`, so gradient-checkpointing recomputation replays the same routes.
Route masks cover real tokens except the last column, whose output predicts nothing (the harness's
`sequences[:, :-1]` convention); replay keeps the router's own choice at masked positions.

Without an old-policy pass every update is on-policy (TRL uses the detached current log-probs as
`old`), so R2 has nothing to replay and equals `none`; R3 still replays the generation routes.
Metrics are the local process's (rank 0 logs its own), averaged over TRL's logging window except
`*_max`, which is the max.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from packaging.version import Version
from torch import Tensor, nn

SUPPORTED_TRL = ">=1.16,<1.17"
_TRL_MIN, _TRL_MAX = Version("1.16"), Version("1.17")

try:
    import trl
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"moe_rl.integrations.trl needs trl{SUPPORTED_TRL}: pip install 'moe_rl[trl]'") from err


def check_trl_version(version: str) -> None:
    """Raise ImportError unless `version` is in SUPPORTED_TRL (pre-releases count as their release)."""
    release = Version(Version(version).base_version)
    if not _TRL_MIN <= release < _TRL_MAX:
        raise ImportError(
            f"moe_rl.integrations.trl supports trl{SUPPORTED_TRL}, found trl {version}: it overrides private "
            f"GRPOTrainer methods whose behaviour changes between minor releases. Install 'trl{SUPPORTED_TRL}'."
        )


check_trl_version(trl.__version__)

from accelerate.utils import is_peft_model  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from moe_rl.algos import LOSSES, Loss  # noqa: E402
from moe_rl.metrics.names import (  # noqa: E402
    NATIVE_VS_REPLAYED,
    OLD_VS_NEW,
    RATIO_CLIPFRAC_HIGH,
    RATIO_CLIPFRAC_LOW,
    ROLLOUT_VS_OLD,
    ROUTE_USED_VS_CACHED_FLIP_RATE,
)
from moe_rl.metrics.ratio_stats import margin_stats, ratio_stats  # noqa: E402
from moe_rl.routing import RoutedPass, RouteRecorder, Routes, compare_routes, find_moe_layers, route_metrics  # noqa: E402
from moe_rl.routing.modes import mode_names, replay_mode  # noqa: E402
from moe_rl.tasks import get_task  # noqa: E402

# The replay modes this integration runs: those that force ids alone, as given (the thresholded
# modes, Total Router Recall and anchored routing run in the harness's own loop, `moe_rl.train`).
REPLAY_MODES = mode_names(ids_only=True, anchored=False)


def _trl_args(loss: Loss) -> dict[str, Any]:
    """GRPOConfig keyword arguments of a harness loss TRL's "grpo" loss_type can express: its ratio level
    and its paper's clip range, with no KL term and no load-balancing loss (TRL adds the architecture's
    `router_aux_loss_coef` by default)."""
    return dict(
        loss_type="grpo",
        importance_sampling_level=loss.ratio_level,
        epsilon=loss.defaults["eps_low"],
        epsilon_high=loss.defaults["eps_high"],
        beta=0.0,
        router_aux_loss_coef=0.0,
    )


# TRL arguments that give the harness's algorithms (docs/design.md §1): GRPO (token ratio) with the GSPO
# paper's asymmetric clip and the per-sequence token mean, and GSPO (sequence ratio), each at its paper's clip range.
ALGO_ARGS: dict[str, dict[str, Any]] = {name: _trl_args(LOSSES[name]) for name in ("grpo", "gspo")}

# The trainer's own batch keys; they travel through TRL's shuffle and split like its other per-row tensors.
OLD_ROUTES, OLD_ROUTES_MASK = "old_routes", "old_routes_mask"
ROLLOUT_ROUTES, ROLLOUT_ROUTES_MASK = "rollout_routes", "rollout_routes_mask"


def algo_args(name: str) -> dict[str, Any]:
    """GRPOConfig keyword arguments for algorithm `name` ("grpo" token-level, "gspo" sequence-level)."""
    if name not in ALGO_ARGS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {sorted(ALGO_ARGS)}")
    return dict(ALGO_ARGS[name])


def task_reward(name: str, *, partial_credit: float = 0.0) -> Callable[..., list[float]]:
    """A TRL reward function with task `name`'s exact reward; the example's fields arrive as dataset columns."""
    task = get_task(name)

    def reward(completions: list[str], **columns: Any) -> list[float]:
        n = len(completions)
        fields = {k: v for k, v in columns.items() if isinstance(v, list) and len(v) == n}
        examples = [{k: v[i] for k, v in fields.items()} for i in range(n)]
        return [task.reward(c, e, partial_credit=partial_credit) for c, e in zip(completions, examples)]

    reward.__name__ = f"{name}_reward"
    return reward


# --- routes in the layout of TRL's forward (pure) ----------------------------------------------------


def forward_route_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) positions of TRL's forward that carry a route: real tokens, except the last column."""
    mask = attention_mask.bool().clone()
    mask[:, -1] = False
    return mask


def generation_routes_to_forward(
    routes: Routes, attention_mask: Tensor, *, prompt_len: int, generation_prompt_len: int
) -> Routes:
    """Routes recorded around `generate` (B, P + n - 1) in the layout of TRL's forward (B, P + C).

    Both layouts put the left-padded prompt in columns [0, P) and completion token j in column P + j,
    so columns map one to one; columns generation never fed to the model (the last generated token,
    any padding beyond it) are masked, as are pads. Raises ValueError when the prompt blocks differ.
    """
    B, T = attention_mask.shape
    if routes.shape[0] != B:
        raise ValueError(f"generation routes have {routes.shape[0]} rows, the batch has {B}")
    if generation_prompt_len != prompt_len:
        raise ValueError(f"generation saw prompts padded to {generation_prompt_len}, the forward to {prompt_len}")
    prompt_mask = attention_mask[:, :prompt_len].bool()
    if not torch.equal(routes.mask[:, :prompt_len].to(prompt_mask.device), prompt_mask):
        raise ValueError("the prompt padding of generation and of the forward differ (rows out of order?)")
    m = min(T, routes.shape[1])
    indices = routes.indices.new_zeros((B, T, *routes.shape[2:]))  # (B, T, L, k)
    indices[:, :m] = routes.indices[:, :m]
    mask = torch.zeros(B, T, dtype=torch.bool, device=routes.mask.device)
    mask[:, :m] = routes.mask[:, :m]
    mask &= forward_route_mask(attention_mask).to(mask.device)
    return Routes(indices, mask, routes.layer_map, routes.num_experts)


def cat_routes(parts: list[Routes]) -> Routes:
    """Routes of consecutive row chunks, concatenated along the batch."""
    first = parts[0]
    if len(parts) == 1:
        return first
    return Routes(
        torch.cat([p.indices for p in parts]), torch.cat([p.mask for p in parts]), first.layer_map, first.num_experts
    )


def clip_fractions(
    *, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float, level: str
) -> dict[str, float]:
    """`ratio/clipfrac_low|high` of docs/design.md §3 for TRL's ratio: per token, or per sequence (GSPO).

    low: ratio < 1 - eps_low and adv < 0; high: ratio > 1 + eps_high and adv > 0; over valid tokens
    (sequence level: over non-empty sequences), as in `moe_rl.algos.losses`.
    """
    mask = mask.bool()
    delta = torch.where(mask, logp.double() - old_logp.double(), 0.0)  # (B, C)
    adv = adv.double()
    if level == "sequence":
        seq_len = mask.sum(-1)
        ratio, valid = torch.exp(delta.sum(-1) / seq_len.clamp(min=1)), seq_len > 0  # (B,)
        adv = adv if adv.dim() == 1 else adv[:, 0]
    else:
        ratio, valid = torch.exp(delta), mask
        adv = adv[:, None].expand_as(ratio) if adv.dim() == 1 else adv
    n = valid.sum().clamp(min=1)
    low = ((ratio < 1 - eps_low) & (adv < 0) & valid).sum() / n
    high = ((ratio > 1 + eps_high) & (adv > 0) & valid).sum() / n
    return {RATIO_CLIPFRAC_LOW: low.item(), RATIO_CLIPFRAC_HIGH: high.item()}


# --- the trainer ---------------------------------------------------------------------------------------


@dataclass
class _PolicyPass:
    """A policy forward that `_get_per_token_logps_and_entropies` hooks, and what it saw."""

    replay: Routes | None = None  # routes to force, in the forward's layout (None: record only)
    replay_generation: bool = False  # old pass under R3: force the generation routes, mapped in place
    margins: bool = False
    ran: bool = False
    logp: Tensor | None = None  # (B, C)
    used: Routes | None = None  # what the experts received (the forced routes where replayed)
    native: Routes | None = None  # what the router chose itself
    margin_values: Tensor | None = None  # (B, T, L)
    generation: Routes | None = None  # generation routes in the forward's layout


class MoeGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` with Routing Replay (`routing_replay`: none, r2, r3) and docs/design.md §3 metrics.

    Adds to TRL's logs, per update: `ratio/*` and `kl/k3` (`moe_rl.metrics.ratio_stats.ratio_stats`),
    `ratio/clipfrac_low|high`, `route/old_vs_new/*` (the current policy's own routes vs the old
    pass's), and under replay `route/native_vs_replayed/*` and `route/used_vs_cached/flip_rate`
    (0 when replay applied); per generation: `route/rollout_vs_old/*` and `route/margin_mean|p10`.
    With `route_metrics=False` and `routing_replay="none"` it is plain `GRPOTrainer`.
    """

    def __init__(self, *args: Any, routing_replay: str = "none", route_metrics: bool = True, **kwargs: Any) -> None:
        if routing_replay not in REPLAY_MODES:
            raise ValueError(f"routing_replay={routing_replay!r} is not valid; valid: {list(REPLAY_MODES)}")
        self.routing_replay = routing_replay
        self.replay_mode = replay_mode(routing_replay)
        self.route_metrics = route_metrics
        self._pass: _PolicyPass | None = None
        self._backward_hooks: ExitStack | None = None
        self._generation_routes: Routes | None = None
        self._generation_prompt_len: int | None = None
        super().__init__(*args, **kwargs)
        find_moe_layers(self._policy())  # fail now, not mid-training, on a model without MoE layers
        self._check_supported()

    @property
    def hooks_active(self) -> bool:
        return self.replay_mode.replays or self.route_metrics

    def _check_supported(self) -> None:
        if self.replay_mode.replays_rollout:
            if self.use_vllm or self.use_transformers_continuous_batching:
                raise NotImplementedError(
                    f"routing_replay={self.routing_replay!r} needs routes recorded during generation, which this "
                    "integration takes "
                    "from transformers' `generate`; set use_vllm=False and use_transformers_paged=False"
                )
            if self.tools or self.rollout_func is not None:
                raise NotImplementedError(
                    f"routing_replay={self.routing_replay!r} does not support tools, environments or rollout_func"
                )
        if self.hooks_active and is_peft_model(self.model) and self.beta != 0.0 and self.ref_model is None:
            # TRL then computes reference log-probs with the policy module (adapter disabled).
            raise NotImplementedError("route hooks with a PEFT policy need beta=0 or an explicit ref_model")
        if self.replay_mode.replays_old and not self._computes_old_logps():
            warnings.warn(
                f"routing_replay={self.routing_replay!r} without an old-policy pass (num_iterations=1 and "
                "steps_per_generation <= gradient_accumulation_steps): every update is on-policy, so R2 replays "
                "nothing",
                stacklevel=3,
            )

    def _computes_old_logps(self) -> bool:
        """Whether TRL computes `old_per_token_logps` (the condition in `_generate_and_score_completions`)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _policy(self, model: nn.Module | None = None) -> nn.Module:
        model = self.accelerator.unwrap_model(self.model if model is None else model)
        return model.get_base_model() if is_peft_model(model) else model

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._metrics[self._mode()][key].append(value)

    def _routes_from(self, inputs: dict[str, Any], key: str, mask_key: str) -> Routes | None:
        if inputs.get(key) is None:
            return None
        policy = self._policy()
        layers = find_moe_layers(policy)
        layer_map = tuple(layer.decoder_layer for layer in layers)
        return Routes(inputs[key], inputs[mask_key], layer_map, layers[0].num_experts)

    # --- generation: routes for R3 ----------------------------------------------------------------

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        call = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if not self.hooks_active or self.use_vllm or self.use_transformers_continuous_batching or self.tools:
            return super()._generate_single_turn(*call)
        with RouteRecorder(self._policy()) as recorder:
            out = super()._generate_single_turn(*call)
        longest = max(len(ids) for ids in prompt_ids)
        multiple = self.pad_to_multiple_of or 1
        self._generation_prompt_len = -(-longest // multiple) * multiple  # TRL's left padding of the prompts
        self._generation_routes = recorder.routes
        return out

    # --- old-policy pass, and routes attached to the batch ---------------------------------------------

    def _generate_and_score_completions(self, inputs):
        if not self.hooks_active:
            return super()._generate_and_score_completions(inputs)
        self._generation_routes = None
        old_pass = _PolicyPass(replay_generation=self.replay_mode.old_pass_replays, margins=self.route_metrics)
        self._pass = old_pass if self._computes_old_logps() else None
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._pass = None
        if old_pass.ran != ("old_per_token_logps" in output):
            raise RuntimeError("old-policy pass detection disagrees with TRL's; is the TRL version supported?")

        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)  # (B, T)
        valid = forward_route_mask(attention_mask)
        generation = old_pass.generation
        if generation is None and self._generation_routes is not None:
            generation = generation_routes_to_forward(
                self._generation_routes,
                attention_mask,
                prompt_len=output["prompt_ids"].shape[1],
                generation_prompt_len=self._generation_prompt_len,
            )
        if self.replay_mode.replays_rollout and generation is None:
            raise RuntimeError(f"routing_replay={self.routing_replay!r} but no routes were recorded during generation")
        if generation is not None:
            output[ROLLOUT_ROUTES], output[ROLLOUT_ROUTES_MASK] = generation.indices, generation.mask
        if old_pass.ran:
            old = old_pass.native.with_mask(valid)
            output[OLD_ROUTES], output[OLD_ROUTES_MASK] = old.indices, old.mask
            if self.route_metrics:
                metrics = {}
                if generation is not None:
                    metrics.update(route_metrics(ROLLOUT_VS_OLD, generation, old))
                metrics.update(margin_stats(old_pass.margin_values, old.mask))
                self._log_metrics(metrics)
        self._generation_routes = None
        return output

    # --- updates: replay, and metrics ------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch):
        # compute_loss parks its replay hooks here, so that they also cover backward (recomputation
        # under gradient checkpointing must route like the forward did).
        with ExitStack() as self._backward_hooks:
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._backward_hooks = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.hooks_active:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        old = self._routes_from(inputs, OLD_ROUTES, OLD_ROUTES_MASK)
        generation = self._routes_from(inputs, ROLLOUT_ROUTES, ROLLOUT_ROUTES_MASK)
        replay = self.replay_mode.pick(old=old, rollout=generation)
        if self.replay_mode.replays_rollout and replay is None:
            raise RuntimeError(f"routing_replay={self.routing_replay!r} but the batch carries no generation routes")
        update = _PolicyPass(replay=replay)
        self._pass = update
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._pass = None
        if self.route_metrics and update.ran:
            self._log_metrics(self._update_metrics(inputs, update, old))
        return loss

    def _update_metrics(self, inputs: dict[str, Any], update: _PolicyPass, old: Routes | None) -> dict[str, float]:
        mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        logp = update.logp
        old_logp = inputs.get("old_per_token_logps")
        old_logp = logp if old_logp is None else old_logp  # TRL's own choice when it skips the old pass
        metrics = ratio_stats(logp=logp, old_logp=old_logp, mask=mask)
        metrics.update(
            clip_fractions(
                logp=logp,
                old_logp=old_logp,
                adv=inputs["advantages"],
                mask=mask,
                eps_low=self.epsilon_low,
                eps_high=self.epsilon_high,
                level=self.importance_sampling_level,
            )
        )
        if old is not None:
            metrics.update(route_metrics(OLD_VS_NEW, update.native, old))
        if update.replay is not None:
            metrics.update(route_metrics(NATIVE_VS_REPLAYED, update.native, update.replay))
            metrics[ROUTE_USED_VS_CACHED_FLIP_RATE] = compare_routes(update.used, update.replay)["flip_rate"]
        return metrics

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **kwargs,
    ):
        policy_pass = self._pass
        if policy_pass is None or policy_pass.ran or self._policy(model) is not self._policy():
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **kwargs,
            )
        extra = sorted(k for k, v in kwargs.items() if v is not None)
        if extra:
            raise NotImplementedError(f"route hooks cover text-only models; this forward also gets {extra}")
        policy_pass.ran = True
        policy = self._policy(model)
        valid = forward_route_mask(attention_mask)
        if policy_pass.replay_generation:
            policy_pass.generation = generation_routes_to_forward(
                self._generation_routes,
                attention_mask,
                prompt_len=input_ids.shape[1] - logits_to_keep,
                generation_prompt_len=self._generation_prompt_len,
            )
            policy_pass.replay = policy_pass.generation
        replay = policy_pass.replay
        if replay is not None and replay.shape[:2] != tuple(input_ids.shape):
            raise ValueError(
                f"routes {tuple(replay.shape[:2])} do not match the forward's input_ids {tuple(input_ids.shape)}"
            )
        B = input_ids.shape[0]
        step = batch_size or B
        keep_for_backward = torch.is_grad_enabled() and self._backward_hooks is not None
        if keep_for_backward and step < B:
            raise NotImplementedError("replay through backward needs one forward chunk per loss")
        logps, entropies, aux_losses, used, native, margins = [], [], [], [], [], []
        for start in range(0, B, step):
            rows = slice(start, min(start + step, B))
            with ExitStack() as local:
                stack = self._backward_hooks if keep_for_backward else local
                routed = stack.enter_context(
                    RoutedPass(policy, replay[rows] if replay is not None else None, margins=policy_pass.margins)
                )
                logp, entropy, aux = super()._get_per_token_logps_and_entropies(
                    model,
                    input_ids[rows],
                    attention_mask[rows],
                    logits_to_keep,
                    compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss,
                )
                rows_valid = valid[rows]
                used.append(routed.used.with_mask(rows_valid))
                native.append(routed.native.with_mask(rows_valid))
                if policy_pass.margins:
                    margins.append(routed.margins)
            logps.append(logp)
            entropies.append(entropy)
            aux_losses.append(aux)
        policy_pass.logp = torch.cat(logps).detach()
        policy_pass.used, policy_pass.native = cat_routes(used), cat_routes(native)
        if margins:
            policy_pass.margin_values = torch.cat(margins)
        entropy = torch.cat(entropies) if compute_entropy else None
        aux_loss = torch.stack(aux_losses).mean() if compute_aux_loss else None
        return torch.cat(logps), entropy, aux_loss

    # --- logging ---------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # TRL averages every metric over the logging window; a maximum stays a maximum.
        for key, values in self._metrics[self._mode()].items():
            if key.startswith(("ratio/", "route/")) and key.endswith("_max"):
                finite = [v for v in values if not math.isnan(v)]
                self._metrics[self._mode()][key] = [max(finite)] if finite else []
        super().log(logs, start_time)


__all__ = [
    "ALGO_ARGS",
    "REPLAY_MODES",
    "SUPPORTED_TRL",
    "MoeGRPOTrainer",
    "algo_args",
    "check_trl_version",
    "clip_fractions",
    "forward_route_mask",
    "generation_routes_to_forward",
    "task_reward",
]
