"""Run configuration: plain dataclasses, the single source of defaults (Hydra registers them too).

`validate(cfg)` rejects bad input before any work starts, naming the key and the valid values: each section's
`check()` refuses its own bad values, then `validate` the keys that only make sense together.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from moe_rl.algos import AGG_MODES, LOSSES, get_loss
from moe_rl.algos.corrections import CORRECTIONS, LEVELS
from moe_rl.algos.optimizers import check_optim
from moe_rl.metrics.collapse import DEFINITIONS as COLLAPSE_DEFINITIONS
from moe_rl.metrics.collapse import MAIN_DEFINITION as COLLAPSE_MAIN_DEFINITION
from moe_rl.metrics.names import KL_EARLY_STEPS
from moe_rl.models import BACKENDS, DENSE_FAMILIES, EXPERTS_IMPLEMENTATIONS, FAMILIES
from moe_rl.models.knob_checks import check_router_knobs
from moe_rl.routing.modes import mode_names, replay_mode
from moe_rl.run.folder import NUMERICS
from moe_rl.run.identity import NOT_IDENTITY as NOT_IDENTITY  # re-exported for existing callers
from moe_rl.run.identity import identity_hash
from moe_rl.run.identity import identity_spec as identity_spec
from moe_rl.tasks import TASKS, GymConfig, check_new_tokens, sized_new_tokens
from moe_rl.tasks.dataset import CHAT_TEMPLATE_MODES, DATASET_TASK
from moe_rl.tasks.gym import GYM_TASK

COLD_START_MODES = ("auto", "sft", "none")
DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64: equivalence tests bound by rounding
ENGINES = ("hf", "vllm")


def _one_of(key: str, value: Any, valid: Any) -> None:
    if value not in valid:
        raise ValueError(f"{key}={value!r} is not valid; valid: {sorted(valid)}")


def _at_least(*checks: tuple[str, Any, int]) -> None:
    """Each (key, value, low): refused when value < low."""
    for key, value, low in checks:
        if value < low:
            raise ValueError(f"{key}={value} must be >= {low}")


@dataclass
class ModelConfig:
    family: str = "qwen3_moe"
    num_layers: int = 2
    num_experts: int = 8
    top_k: int = 2
    hidden_size: int = 64
    moe_intermediate_size: int | None = None  # width of each expert; None: the family's tiny default
    head_dim: int | None = None  # attention head width; None: the family default (16; vLLM on CPU needs >= 32)
    experts_implementation: str | None = None  # None: fastest correct on the device
    checkpoint: str | None = None  # a save_pretrained directory or a hub id instead of a built model
    dtype: str = "float32"  # weights of the training policy, e.g. bfloat16 for a pretrained checkpoint
    # RL-phase router knobs (moe_rl.models.knobs), set after the cold start; MoE models only
    router_frozen: bool = False  # the routers take no gradient and keep the cold start's values (NeMo-RL, verl)
    router_dtype: str = "float32"  # float32: the family's own; float64: router GEMM and softmax in float64 (NeMo-RL)

    def check(self) -> None:
        if self.checkpoint:  # a checkpoint may be of any MoE family: its model_type must match model.family
            _check_checkpoint(self.checkpoint, self.family)
        else:
            _one_of("model.family", self.family, [*FAMILIES, *DENSE_FAMILIES, *BACKENDS])
        _one_of("model.dtype", self.dtype, DTYPES)
        if self.experts_implementation is not None:
            _one_of("model.experts_implementation", self.experts_implementation, EXPERTS_IMPLEMENTATIONS)
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"model.head_dim={self.head_dim} must be >= 1")
        if self.moe_intermediate_size is not None and self.moe_intermediate_size < 1:
            raise ValueError(f"model.moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"model.top_k={self.top_k} must lie in [1, model.num_experts={self.num_experts}] "
                "(top_k = num_experts: soft routing, every expert at its softmax weight)"
            )


def _check_checkpoint(path: str, family: str) -> None:
    config = Path(path) / "config.json"
    if not Path(path).exists() and "/" in path and not path.startswith((".", "/", "~")):
        return  # a hub id: checked when loaded (moe_rl.models.load_model)
    if not config.is_file():
        raise ValueError(f"model.checkpoint={path!r} is not a save_pretrained directory (no config.json)")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type != family:
        raise ValueError(
            f"model.checkpoint={path!r} is a {model_type!r} model but model.family={family!r}; "
            f"set model.family={model_type}"
        )


@dataclass
class TaskConfig:
    name: str = "reversal"
    n_train: int | None = 4000  # None (task=dataset only): every row not held out for evaluation
    n_eval: int = 128
    partial_credit: float = 0.0
    max_new_tokens: int | None = 8
    kwargs: dict[str, Any] = field(default_factory=dict)
    gym: GymConfig = field(default_factory=GymConfig)
    # task=dataset: the user's own data (moe_rl.tasks.dataset) and reward (moe_rl.tasks.rewards)
    path: str | None = None  # jsonl/json/parquet/csv file, or a hub dataset name when online
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    system_prompt: str | None = None
    split: str = "train"  # split of a hub dataset
    chat_template: str = "auto"  # auto: the tokenizer's chat template when it has one; true; false
    reward: str = "exact"  # exact | numeric | math | package.module:function

    def __post_init__(self) -> None:
        self.max_new_tokens = sized_new_tokens(self.name, self.kwargs, self.max_new_tokens)

    def fixed_length(self) -> int | None:
        """The response length a run holds fixed, where its task's kwargs pin one: `min_len = max_len` of a
        synthetic task, `min_digits = max_digits` of a gym task (the addends' digits); None otherwise."""
        kw, lo, hi = (
            (self.gym.kwargs, "min_digits", "max_digits")
            if self.name == GYM_TASK
            else (self.kwargs, "min_len", "max_len")
        )
        return int(kw[lo]) if lo in kw and kw.get(hi) == kw[lo] else None

    def check(self) -> None:
        _one_of("task.name", self.name, [*TASKS, DATASET_TASK, GYM_TASK])
        _one_of("task.chat_template", str(self.chat_template).lower(), CHAT_TEMPLATE_MODES)
        if self.n_train is None and self.name != DATASET_TASK:
            raise ValueError(f"task.n_train=null (every row not held out) needs task=dataset, not task={self.name}")
        if not 0 <= self.partial_credit < 1:
            raise ValueError(
                f"task.partial_credit={self.partial_credit} must lie in [0, 1): 1.0 marks a correct answer"
            )
        if self.name == DATASET_TASK and not self.path:
            raise ValueError("task=dataset needs task.path (a jsonl/json/parquet/csv file or a hub dataset name)")
        self.gym.check(self.name)
        check_new_tokens(self.name, self.kwargs, self.max_new_tokens)
        n_train = 1 if self.n_train is None else self.n_train
        _at_least(("task.n_train", n_train, 1), ("task.n_eval", self.n_eval, 1))


@dataclass
class AlgoConfig:
    name: str = "grpo"
    eps_low: float | None = None  # None: the loss's paper default (a ratio's or weight's clip; dppo: divergence bound)
    eps_high: float | None = None
    agg: str = "seq-mean-token-mean"
    beta: float = 0.0  # k3 KL to the cold-start policy
    aux_loss_coef: float = 0.0  # x the family's load-balancing loss (transformers' aux_loss; TRL: 0.001)
    router_z_loss_coef: float = 0.0  # x ST-MoE's router z-loss (arXiv 2202.08906; ST-MoE: 0.001)
    tau_pos: float | None = None  # sapo: gate temperature for A > 0; None: the paper's 1.0
    tau_neg: float | None = None  # sapo: gate temperature for A <= 0; None: the paper's 1.05
    kl_tau: float | None = None  # dppo_tv, dppo_kl: weight of a (log r)^2 term (prime-rl: 1e-3); None: the paper's 0
    k_pos: float | None = None  # vespo: power k of phi(W) = W^k exp(lambda (1 - W)) for A >= 0; None: the paper's 2
    lambda_pos: float | None = None  # vespo: decay lambda of phi for A >= 0; None: the paper's 3
    k_neg: float | None = None  # vespo: power k of phi for A < 0; None: the paper's 3
    lambda_neg: float | None = None  # vespo: decay lambda of phi for A < 0; None: the paper's 2
    offpolicy_mask_delta: float | None = None  # any loss: drop A<0 sequences, mean log(pi_old/pi) > this; None: off
    router_shift: bool = False  # RSPO (arXiv 2510.23027): token ratio times sg[max(gamma_t, floor)] (token losses)
    router_shift_floor: float = 0.5  # lower bound of the router-shift factor (RSPO's floor)

    def eps(self) -> tuple[float, float]:
        """(eps_low, eps_high) of a loss with a clip range: the ones set here, else the paper's."""
        kwargs = self.loss_kwargs()
        return kwargs["eps_low"], kwargs["eps_high"]

    def loss_kwargs(self) -> dict[str, float]:
        """The loss's own hyperparameters (`Loss.defaults`, its paper's values), with the ones set here, and
        `offpolicy_mask_delta` when set (an option of every loss, applied by the `Loss` record)."""
        kwargs = {
            k: default if getattr(self, k) is None else getattr(self, k)
            for k, default in get_loss(self.name).defaults.items()
        }
        if self.offpolicy_mask_delta is not None:
            kwargs["offpolicy_mask_delta"] = self.offpolicy_mask_delta
        return kwargs

    def check(self) -> None:
        """The loss and its own hyperparameters in range; one set for another loss is refused, not ignored."""
        _one_of("algo.name", self.name, LOSSES)
        _one_of("algo.agg", self.agg, AGG_MODES)
        loss = get_loss(self.name)
        own = loss.defaults
        for key in dict.fromkeys(k for other in LOSSES.values() for k in other.defaults):  # every loss's parameters
            if key not in own and getattr(self, key) is not None:
                raise ValueError(
                    f"algo.{key} is not a parameter of algo.name={self.name!r}; its parameters: {sorted(own)}"
                )
        if outside := loss.out_of_range(self.loss_kwargs()):  # each in its range (`Loss.ranges`)
            raise ValueError(f"algo.{outside}")
        if loss.clip == "ratio":  # a clipped weight: no lower bound (eps_low 1) by default
            eps_low, eps_high = self.eps()
            if eps_high < eps_low:
                raise ValueError(f"algo.eps_high={eps_high} < algo.eps_low={eps_low}")
        delta = self.offpolicy_mask_delta
        if delta is not None and not delta >= 0:
            raise ValueError(
                f"algo.offpolicy_mask_delta={delta} must be >= 0: a negative-advantage sequence is dropped when its mean "
                "log(pi_old / pi) per token exceeds it (null: no mask)"
            )
        if self.router_shift and not loss.takes_ratio_scale:
            raise ValueError(
                f"algo.router_shift rescales token ratios; algo.name={self.name!r} has none. "
                f"Use one of {[name for name, other in LOSSES.items() if other.takes_ratio_scale]}"
            )
        if not 0 < self.router_shift_floor <= 1:
            raise ValueError(f"algo.router_shift_floor={self.router_shift_floor} must lie in (0, 1]")


@dataclass
class ReplayConfig:
    mode: str = "none"
    threshold: float = 0.5  # *_threshold modes: keep a replayed expert scoring >= this x the weakest live top-k
    split_every: int = 1  # ratio/split/* on every K-th of the route instruments' steps (metrics.route_every); 0: never

    def check(self) -> None:
        _one_of("replay.mode", self.mode, mode_names())
        if self.threshold < 0:
            raise ValueError(f"replay.threshold={self.threshold} must be >= 0")
        _at_least(("replay.split_every", self.split_every, 0))


@dataclass
class RolloutConfig:
    prompts_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.0
    dtype: str = "float32"  # e.g. bfloat16 to widen the inference/training gap on purpose
    record_routes: bool = True  # record routes during generation (R3 needs them; rollout_vs_old uses them)
    engine: str = "hf"  # hf: the policy's own KV-cache sampling; vllm: an in-process vLLM engine (rollout/engine.py)
    engine_sync_every: int = 1  # vllm: sync the trainer's weights every K steps (K > 1: stale, off-policy)
    is_correction: str = "none"  # engine-gap weight on the policy term: none | tis | mis | icepop
    is_level: str = "token"  # token | sequence: the behaviour/trainer ratio per token or per sequence (product)
    is_cap: float = 2.0  # tis / mis: truncate at / drop above this ratio
    is_low: float = 0.5  # icepop: tokens whose ratio lies outside [is_low, is_high] are masked
    is_high: float = 5.0  # icepop: upper end of the band
    staleness: int = 1  # S: S x prompts_per_step prompts per rollout, one pass in S x N updates (VESPO's staleness)
    policy_lag: int = 0  # k: each rollout sampled by the policy of k steps before (AReaL's decoupled loss)

    def check(self) -> None:
        _one_of("rollout.dtype", self.dtype, DTYPES)
        _one_of("rollout.engine", self.engine, ENGINES)
        # the staleness axes (moe_rl.loop.staleness): a lag needs an engine that samples with a lagged copy; the vLLM
        # engine is synced in place from the trainer's live weights (its own lag: engine_sync_every)
        if self.staleness < 1:
            raise ValueError(
                f"rollout.staleness={self.staleness} must be >= 1 (1: one rollout of prompts_per_step prompts)"
            )
        if self.policy_lag < 0:
            raise ValueError(
                f"rollout.policy_lag={self.policy_lag} must be >= 0 (0: each rollout sampled by the live policy)"
            )
        if self.policy_lag and self.engine != "hf":
            raise ValueError(
                f"rollout.policy_lag={self.policy_lag} samples with a lagged copy of the policy on rollout.engine=hf; "
                f"rollout.engine={self.engine!r} holds the live weights (its own lag: rollout.engine_sync_every)"
            )
        if self.engine_sync_every < 1:
            raise ValueError(f"rollout.engine_sync_every={self.engine_sync_every} must be >= 1")
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size={self.group_size} must be >= 2 (group-normalised advantages)")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be > 0")
        _one_of("rollout.is_correction", self.is_correction, ["none", *CORRECTIONS])
        _one_of("rollout.is_level", self.is_level, LEVELS)
        if not (self.is_cap > 0 and 0 <= self.is_low <= 1 <= self.is_high):
            raise ValueError(
                f"need rollout.is_cap > 0 and is_low <= 1 <= is_high, got is_cap={self.is_cap}, "
                f"is_low={self.is_low}, is_high={self.is_high}"
            )
        _at_least(("rollout.prompts_per_step", self.prompts_per_step, 1))


