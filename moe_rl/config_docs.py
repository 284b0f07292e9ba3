"""Generate `docs/config.md`: every config key with its default and meaning.

    python -m moe_rl.config_docs            # rewrites docs/config.md

The keys and defaults come from the dataclasses of `moe_rl.config`; a key's meaning is the comment
on its line there, else the entry in `MEANINGS` below. A test fails when the page is stale or a
key has no meaning.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

from moe_rl import config
from moe_rl.algos import LOSSES
from moe_rl.routing.modes import REPLAY_MODES

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"

# meanings of keys whose line in moe_rl/config.py carries no comment
MEANINGS = {
    "analysis": "an older preset's declared analysis, as the configs of its shipped runs record it; nothing reads "
    "it (a study's design is its declaration in experiments/conf/study/)",
    "experiment": "the run's name: runs go to `results_dir/experiment/`; `experiment=NAME` needs no file; "
    "`+preset=NAME` loads `experiments/conf/preset/NAME.yaml` (its deltas and its own name, which "
    "`experiment=MINE` overrides)",
    "seed": "seed of the RL run: prompt order, sampling, mini-batch shuffles (not the cold start's)",
    "steps": "RL steps (one rollout batch and its N updates each)",
    "eval_every": "greedy held-out accuracy (`task/accuracy`) every this many steps, and at the last",
    "eval_size": "held-out examples evaluated (at most `task.n_eval`)",
    "device": "`cpu`, `cuda` or `cuda:K`",
    "threads": "torch CPU threads (None: torch's default)",
    "numerics": "native: the CPU's own kernels (fastest; the last bits differ between instruction sets); avx2: "
    "ATen, MKL (CNR branch AVX2) and oneDNN pinned at AVX2, so reruns are bitwise equal on CPUs of the same "
    "vendor and model (MKL honours the AVX2 branch on Intel only); portable: the same with MKL's COMPATIBLE "
    "branch, MKL's cross-vendor branch (verified on Intel only); docs/numerics.md",
    "progress": "a progress bar for an interactive single run; false: log lines every `log_every` steps",
    "model.family": "MoE family of the built model (qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3, gpt_oss; "
    "megablocks on CUDA), or of `model.checkpoint`; qwen3_dense: the dense control of qwen3_moe (same attention, "
    "one MLP of width top_k x expert width; replay.mode=none only, no route metrics)",
    "model.num_layers": "decoder layers of the built model",
    "model.num_experts": "experts per MoE layer",
    "model.top_k": "experts each token is routed to",
    "model.hidden_size": "hidden size of the built model",
    "task.name": "reversal | sorting | running_sum | addition | countdown | dataset (the user's own file: "
    "`task.path`) | gym (a reasoning-gym task: `task.gym.name`)",
    "task.n_eval": "held-out examples (never trained on)",
    "task.partial_credit": "reward of a well-formed wrong answer in the synthetic tasks (below 1)",
    "task.max_new_tokens": "longest completion sampled; null (task=running_sum): the longest answer the task's "
    "kwargs can draw, and eos",
    "task.kwargs": "arguments of a synthetic task's example generator, e.g. `task.kwargs.max_len=8`",
    "task.gym.name": "task=gym: a reasoning-gym task (`reasoning_gym.factory.DATASETS`), e.g. number_sorting",
    "task.gym.kwargs": "task=gym: that task's own config keys, e.g. `+task.gym.kwargs.min_numbers=4`",
    "task.prompt_field": "column of the data file holding the prompt",
    "task.answer_field": "column holding the reference answer",
    "task.system_prompt": "system message (chat template) or text before the prompt",
    "algo.name": " | ".join(LOSSES),
    "algo.eps_high": "upper clip range (None: the paper default of the algorithm)",
    "algo.agg": "loss aggregation over tokens and sequences",
    "replay.mode": "Routing Replay: " + " | ".join(REPLAY_MODES) + " (each mode's routes, threshold and weights: "
    "moe_rl/routing/modes.py)",
    "rollout.prompts_per_step": "prompts per RL step",
    "rollout.group_size": "completions sampled per prompt (G of the group-normalised advantage)",
    "rollout.temperature": "sampling temperature of rollouts (and of the log-probs)",
    "optim.lr": "learning rate of the RL updates",
    "optim.weight_decay": "decoupled weight decay (AdamW's; sign-SGD's: w -= lr x this x w)",
    "optim.max_grad_norm": "gradient clipping norm",
    "cold_start.lr": "learning rate of the supervised warm-up",
    "cold_start.batch_size": "examples per warm-up step",
    "cold_start.max_steps": "most warm-up steps",
    "cold_start.eval_every": "held-out accuracy every this many warm-up steps (and the stopping checks)",
    "cold_start.seed": "seed of the warm-up, the model's initialisation and the data split",
    "cold_start.cache_dir": "where warm-ups are cached, keyed by everything that determines them",
    "cold_start.pool": "cold starts per model: a run starts from member `seed` mod `pool`, the warm-up at cold-start "
    "seed `cold_start.seed + member`, cached like any cold start, with its covariates (docs/design.md §4); 1: one start",
    "cold_start.n_train": "the warm-up's demonstrations: a train pool of its own of this size, drawn as the task's "
    "train split is, beside the task's held-out split (refused where that split would move); null: the task's train "
    "split (`task.n_train`). `cold_start.max_steps` x `cold_start.batch_size` gives fresh examples at every step: "
    "at L = 16 digits 15 of 16 warm-ups reached the band against 11 of 16 from the 4,000 prompts (docs/performance.md)",
    "replay.split_every": "score each update's tokens also under the other routing (native vs replayed), one "
    "extra no-grad forward, every this many steps, for `ratio/split/*` and `clip/flipped_share`; 0: never",
    "collapse.reward_window": "rolling window (steps) of the reward-drop trigger",
    "collapse.reward_drop_frac": "reward-drop trigger: rolling reward below this fraction of its running best",
    "collapse.reward_floor": "the reward-drop trigger arms once the running best passed this floor",
    "collapse.entropy_floor": "entropy trigger: policy entropy below this floor while reward or accuracy has "
    "fallen by the drop fractions against the run's best or start",
    "collapse.entropy_window": "records the entropy trigger averages the policy entropy over",
    "collapse.baseline_window": "`relative` definition and the entropy trigger: steps of early reward that form the baseline",
    "collapse.accuracy_drop_frac": "`relative` definition and the entropy trigger: accuracy below this fraction of step 0's",
    "collapse.accuracy_patience": "`relative` definition and the entropy trigger: evaluations the accuracy drop must last",
    "pass_at_k.temperature": "sampling temperature of the pass@k samples",
    "metrics.route_every": "the route instruments run on the steps that are multiples of this: every `route/*` key, "
    "`ratio/split/*` (but `engine_var`) and `clip/flipped_share`, and the work only they need (router scores and "
    "margins, route comparisons, the rollout's routes where no replay reads them, the split's extra forward). "
    "Every other metric (rewards, accuracy, loss, the update's ratio statistics, entropy, gradient norm, the "
    "collapse checks) is logged every step, bitwise as with 1. 1: every step (the experiment files pin it)",
    "metrics.split_rows": "rows of each update's mini-batch the ratio split scores, drawn without replacement from "
    "a generator of its own seeded by the run's seed and the step (the training's streams do not move); null: "
    "all rows. At 24 of `compare`'s 32 every split key of every `compare` arm moves less between draws than "
    "between seeds (`benchmarks/split_spread.py`, docs/performance.md)",
    "metrics.update_kl_rows": "rows of each update's mini-batch that `kl/update_k3` scores after the optimizer step, "
    "drawn like the split's from a generator of their own; null: all rows; 0: off. One no-grad forward per update "
    "(two under replay): about 1.04x a step's CPU time at N = 1, 1.11x at N = 4, 1.18x at N = 8 (default model), "
    "on the steps `metrics.update_kl_window` schedules",
    "metrics.update_kl_window": "`kl/update_k3` is scored on every update of steps 1..this (the early window the "
    "analyses read, `moe_rl.analysis.dose.kl_summary`), then on one update of each route instruments' step "
    "(`metrics.route_every`), in rotation over the updates; the window's values are bitwise those of a run scoring "
    "every update. null: every update of every step",
}


def _comments() -> dict[str, str]:
    """`section.key` (or `key` for TrainConfig) -> the comment on the field's line in moe_rl/config.py."""
    source = inspect.getsource(config)
    lines = source.splitlines()
    sections = _sections(config.TrainConfig, "")
    out: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        prefix = "" if node.name == "TrainConfig" else sections.get(node.name)
        if prefix is None:
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                line = lines[stmt.lineno - 1]
                if "#" in line:
                    key = f"{prefix}.{stmt.target.id}" if prefix else stmt.target.id
                    out[key] = line.split("#", 1)[1].strip()
    return out


