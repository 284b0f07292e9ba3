"""The one stateful loop: cold start, rollouts, old-policy pass, N updates with replay, logging.

Per step (`Trainer.step`; docs/design.md §1, §3):
1. rollout: sample G completions for each of P (x S, `rollout.staleness`) prompts with the rollout policy (a copy in
   `rollout.dtype`, or of the weights k steps before: `rollout.policy_lag`; `moe_rl.loop.staleness`), recording
   rollout log-probs and routes (R3); score them, and take group-normalised advantages of the rewards;
2. old-policy pass: teacher-forced, no grad, training precision; gives `old_logp` and the old
   policy's routes (R2). Under R3 this pass already replays the rollout routes; anchored, it replays the
   routes of a no-grad pass of the cold start, which the rollout took token by token (`routing.anchored`);
3. what the updates share (`Batch`): the routes the mode replays (`moe_rl.routing.modes`: R2 the old pass's, R3 the
   rollout's, anchored the cold start's) and the engine-gap correction (`rollout.is_correction`; under a lag, the
   decoupled loss's behaviour weight), a constant weight per token from the rollout's and the old pass's log-probs;
4. N (x S) updates on a seeded shuffle of the batch into as many mini-batches; updates 2.. are off-policy.
   Every forward that computes pi_theta for the ratio replays the cached routes (thresholded or with
   the combine weights as the mode says) while recording what the router would have chosen natively.
   The loss may scale each token ratio by RSPO's router-shift factor (`algo.router_shift`), a
   constant from the router scores the passes recorded, and weights each token by the correction;
5. metrics, emitted where they are computed (`moe_rl.loop.step_metrics`) into an update's or the step's accumulator
   (`moe_rl.metrics.accumulator`): each update's pooled over the processes, aggregated over the step (mean;
   `ratio/token_max` is a max), with the step's own (rewards, rollout gap, margins, rollout vs old routes); route
   snapshots every `snapshot_every` steps. The route instruments (route/*, the ratio split) and the work only they need
   run on the steps `metrics.route_every` names, the split on a seeded subsample of each update's rows
   (`metrics.split_rows`); every other number is the same either way.

How this differs from the papers' recipes (arXiv 2402.03300, 2507.18071, 2510.11370): tiny models from configs and
synthetic tasks with exact rewards; no KL term unless `algo.beta > 0`; no router load-balancing loss or z-loss unless
`algo.aux_loss_coef` or `algo.router_z_loss_coef` is set, so by default only the policy gradient moves the router;
advantages use each group's population std; AdamW with betas (0.9, 0.99) and gradient clipping at 1.0; the "inference
engine" is the same transformers model sampling with a KV cache (in `rollout.dtype`) unless `rollout.engine=vllm`,
where an in-process vLLM engine samples and routes the rollouts (moe_rl.rollout.engine) and gets the trainer's weights
in place.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections import defaultdict
from typing import Any

import torch
import transformers

from moe_rl.algos import get_loss, group_advantages
from moe_rl.algos.corrections import EngineWeight, engine_weight
from moe_rl.config import TrainConfig, config_hash, run_dir, validate
from moe_rl.loop.checkpoint import RunState, refuse_foreign_dir, restore_state, save_state
from moe_rl.loop.cold_start import get_cold_start, run_member
from moe_rl.loop.compiled import compile_run
from moe_rl.loop.distributed import Dist, peer_lost, world_size_from_env
from moe_rl.loop.judging import judge_step, signal_verdict
from moe_rl.loop.keys import run_keys
from moe_rl.loop.passes import anchor_routes, old_pass
from moe_rl.loop.policy import (
    build_optimizer,
    experts_snapshot,
    full,
    routers,
    set_router_knobs,
    update_forward,
    with_router_terms,
)
from moe_rl.loop.records import Batch, OldPass, Sampled
from moe_rl.loop.split import other_routing_logp, split_pass
from moe_rl.loop.staleness import PolicyLag, behaviour_weight_kwargs, minibatch_count, rollout_prompts
from moe_rl.loop.step_metrics import (
    aggregate,
    correction_metrics,
    instruments_due,
    local_positions,
    old_pass_metrics,
    rollout_metrics,
    route_metrics,
    router_shift_metrics,
    seconds_metrics,
    split_metrics,
    split_seed,
    split_subsample,
    update_routes,
)
from moe_rl.loop.update_kl import kl_rows, scored_updates, update_kl
from moe_rl.metrics.accumulator import Metrics
from moe_rl.metrics.names import (
    LOSS,
    OPTIM_GRAD_NORM,
    POLICY_ENTROPY,
    REWARD_ERRORS,
    REWARD_ZERO_VAR_GROUP_FRAC,
    TASK_ACCURACY,
    TIME_EVAL_S,
    TIME_OLD_LOGP_S,
    TIME_ROLLOUT_S,
    TIME_UPDATE_S,
)
from moe_rl.metrics.partial import mean_finalize, mean_parts
from moe_rl.metrics.ratio_stats import ratio_finalize, ratio_parts
from moe_rl.metrics.status import COLLAPSED, COMPLETED, DIVERGED, FAILED, FINISHED, RUNNING
from moe_rl.metrics.verdict import no_signal_warning
from moe_rl.rollout.evaluation import held_out_metrics
from moe_rl.rollout.generate import Rollout, forward_logp, generate, token_entropy
from moe_rl.routing import RoutedPass, RouteReplay, Routes, anchored_by, find_moe_layers
from moe_rl.routing.compare import router_shift_ratio
from moe_rl.routing.expert_load import (
    EXPERT_STEP,
    expert_step_finalize,
    expert_step_parts,
    expert_step_rms,
    router_drift,
)
from moe_rl.routing.modes import replay_mode
from moe_rl.run.atomic import write_atomic
from moe_rl.run.folder import RunDirectoryError, note_meta, pin_numerics, read_status, status_on_failure
from moe_rl.run.loggers import open_loggers
from moe_rl.run.progress import Progress, run_log
from moe_rl.tasks.rewards import zero_variance_frac
from moe_rl.tasks.setup import setup_task

log = logging.getLogger(__name__)


class Trainer:
    """State of one run; `train(cfg)` is the entry point."""

    def __init__(self, cfg: TrainConfig, *, checked: bool = False) -> None:
        """`checked`: the caller has validated `cfg` and checked its run folder (`train`, `run_from_hydra`)."""
        if not checked:
            validate(cfg)
        self.cfg = cfg = dataclasses.replace(cfg, out_dir=run_dir(cfg))
        pin_numerics(cfg.numerics)  # before torch computes anything
        self.dist = Dist(cfg.dist.strategy, cfg.dist.timeout_s, cfg.device)  # a world of size 1 without torchrun
        self.prompts = rollout_prompts(cfg.rollout.prompts_per_step, cfg.rollout.staleness)  # one rollout's
        self.dist.check(self.prompts, algo=cfg.algo.name, agg=cfg.algo.agg, beta=cfg.algo.beta)
        if not checked:
            refuse_foreign_dir(cfg, self.dist.world_size)  # before anything is written or logged
        cfg.progress = cfg.progress and self.dist.is_writer
        if cfg.rollout.engine == "vllm":
            from moe_rl.rollout.engine import require_vllm

            require_vllm()  # before the cold start's work
        transformers.utils.logging.disable_progress_bar()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        cold = run_member(cfg)  # the run's member of the cold-start pool (docs/design.md §4)
        self.task = setup_task(cfg.task, cold.seed)  # data and reward checked before the cold start
        with self.dist.writer_first():  # one process trains a missing cold start; the others load it
            self.policy, self.tokenizer, self.cold_info = get_cold_start(
                cfg.model, cfg.task, cold, numerics=cfg.numerics
            )
        self.policy.to(cfg.device)
        set_router_knobs(self.policy, cfg.model, fsdp=self.dist.active and cfg.dist.strategy == "fsdp")
        self.replay_mode = replay_mode(cfg.replay.mode)
        self.replay_threshold = self.replay_mode.threshold_of(cfg.replay.threshold)
        # A dense model (no MoE layer) trains the same way with nothing to record or replay: its rows carry
        # no route/ metrics. Replay is refused for it here too, for a checkpoint validate() could not see into.
        self.routed = bool(find_moe_layers(self.policy, required=False))
        if not self.routed and self.replay_mode.replays:
            raise ValueError(
                f"replay.mode={cfg.replay.mode!r} needs MoE layers; the model has none (use replay.mode=none)"
            )
        self.ref = copy.deepcopy(self.policy).eval() if cfg.algo.beta > 0 else None
        self.anchor = (self.ref or copy.deepcopy(self.policy).eval()) if self.replay_mode.anchored else None  # frozen
        self.rollout_dtype = getattr(torch, cfg.rollout.dtype)  # one of config.DTYPES
        self.engine: Any = None  # rollout.engine=vllm: the engine and its sync schedule (moe_rl.rollout.engine)
        if cfg.rollout.engine == "vllm":
            from moe_rl.rollout.engine import EngineRollouts, VllmEngine

            engine = VllmEngine(self.policy, dtype=cfg.rollout.dtype, seed=cfg.seed)
            self.engine = EngineRollouts(engine, cfg.rollout.engine_sync_every)
        self.lag = PolicyLag(cfg.rollout.policy_lag) if cfg.rollout.policy_lag else None  # the last k steps' weights
        shared = self.engine is not None or (
            self.rollout_dtype == next(self.policy.parameters()).dtype and not self.lag
        )
        self.rollout_policy = self.policy if shared else copy.deepcopy(self.policy).to(self.rollout_dtype)
        self.router_start = [p.detach().clone() for p in routers(self.policy)] if self.routed else []  # router_drift's
        self.train_policy = self.dist.wrap(self.policy)  # FSDP2 shards in place; DDP wraps (after the copies)
        self.compiled = cfg.compile and compile_run((self.policy, self.rollout_policy), cfg, self.dist.world_size)
        self.optimizer, self.scheduler, self.expert_step = build_optimizer(self.policy, cfg.optim)  # + the lr warm-up
        self.forward = update_forward(cfg.algo)  # with a router loss term: also the router logits and aux loss
        self.loss_fn = get_loss(cfg.algo.name)  # its kwargs: eps_low/eps_high or SAPO's taus, the KL's beta, the agg
        self.loss_kwargs = {**cfg.algo.loss_kwargs(), "beta": cfg.algo.beta, "agg": cfg.algo.agg}
        self.task = self.task.render(self.tokenizer)
        self.train_examples, self.eval_examples = self.task.train, self.task.eval[: cfg.eval_size]
        self.warned_no_signal = False
        self.writer = self.dist.writer(cfg.out_dir, run_keys(cfg, self.policy), config_hash=config_hash(cfg))
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.order = torch.randperm(
            len(self.train_examples), generator=torch.Generator().manual_seed(cfg.seed)
        ).tolist()

    # --- one step -----------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        """One step, as the module docstring numbers it; returns the step's metrics."""
        cfg = self.cfg
        instruments = instruments_due(step, cfg.metrics.route_every)  # the route instruments' steps
        t0 = time.perf_counter()
        sampled = self.rollout(step)  # 1.
        rollout = sampled.rollout
        if cfg.fault_nan_step == step:  # fault injection for tests: corrupt a router weight
            with torch.no_grad():
                next(p for n, p in self.policy.named_parameters() if "gate" in n or "router" in n).fill_(float("nan"))
        adv = group_advantages(sampled.rewards, group_size=cfg.rollout.group_size).to(cfg.device)  # rewards: CPU
        t1 = time.perf_counter()
        anchor = anchor_routes(self.anchor, rollout, temperature=cfg.rollout.temperature)  # 2. (None: not anchored)
        old = self.old_pass(rollout, instruments=instruments, anchor=anchor)
        t2 = time.perf_counter()
        replay = self.replay_mode.pick(old=old.routes, rollout=rollout.routes, anchor=anchor)  # 3.
        batch = Batch(rollout, adv, old, replay, self.engine_gap(rollout, old))
        experts = experts_snapshot(self.policy) if instruments and self.routed else None  # optim/expert_step's
        updates = self.updates(step, batch)  # 4.
        t3 = time.perf_counter()
        acc = Metrics()  # 5.
        seconds_metrics(acc, {TIME_ROLLOUT_S: t1 - t0, TIME_OLD_LOGP_S: t2 - t1, TIME_UPDATE_S: t3 - t2})
        engine_part = self.rollout_policy is not self.policy or self.engine is not None  # else the trainer sampled
        errors, group = sampled.metrics[REWARD_ERRORS], cfg.rollout.group_size
        rollout_metrics(acc, sampled.rewards, errors, rollout, old, group_size=group, engine_part=engine_part)
        old_pass_metrics(acc, old, rollout, replays_rollout=self.replay_mode.replays_rollout, instruments=instruments)
        if batch.correction is not None:
            correction_metrics(acc, batch.correction, rollout.response_mask)
        if instruments and self.router_start:  # each router's distance from the cold start
            acc.put(router_drift([full(p) for p in routers(self.policy)], self.router_start))
        if experts is not None and old.routes is not None:  # each expert's step against the tokens it was routed
            rms = expert_step_rms(experts, experts_snapshot(self.policy) or [])
            followed = old.routes if replay is None else replay.with_mask(old.routes.mask)
            acc.add(EXPERT_STEP, expert_step_parts(rms, followed, owner=self.dist.is_writer), expert_step_finalize)
        self.snapshot(step, rollout, old.routes)
        # the rewards' metrics pooled over every rank's rows
        return {**sampled.metrics, **aggregate(updates), **acc.finalize(self.dist.merge)}

    def prompts_for(self, step: int) -> list[dict]:
        """The P (x `rollout.staleness`) examples of `step`: a seeded permutation, the same for every arm of a seed."""
        P = self.prompts
        n = len(self.order)
        return [self.train_examples[self.order[(step * P + i) % n]] for i in range(P)]

    def rollout(self, step: int) -> Sampled:
        """1. This rank's rollouts of `step`, their rewards and the rewards' (and engine's) metrics."""
        cfg = self.cfg
        if self.rollout_policy is not self.policy:  # the "inference engine" syncs weights each step
            live = self.dist.full_state_dict(self.policy)
            self.rollout_policy.load_state_dict(live if self.lag is None else self.lag.behaviour(live))
        examples = self.dist.shard(self.prompts_for(step))  # this rank's whole groups (all in a world of size 1)
        prompts, metrics = [e["prompt"] for e in examples], {}
        sampling = dict(
            group_size=cfg.rollout.group_size,
            max_new_tokens=cfg.task.max_new_tokens,
            temperature=cfg.rollout.temperature,
        )
        if self.engine is not None:
            record = cfg.rollout.record_routes
            rollout, metrics = self.engine.rollout(
                self.policy, self.tokenizer, prompts, step=step, seed=cfg.seed, record_routes=record, **sampling
            )
        else:
            rows = self.dist.batch_rows(self.prompts, cfg.rollout.group_size)
            record = cfg.rollout.record_routes and self.routed and self.uses_rollout_routes(step)
            with anchored_by(self.anchor, self.rollout_policy):  # anchored: each token takes the cold start's routes
                rollout = generate(
                    self.rollout_policy,
                    self.tokenizer,
                    prompts,
                    seed=cfg.seed * 1_000_003 + step,
                    record_routes=record,
                    rows=rows,
                    **sampling,
                )
        group = [e for e in examples for _ in range(cfg.rollout.group_size)]
        scores = self.task.score(rollout.completions, group)
        rewards = torch.tensor(scores.rewards)
        zero_var = zero_variance_frac(rewards, cfg.rollout.group_size)
        if zero_var == 1.0 and not self.warned_no_signal and self.dist.is_writer:  # every advantage is 0
            self.warned_no_signal = True
            message = no_signal_warning(step, rewards.mean().item())
            log.warning(message)
            note_meta(self.writer.dir / "meta.json", "warnings", message)
        return Sampled(
            rollout, rewards, {REWARD_ZERO_VAR_GROUP_FRAC: zero_var, REWARD_ERRORS: float(scores.errors), **metrics}
        )

    def uses_rollout_routes(self, step: int) -> bool:
        """Whether `step` reads the routes its rollout chose: R3 replays them on every step, the route
        instruments (`route/rollout_vs_old/*`) and the route snapshots on their own steps."""
        cfg = self.cfg
        snapshot = bool(cfg.snapshot_every) and step % cfg.snapshot_every == 0
        return self.replay_mode.replays_rollout or instruments_due(step, cfg.metrics.route_every) or snapshot

    def old_pass(self, rollout: Rollout, *, instruments: bool = True, anchor: Routes | None = None) -> OldPass:
        """2. The old-policy pass (`moe_rl.loop.passes.old_pass`) with this run's policy, replay mode and `anchor`."""
        cfg = self.cfg
        return old_pass(
            self.policy,
            rollout,
            self.replay_mode if self.routed else None,
            instruments=instruments,
            scores=instruments or cfg.algo.router_shift,
            threshold=self.replay_threshold,
            temperature=cfg.rollout.temperature,
            anchor=anchor,
        )

    def engine_gap(self, rollout: Rollout, old: OldPass) -> EngineWeight | None:
        """3. The behaviour (rollout) / trainer gap's weight per token (`rollout.is_correction`, None: none),
        constant over the updates; under a lag without one, the plain pi_prox / pi_behav (`behaviour_weight_kwargs`)."""
        c = self.cfg.rollout
        if c.is_correction == "none" and self.lag is None:
            return None
        kwargs = dict(correction=c.is_correction, level=c.is_level, cap=c.is_cap, low=c.is_low, high=c.is_high)
        if c.is_correction == "none":
            kwargs = behaviour_weight_kwargs(token_loss=get_loss(self.cfg.algo.name).weighs_tokens)
        return engine_weight(old_logp=old.logp, rollout_logp=rollout.rollout_logp, mask=rollout.response_mask, **kwargs)

    def updates(self, step: int, batch: Batch) -> list[dict[str, float]]:
        """4. The N x S (`rollout.staleness`) updates of `step`, on a seeded shuffle of the global batch into as many
        mini-batches (this rank's rows of each; all of them in a world of size 1). On the route instruments' steps
        (`metrics.route_every`), the ratio split on every `replay.split_every`-th of them, on `metrics.split_rows`
        rows of each mini-batch drawn from a generator of the split's own (`split_seed`)."""
        cfg = self.cfg
        B = self.dist.global_rows(len(batch.rollout))
        N = minibatch_count(cfg.optim.updates_per_rollout, cfg.rollout.staleness)
        perm = torch.randperm(B, generator=torch.Generator().manual_seed(cfg.seed * 7919 + step))
        first = self.dist.first_row(self.prompts, cfg.rollout.group_size)
        instruments = instruments_due(step, cfg.metrics.route_every)
        split = instruments and cfg.replay.split_every > 0 and step % cfg.replay.split_every == 0
        minibatches = perm.chunk(N)
        picks: list[torch.Tensor | None] = [None] * N
        if split and cfg.metrics.split_rows is not None:
            generator = torch.Generator().manual_seed(split_seed(cfg.seed, step))
            picks = [split_subsample(len(rows), cfg.metrics.split_rows, generator) for rows in minibatches]
        plan = scored_updates(step, cfg.metrics.update_kl_window, cfg.metrics.route_every, N)  # kl/update_k3's schedule
        kls = kl_rows(cfg.metrics.update_kl_rows, cfg.seed, step, minibatches, first, len(batch.rollout), plan)
        self.policy.train()
        chunks = self.dist.chunks(minibatches, first, len(batch.rollout))
        metrics = []
        for rows, minibatch, picked, kl in zip(chunks, minibatches, picks, kls):
            scored = None if picked is None else local_positions(minibatch, picked, first, len(batch.rollout))
            metrics.append(self.update(batch, rows, instruments=instruments, split=split, split_rows=scored, kl=kl))
        self.policy.eval()
        return metrics

    def update(
        self,
        batch: Batch,
        rows: torch.Tensor,
        *,
        instruments: bool = True,
        split: bool = False,
        split_rows: torch.Tensor | None = None,
        kl: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer update on mini-batch `rows` of `batch`; its metrics pooled over every rank's rows.
        With `instruments`, its route/ metrics; else the pass records only what the loss needs (RSPO's router
        scores) and replays what the mode replays. With `split`, the same weights also score the rows at
        positions `split_rows` of `rows` (None: all of them) under the other routing (`other_routing_logp`)
        for the ratio split (docs/design.md §3). The rows at positions `kl` also give `kl/update_k3` (None: none)."""
        cfg = self.cfg
        rollout, old = batch.rollout, batch.old
        mask, old_logp = rollout.response_mask[rows], old.logp[rows]
        replay = batch.replay[rows] if batch.replay is not None else None
        forced_weights = old.weights[rows] if old.weights is not None and replay is not None else None
        recorded = old.routes is not None and (instruments or cfg.algo.router_shift)  # None: a dense model
        routed = (
            RoutedPass(self.policy, replay, scores=True, threshold=self.replay_threshold, replay_weights=forced_weights)
            if recorded
            else None
        )
        # no record needed: the replay alone (the same hook the recorded pass runs), or the plain forward
        replayed = (
            RouteReplay(self.policy, replay, threshold=self.replay_threshold, weights=forced_weights)
            if not recorded and replay is not None
            else None
        )
        with routed or replayed or contextlib.nullcontext(), self.expert_step.counting(instruments):
            forward = self.forward(self.train_policy, rollout, rows, temperature=cfg.rollout.temperature)
        logp, logits = forward[0], forward[1]
        acc = Metrics()
        acc.add("ratio", ratio_parts(logp=logp.detach(), old_logp=old_logp, mask=mask), ratio_finalize)
        routes = None
        if routed is not None and old.routes is not None:  # the route metrics' (and RSPO's) inputs
            valid, thresholded = rollout.token_mask[rows], self.replay_threshold is not None
            routes = update_routes(routed, old, rows, replay, valid, instruments=instruments, thresholded=thresholded)
            if instruments:
                lengths = dict(prompt_len=rollout.prompt_len, max_new_tokens=cfg.task.max_new_tokens)
                route_metrics(acc, routes, mask, position_bucket=cfg.position_bucket, **lengths)
        other = None
        if split and routes is not None:  # a dense model has no routing to split
            other = split_pass(self.other_routing_logp, rollout, rows, replay, routes.old, split_rows)
        ref_logp = None
        if self.ref is not None:
            with torch.no_grad():
                ref_logp, _ = forward_logp(self.ref, rollout, rows, temperature=cfg.rollout.temperature)
        shift_scale = None
        if cfg.algo.router_shift and routes is not None:  # RSPO (refused for dense)
            # sg[max(gamma_t, floor)] from the scores this pass already has
            gamma = router_shift_ratio(routes.old_scores, routes.scores, routes.old, mask)
            shift_scale = gamma.clamp(min=cfg.algo.router_shift_floor).to(logp.dtype)
            router_shift_metrics(acc, shift_scale, mask, cfg.algo.router_shift_floor)
        weight = batch.correction.weight[rows] if batch.correction is not None else None
        loss, loss_metrics = self.loss_fn(
            logp=logp,
            old_logp=old_logp,
            adv=batch.adv[rows],
            mask=mask,
            ref_logp=ref_logp,
            weight=weight,
            ratio_scale=shift_scale,
            **self.loss_kwargs,
        )
        loss, loss_metrics = with_router_terms(loss, loss_metrics, forward, cfg.algo)  # + aux and z-loss terms if on
        acting = replay if self.replay_mode.anchored else None  # anchored: the policy samples with these routes too
        step_kl = update_kl(self.policy, rollout, rows, kl, logp, replay is not None, cfg.rollout.temperature, acting)
        self.optimizer.zero_grad(set_to_none=True)
        self.dist.scale_loss(loss, loss_metrics.weights[LOSS]).backward()  # loss itself in a world of size 1
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.optim.max_grad_norm)
        scaled = self.expert_step.scaled(self.dist.total)  # load_aware: the tokens counted over every process
        if torch.isfinite(loss) and torch.isfinite(grad_norm):
            with scaled:
                self.optimizer.step()
        acc.put(self.expert_step.observed)  # optim/expert_step/active, move_active on the instruments' updates
        self.scheduler.step()
        if step_kl is not None:  # the update's own step (docs/design.md §3)
            step_kl.emit(acc, mask)
        with torch.no_grad():
            entropy = (token_entropy(logits, cfg.rollout.temperature) * mask).sum() / mask.sum().clamp(min=1)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm is a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        loss_value, grad, mean_entropy, tokens = torch.stack(
            [loss.detach().double(), grad_norm.double(), entropy.double(), mask.sum().double()]
        ).tolist()  # one transfer
        means = {**loss_metrics, LOSS: loss_value, POLICY_ENTROPY: mean_entropy}
        acc.add("loss", mean_parts(means, {**loss_metrics.weights, POLICY_ENTROPY: tokens}), mean_finalize)
        acc.put({OPTIM_GRAD_NORM: grad})
        if other is not None and routes is not None:
            assert loss_metrics.clipped is not None  # every loss of moe_rl.algos returns it
            split_metrics(acc, routes, other, loss_metrics.clipped, logp.detach(), old_logp, mask)
        return acc.finalize(self.dist.merge)

    def other_routing_logp(
        self, rollout: Rollout, rows: torch.Tensor, replay: Routes | None, old: Routes
    ) -> tuple[torch.Tensor, Routes]:
        """The ratio split's pass with the current weights (`moe_rl.loop.split.other_routing_logp`)."""
        return other_routing_logp(self.policy, rollout, rows, replay, old, temperature=self.cfg.rollout.temperature)

    def snapshot(self, step: int, rollout: Rollout, old_routes: Routes | None) -> None:
        """5. The old pass's and the rollout's routes of `step`, every `snapshot_every` steps (rank 0)."""
        cfg = self.cfg
        if old_routes is None or not cfg.snapshot_every or step % cfg.snapshot_every or not self.dist.is_writer:
            return
        folder = self.writer.dir / "routes"
        folder.mkdir(parents=True, exist_ok=True)
        for name, routes in (("old", old_routes), ("rollout", rollout.routes)):
            if routes is not None:
                write_atomic(folder / f"step_{step:05d}_{name}.safetensors", routes.to_safetensors(rollout.inputs))

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out examples, and pass@k where `pass_at_k.k` asks for it (anchored: as sampled)."""
        t, cfg, p = time.perf_counter(), self.cfg, self.cfg.pass_at_k
        passes = dict(ks=list(p.k), n=p.n, temperature=p.temperature, seed=cfg.seed)
        args = (self.policy, self.tokenizer, self.eval_examples, self.task)
        with anchored_by(self.anchor, self.policy):
            metrics = held_out_metrics(*args, max_new_tokens=cfg.task.max_new_tokens, **passes)
        return {**metrics, TIME_EVAL_S: time.perf_counter() - t}

    # --- the loop -----------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """This world's checkpoint of `step` (`moe_rl.loop.checkpoint.save_state`)."""
        save_state(self.dist, self.run_state(), step)

    def resume(self) -> int:
        """Restore the last checkpoint if there is one; return the last completed step (0: none)."""
        return restore_state(self.dist, self.run_state())

    def run_state(self) -> RunState:
        """What a checkpoint saves and restores of this run, the RNG aside."""
        cold_start_key = self.cold_info.get("key")
        return RunState(
            self.policy, self.optimizer, self.scheduler, self.ref, self.writer, self.history, cold_start_key, self.lag
        )

    def run(self) -> dict[str, Any]:
        """Resume or start, run the remaining steps, and leave a truthful status.json whatever happens."""
        with run_log(self.writer.dir):
            try:
                return self._run()
            finally:
                if self.engine is not None:
                    self.engine.close()

    def _run(self) -> dict[str, Any]:
        cfg, writer = self.cfg, self.writer
        start = time.perf_counter()
        prior = read_status(writer.dir)
        status = RUNNING
        last = prior.get("steps_done", 0) if prior.get("config_hash") == writer.config_hash else 0
        progress = None
        try:
            step = last = done = self.resume()  # refuses a directory of another config before writing into it
            self._open_folder(done)
            accuracy = self._first_evaluation() if done == 0 else None
            seen_triggers = {e["trigger"] for e in writer.events}
            progress = Progress(
                total=cfg.steps,
                initial=done,
                desc=f"{writer.keys['run']} {cfg.arm}",
                bar=cfg.progress,
                every=cfg.log_every,
                accuracy=accuracy,
            )
            for step in range(done + 1, cfg.steps + 1):
                metrics = self._logged_step(step)
                last = step
                judge_step(self.history, writer, cfg.collapse, step, metrics, seen_triggers)
                progress.update(step, metrics)
                if "nonfinite" in seen_triggers:
                    status = DIVERGED
                    break
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps:
                    writer.flush(RUNNING, step, time.perf_counter() - start)  # metrics first, then state
                    self.save(step)
            else:
                status = COLLAPSED if writer.events else COMPLETED
            verdict = (
                None
                if status != COMPLETED
                else signal_verdict(
                    self.history,
                    writer,
                    cfg.signal,
                    completions_per_step=self.prompts * cfg.rollout.group_size,
                    cold_start=self.cold_info,
                )
            )
            status = verdict.status if verdict is not None else status
            if cfg.keep_checkpoint:  # the final weights (every world: Dist.save), for `python -m moe_rl.export`
                self.save(step)
            writer.flush(status, step, time.perf_counter() - start, reason=verdict.reason if verdict else None)
        except RunDirectoryError:  # another run's folder: left as it is
            raise
        except Exception as err:  # resume, step-0 evaluation, a step (setup: see train()): failed, with why
            if self.dist.active and peer_lost(err):  # another rank was killed: interrupted, resumable
                writer.flush(RUNNING, last, time.perf_counter() - start)
                log.error("another process of this run died (%s); rerun the same command to resume", str(err)[:200])
                raise
            status = FAILED
            writer.flush(status, last, time.perf_counter() - start, error=err)
            log.error("run failed: %s: %s (traceback in %s)", type(err).__name__, err, writer.dir / "train.log")
            raise
        except BaseException:  # interrupted (Ctrl-C, SIGTERM -> SystemExit): resumable
            writer.flush(RUNNING, last, time.perf_counter() - start)
            raise
        finally:
            if progress is not None:
                progress.close()
            writer.close_backends(status)
        if status in FINISHED and not cfg.keep_checkpoint:
            self.dist.remove_checkpoint(writer.dir)
        return {"status": status, "steps_done": step, "events": writer.events, "dir": str(writer.dir)}

    def _open_folder(self, done: int) -> None:
        """config.yaml, meta.json and, on rank 0 like the run folder, the live logging backends."""
        cfg, writer = self.cfg, self.writer
        writer.write_config(cfg.to_dict())
        run_meta = {"numerics": cfg.numerics, "compiled": self.compiled, **self.dist.meta()}
        writer.write_meta(cold_start=self.cold_info, resumed_after_step=done, **run_meta)
        if self.dist.is_writer:
            writer.backends = open_loggers(
                cfg.logger,
                writer.dir,
                keys=writer.keys,
                config=cfg.to_dict(),
                results_dir=cfg.results_dir,
                resumed_after=done,
            )

    def _first_evaluation(self) -> float:
        """Step 0's evaluation, logged; its accuracy is the accuracy collapse trigger's baseline."""
        first = self.evaluate()
        self.writer.log(0, first)
        self.history[TASK_ACCURACY].append((0, first[TASK_ACCURACY]))
        return first[TASK_ACCURACY]

    def _logged_step(self, step: int) -> dict[str, float]:
        """One step, with the held-out evaluation every `eval_every` steps and at the last, logged."""
        metrics = self.step(step)
        if step % self.cfg.eval_every == 0 or step == self.cfg.steps:
            metrics.update(self.evaluate())
        self.writer.log(step, metrics)
        return metrics


def train(cfg: TrainConfig, *, checked: bool = False) -> dict[str, Any]:
    """Run one training run described by `cfg`; returns its status.

    An invalid config raises before any folder is made; a failure in setup (cold start, data,
    model) leaves status.json `failed` with the exception, like a failure in the loop does.
    `checked`: the caller has validated `cfg` and checked its run folder (experiments/train.py's
    `run_from_hydra`), which happens once per launch.
    """
    if not checked:
        validate(cfg)
        refuse_foreign_dir(cfg, world_size_from_env())  # a refused folder is left as it is: nothing written
    with status_on_failure(run_dir(cfg), config_hash(cfg)):
        trainer = Trainer(cfg, checked=True)
    return trainer.run()