@dataclass
class OptimConfig:
    lr: float = 1e-4
    updates_per_rollout: int = 4  # N mini-batches per rollout batch; updates 2..N are off-policy (Qwen's off-policy N)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_updates: int = 0  # linear learning-rate warm-up over this many optimizer updates
    router_lr_scale: float = 1.0  # the routers' lr is lr x this (NeMo Automodel: 0.1); MoE models only
    expert_lr_scale: float = 1.0  # the routed experts' lr is lr x this; MoE models only
    mlp_lr_scale: float = 1.0  # a dense model's MLP lr is lr x this (muP: 128 / MLP width); dense models only
    name: str = "adamw"  # adamw | sign: sign-SGD with decoupled weight decay (prime-rl; moe_rl/algos/optimizers.py)
    eps: float = 1e-8  # AdamW's eps; 1e-6 or 1e-5 make rarely used experts' steps SGD-like
    expert_step: str = "plain"  # plain; load_aware: each expert's step x min(1, n_e / mean n), n_e its tokens

    def check(self) -> None:
        check_optim(**vars(self))


COLD_START_TARGETS = ("greedy", "sampled")  # what cold_start.target is compared with (moe_rl.loop.cold_start)


@dataclass
class ColdStartConfig:
    band: list[float] = field(default_factory=lambda: [0.2, 0.6])  # eval accuracy [low, high] where RL has signal
    lr: float = 3e-3
    batch_size: int = 64
    max_steps: int = 3000
    eval_every: int = 25
    seed: int = 0
    cache_dir: str = ".cache/cold_start"
    mode: str = "auto"  # auto: SFT a built model, none for a checkpoint; sft; none
    patience: int | None = None  # stop after this many evals with no new best (0: never; None: 10 for dataset, else 0)
    target: float | None = None  # matched starts: stop once `target_metric` reaches it (None: the band's low edge)
    target_metric: str = "greedy"  # greedy: held-out greedy accuracy; sampled: held-out mean reward at temperature 1
    pool: int = 1
    n_train: int | None = None
    compile: bool = False  # the SFT steps compiled (inductor): another numerics domain, so another start
    beta2: float = 0.999  # AdamW's beta2 in the SFT steps (torch's default; the RL updates use 0.99)
    warmup_steps: int = 0  # the SFT lr ramps linearly from lr/warmup_steps to lr over these first steps (0: constant)

    def check(self) -> None:
        _one_of("cold_start.mode", self.mode, COLD_START_MODES)
        _at_least(
            ("cold_start.eval_every", self.eval_every, 1),
            ("cold_start.batch_size", self.batch_size, 1),
            ("cold_start.max_steps", self.max_steps, 1),
            ("cold_start.patience", self.patience or 0, 0),
            ("cold_start.pool", self.pool, 1),
            ("cold_start.n_train", 1 if self.n_train is None else self.n_train, 1),
            ("cold_start.warmup_steps", self.warmup_steps, 0),
        )
        if not 0 <= self.beta2 < 1:
            raise ValueError(f"cold_start.beta2={self.beta2} must lie in [0, 1) (AdamW's second-moment decay)")
        if len(self.band) != 2 or not 0 <= self.band[0] <= self.band[1] <= 1:
            raise ValueError(f"cold_start.band={list(self.band)} must satisfy 0 <= low <= high <= 1")
        _one_of("cold_start.target_metric", self.target_metric, COLD_START_TARGETS)
        if self.target is not None and not 0 < self.target <= 1:
            raise ValueError(f"cold_start.target={self.target} must lie in (0, 1] (a reward or an accuracy)")