def _sections(cls: Any, prefix: str) -> dict[str, str]:
    """Class name -> dotted key of each section of `cls`, nested ones (`task.gym`) included."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            out[f.default_factory.__name__] = f"{prefix}{f.name}"
            out.update(_sections(f.default_factory, f"{prefix}{f.name}."))
    return out


def config_keys(obj: Any = None, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, default) of every leaf of TrainConfig, nested sections included, in declaration order."""
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj if obj is not None else config.TrainConfig):
        if obj is not None:
            default = getattr(obj, f.name)
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += config_keys(default, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", default))
    return out


def _default(value: Any) -> str:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"`{text}`"


def render() -> str:
    """The text of docs/config.md."""
    comments = _comments()
    lines = [
        "# Config keys",
        "",
        "Every key of a run's config, its default and what it does. Set any of them on the command line",
        "(`python experiments/train.py optim.lr=3e-4 task=sorting`); config groups (`model=`, `task=`, `algo=`,",
        "`replay=`, `cold_start=`) and presets (`+preset=NAME`) hold deltas from these defaults.",
        "Generated from `moe_rl/config.py` by `python -m moe_rl.config_docs`; do not edit by hand.",
        "",
        "| key | default | meaning |",
        "|:---|:---|:---|",
    ]
    for key, default in config_keys():
        meaning = (comments.get(key) or MEANINGS.get(key, "")).replace("|", "\\|")
        lines.append(f"| `{key}` | {_default(default)} | {meaning} |")
    return "\n".join(lines) + "\n"


def missing_meanings() -> list[str]:
    comments = _comments()
    return [key for key, _ in config_keys() if not (comments.get(key) or MEANINGS.get(key))]


def main() -> int:
    PAGE.write_text(render())
    print(PAGE)
    missing = missing_meanings()
    if missing:
        print(f"keys without a meaning (add a comment in moe_rl/config.py): {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