@dataclass
class CollapseConfig:
    """In-loop collapse labels (moe_rl.metrics.collapse.detect_collapse); analysis can recompute any definition.

    The defaults are the analysis' main definition (`moe_rl.analysis.collapse_definitions`), so a run's
    status.json and its report agree unless a run sets other values.
    """

    reward_window: int = 10
    reward_drop_frac: float = 0.5
    reward_floor: float = 0.2
    entropy_floor: float = 0.05
    entropy_window: int = 10
    definition: str = COLLAPSE_MAIN_DEFINITION  # relative: vs the run's own start; absolute: vs its best reward
    baseline_window: int = 10
    accuracy_drop_frac: float = 0.5
    accuracy_patience: int = 2

    def check(self) -> None:
        _one_of("collapse.definition", self.definition, COLLAPSE_DEFINITIONS)


@dataclass
class DistConfig:
    """How a torchrun launch splits one run across processes (ignored without torchrun; moe_rl.loop.distributed)."""

    strategy: str = "fsdp"  # fsdp: FSDP2 fully_shard per decoder layer, then the root; ddp: full replicas
    timeout_s: float = 1800.0  # a collective waiting this long for a dead peer raises instead of hanging

    def check(self) -> None:
        _one_of("dist.strategy", self.strategy, ("fsdp", "ddp"))


@dataclass
class SignalConfig:
    """When a run that ran all its steps is labelled useless instead of `completed` (moe_rl.metrics.verdict)."""

    no_signal_steps: int = 20  # this many straight steps (all, if fewer) of zero-variance groups: no_signal; 0: never
    max_reward_error_frac: float = 0.5  # the reward raised on more than this share of all completions: reward_failed

    def check(self) -> None:
        if self.no_signal_steps < 0 or not 0 <= self.max_reward_error_frac <= 1:
            raise ValueError(
                f"signal.no_signal_steps={self.no_signal_steps} must be >= 0 and "
                f"signal.max_reward_error_frac={self.max_reward_error_frac} in [0, 1]"
            )


@dataclass
class PassAtKConfig:
    """Sampled evaluation on the held-out split: `eval/pass@{k}` (unbiased estimator, arXiv 2107.03374)."""

    k: list[int] = field(default_factory=list)  # e.g. [1, 4]; empty: off
    n: int = 8  # samples per held-out prompt (n >= max k)
    temperature: float = 1.0

    def check(self) -> None:
        if self.k and (min(self.k) < 1 or max(self.k) > self.n):
            raise ValueError(f"pass_at_k.k={list(self.k)} must lie in [1, pass_at_k.n={self.n}]")
        if self.temperature <= 0:
            raise ValueError(f"pass_at_k.temperature={self.temperature} must be > 0")


@dataclass
class MetricsConfig:
    """How often the route instruments run, and on how many rows (docs/design.md §3).

    Outcome metrics (rewards, accuracy, loss, the update's ratio statistics, entropy, gradient norm, the
    collapse checks) come with every step's work. The route instruments cost their own work: router scores
    and route comparisons in every update, and the ratio split's extra no-grad forward. They run on the
    steps that are multiples of `route_every`, and the split scores a seeded subsample of each update's rows.
    """

    route_every: int = 10
    split_rows: int | None = 24
    update_kl_rows: int | None = 8
    update_kl_window: int | None = KL_EARLY_STEPS

    def check(self) -> None:
        """`route_every` an integer >= 1 and `split_rows` one >= 1 or null (bools are refused: YAML reads `yes`
        as true, which Python would count as 1)."""

        def whole(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        every, rows = self.route_every, self.split_rows
        _at_least(("metrics.update_kl_rows", self.update_kl_rows or 0, 0))
        _at_least(("metrics.update_kl_window", self.update_kl_window or 0, 0))
        if not whole(every) or every < 1:
            raise ValueError(
                f"metrics.route_every={every!r} must be an integer >= 1: the route instruments run on the steps "
                "that are multiples of it (1: every step)"
            )
        if rows is not None and (not whole(rows) or rows < 1):
            raise ValueError(
                f"metrics.split_rows={rows!r} must be an integer >= 1 (rows of each update the ratio split scores) "
                "or null (all of them)"
            )


@dataclass
class TrainConfig:
    out_dir: str | None = None  # the run folder (a sweep's folder under -m); None: see run_dir()
    experiment: str = "default"
    rung: str | None = None  # an ablation ladder's rung (experiments/conf/rung/), a run key with the cold-start seed
    results_dir: str = "runs"  # new runs go under results_dir/experiment/ (untracked; results/ is shipped)
    logger: list[str] = field(default_factory=lambda: ["parquet"])  # + tensorboard, wandb, mlflow, trackio
    log_every: int = 10  # with progress=false: one progress line every this many steps
    dry_run: bool = False  # validate and resolve the config, then stop (for sweep dry runs)
    seed: int = 0
    steps: int = 300
    eval_every: int = 25
    eval_size: int = 128
    snapshot_every: int = 20  # route snapshots (routes/step_*.safetensors) every this many steps; 0: never
    position_bucket: int = 4  # response positions per bucket of route/*/flip_rate/pos_*
    checkpoint_every: int = 25  # save model/optimizer/RNG state and flush metrics every K steps; 0: never
    keep_checkpoint: bool = False  # keep checkpoint.pt, with the final step's weights, after the run (moe_rl.export)
    fault_nan_step: int | None = None  # testing hook: corrupt a router weight with NaN at this step
    device: str = "cpu"
    threads: int | None = None
    numerics: str = "native"  # avx2: ATen, MKL, oneDNN on AVX2 paths (bitwise on one CPU model: docs/reproducing.md)
    compile: bool = False  # torch.compile the policy (inductor): moe_rl.loop.compiled, docs/performance.md
    progress: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    # an older preset's declared analysis, as its shipped runs' configs record it: read by nothing (a study's
    # design is its declaration in experiments/conf/study/), kept so that those configs load as they are
    analysis: dict[str, Any] = field(default_factory=dict)
    signal: SignalConfig = field(default_factory=SignalConfig)
    pass_at_k: PassAtKConfig = field(default_factory=PassAtKConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def arm(self) -> str:
        """`algo+replay`, then `+rspo`, the engine-gap correction and `+opsm=delta` (the off-policy sequence mask)
        when they are on, and `+key=value` for each loss hyperparameter set away from its paper's value (e.g.
        `sapo+none+tau_pos=5+tau_neg=5`), so that two arms of one loss never share a name."""
        parts = [self.algo.name, self.replay.mode]
        if self.algo.router_shift:
            parts.append("rspo")
        if self.rollout.is_correction != "none":
            parts.append(self.rollout.is_correction)
        if self.algo.offpolicy_mask_delta is not None:
            parts.append(f"opsm={self.algo.offpolicy_mask_delta:g}")
        if self.algo.name in LOSSES:
            defaults = get_loss(self.algo.name).defaults
            moved = {k: getattr(self.algo, k) for k, v in defaults.items() if getattr(self.algo, k) not in (None, v)}
            parts += [f"{k}={v:g}" for k, v in moved.items()]
        return "+".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_dir(cfg: TrainConfig) -> str:
    """The run folder: `out_dir` when set, else `results_dir/experiment/single/default`."""
    return cfg.out_dir or str(Path(cfg.results_dir) / cfg.experiment / "single" / "default")


def config_hash(cfg: TrainConfig) -> str:
    """Identity of what a run computes: resuming or skipping a run directory requires it to match
    (`moe_rl.run.identity.identity_hash` of the config's dict)."""
    return identity_hash(cfg.to_dict())


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The typed config of Hydra's composed `cfg` (Hydra has already checked the types against the dataclasses)."""
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):
        raise TypeError(f"expected a TrainConfig-structured config, got {type(obj).__name__}")
    return obj


def validate(cfg: TrainConfig) -> TrainConfig:
    """Raise ValueError naming the first invalid key (ImportError for a logger whose package is
    missing); return `cfg` unchanged otherwise."""
    from moe_rl.run.loggers import check_loggers

    check_loggers(list(cfg.logger))
    for f in fields(cfg):  # each section's own keys, in the order TrainConfig declares the sections
        if is_dataclass(f.default_factory):  # a section (the other fields are the run's own keys and `analysis`)
            getattr(cfg, f.name).check()
    _one_of("numerics", cfg.numerics, NUMERICS)
    if cfg.steps < 1:
        raise ValueError(f"steps={cfg.steps} must be >= 1")
    _at_least(
        ("checkpoint_every", cfg.checkpoint_every, 0),
        ("snapshot_every", cfg.snapshot_every, 0),
        ("eval_every", cfg.eval_every, 1),
        ("eval_size", cfg.eval_size, 1),
        ("position_bucket", cfg.position_bucket, 1),
        ("log_every", cfg.log_every, 0),
    )
    # the keys that only make sense together
    family, mode = cfg.model.family, cfg.replay.mode
    if family in DENSE_FAMILIES and replay_mode(mode).replays:
        raise ValueError(
            f"replay.mode={mode!r} replays expert routes, but model.family={family!r} is "
            "dense (no MoE layer to route); use replay.mode=none"
        )
    if family in DENSE_FAMILIES and cfg.algo.router_shift:
        raise ValueError(
            f"algo.router_shift rescales ratios by the router's shift, but model.family={family!r} is "
            "dense (no router); use algo.router_shift=false"
        )
    if family in BACKENDS and not cfg.device.startswith("cuda"):
        raise ValueError(f"model.family={family!r} runs on CUDA only; set device=cuda")
    if family in BACKENDS and cfg.rollout.dtype == "float16":
        raise ValueError(
            "model.family='megablocks' computes experts in bfloat16; rollout.dtype=float16 is not supported"
        )
    if cfg.numerics != "native" and cfg.device != "cpu":
        raise ValueError(f"numerics={cfg.numerics!r} pins CPU kernels; on device={cfg.device!r} use numerics=native")
    if "float64" in (cfg.model.dtype, cfg.rollout.dtype) and (family in BACKENDS or cfg.rollout.engine != "hf"):
        raise ValueError(
            "float64 runs on the transformers model with rollout.engine=hf only (vLLM and MegaBlocks have no float64 kernels)"
        )
    if cfg.rollout.engine == "vllm":
        from moe_rl.rollout.engine import check_engine_config

        check_engine_config(cfg)
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    n = cfg.optim.updates_per_rollout
    if n < 1 or batch % n:
        raise ValueError(
            f"optim.updates_per_rollout={n} must divide the rollout batch "
            f"rollout.prompts_per_step*rollout.group_size={batch}"
        )
    if replay_mode(mode).replays_rollout and not cfg.rollout.record_routes:
        raise ValueError(f"replay.mode={mode!r} replays rollout routes, but rollout.record_routes=false records none")
    if (
        cfg.rollout.is_correction != "none"
        and cfg.rollout.is_level == "token"
        and not get_loss(cfg.algo.name).weighs_tokens
    ):
        raise ValueError(
            f"algo.name={cfg.algo.name!r} is a sequence loss: a token-level rollout.is_correction needs is_level=sequence"
        )
    check_router_knobs(cfg.model, cfg.optim, cfg.algo, engine=cfg.rollout.engine)
    return cfg
