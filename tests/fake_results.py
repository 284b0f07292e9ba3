"""Test fixture: fake results folders that follow the run-folder contract (docs/design.md §3, §5).

One generator (`make_fake_runs`: a folder per grid cell and seed, written by one writer) and two value
models on it: `make_fake_results` (a compare-like sweep with the full metric set) and `make_fake_grid`
(a phase-like grid with planted collapses, flip rates and final accuracies).

Values come from a seeded numpy RNG with arm-dependent structure (replay arms flip less, GRPO
without replay has the largest ratio variance, deeper layers and later positions flip more), so
tables and plots have something to show. Not data: never cite these numbers.

    python tests/fake_results.py OUT_DIR   # write a folder to try the report on
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path

import numpy as np
import pandas as pd

PAIRS = ("old_vs_new", "rollout_vs_old", "native_vs_replayed")
FLIP_BASE = {"none": 0.10, "r2": 0.035, "r3": 0.025}
TOKEN_VAR_BASE = {"grpo": 4e-3, "gspo": 1.5e-3}
CLIP_BASE = {"grpo": (0.01, 0.015), "gspo": (0.08, 0.12)}
# the routing part's share of the token log-ratio variance (no rng draw: the other fake values stay as they were)
ROUTING_SHARE = {"none": 0.4, "r2": 0.1, "r3": 0.05}
SKILL = {"grpo+r2": 1.0, "grpo+r3": 1.0, "gspo+none": 0.95, "gspo+r2": 0.95, "grpo+none": 0.85}


def _run_metrics(
    rng: np.random.Generator,
    arm: str,
    *,
    steps: int,
    num_layers: int,
    num_buckets: int,
    eval_every: int,
    collapse_step: int | None,
) -> list[tuple[int, str, float]]:
    """(step, key, value) rows of one run; the run stops at its collapse step."""
    algo, replay = arm.split("+")
    flip_base = FLIP_BASE.get(replay, 0.08) * (0.8 if algo == "gspo" else 1.0)
    run_factor = rng.lognormal(0.0, 0.15)
    tv_base = TOKEN_VAR_BASE.get(algo, 2e-3) * (0.3 if replay != "none" else 1.0) * run_factor
    clip_low, clip_high = CLIP_BASE.get(algo, (0.02, 0.03))
    skill = SKILL.get(arm, 0.9) * rng.uniform(0.9, 1.1)
    last = steps - 1 if collapse_step is None else collapse_step
    rows: list[tuple[int, str, float]] = []
    best = 0.0
    for step in range(last + 1):
        progress = step / max(steps - 1, 1)
        near_collapse = collapse_step is not None and step >= collapse_step - 1
        blowup = 20.0 if near_collapse else 1.0

        def put(key: str, value: float) -> None:
            rows.append((step, key, float(value)))  # noqa: B023 (called only within this step's iteration)

        for pair in PAIRS:
            if pair == "native_vs_replayed" and replay == "none":
                continue
            base = {
                "old_vs_new": flip_base,
                "rollout_vs_old": 0.3 * flip_base,
                "native_vs_replayed": FLIP_BASE["none"],
            }[pair]
            depth = 0.7 + 0.6 * np.arange(num_layers) / max(num_layers - 1, 1)
            layer = np.clip(
                base
                * run_factor
                * (1 + 0.5 * progress)
                * depth
                * rng.lognormal(0.0, 0.1, num_layers)
                * (3.0 if near_collapse else 1.0),
                0,
                1,
            )
            flip = layer.mean()
            put(f"route/{pair}/flip_rate", flip)
            put(f"route/{pair}/expert_flip_frac", flip * rng.uniform(0.5, 0.6))
            put(f"route/{pair}/token_flip_rate", 1 - np.prod(1 - layer))
            for i, value in enumerate(layer):
                put(f"route/{pair}/flip_rate/layer_{i}", value)
                if pair == "old_vs_new":  # no draw: the streams of the other keys stay as they were
                    put(f"ratio/split/flipped_mass/layer_{i}", min(1.0, 3 * value))
            if pair == "old_vs_new":
                for b in range(num_buckets):
                    slope = 0.6 + 0.8 * b / max(num_buckets - 1, 1)
                    put(f"route/{pair}/flip_rate/pos_{4 * b}", np.clip(flip * slope * rng.lognormal(0, 0.1), 0, 1))
        put("route/margin_mean", 0.08 * (1 - 0.3 * progress) * rng.lognormal(0, 0.1))

        token_var = tv_base * (1 + progress) * rng.lognormal(0.0, 0.2) * blowup
        put("ratio/token_var", token_var)
        put("ratio/token_max", 1 + np.sqrt(token_var) * rng.uniform(3, 6))
        put("ratio/seq_var", token_var * rng.uniform(0.05, 0.15))
        put("ratio/ess", 1 / (1 + token_var))
        put("ratio/extreme_frac", min(1.0, token_var * rng.uniform(0.5, 1.5)))
        put("ratio/clipfrac_low", min(1.0, clip_low * rng.lognormal(0, 0.3) * blowup**0.5))
        put("ratio/clipfrac_high", min(1.0, clip_high * rng.lognormal(0, 0.3) * blowup**0.5))
        put("kl/k3", token_var / 2 * rng.uniform(0.8, 1.2))
        put("ratio/split/routing_share", ROUTING_SHARE.get(replay, 0.2) * (1 + 0.5 * progress))

        reward = 0.25 + 0.55 * skill * (1 - np.exp(-3 * progress)) + rng.normal(0, 0.02)
        if near_collapse:
            reward = 0.4 * best
        best = max(best, reward)
        put("reward/mean", reward)
        put("reward/std", 0.1 + 0.2 * rng.uniform())
        if step % eval_every == 0 or step == last:
            put("task/accuracy", np.clip(reward - 0.05 + rng.normal(0, 0.02), 0, 1))
        put("policy/entropy", 1.2 * (1 - 0.4 * progress) * rng.lognormal(0, 0.05) * (0.3 if near_collapse else 1))
        put("optim/grad_norm", rng.lognormal(0, 0.3) * blowup)
        put("loss", rng.normal(0, 0.05))
        put("time/rollout_s", rng.uniform(1.0, 2.0))
        put("time/old_logp_s", rng.uniform(0.1, 0.3))
        put("time/update_s", rng.uniform(0.5, 1.5))
    return rows


def make_fake_runs(
    root: str | PathLike,
    run: Callable[..., FakeRun],
    *,
    arms: tuple[str, ...],
    seeds: tuple[int, ...],
    lrs: tuple[float, ...] = (1e-5,),
    Ns: tuple[int, ...] = (4,),
    layers: tuple[int, ...] = (2,),
    rng_seed: int = 0,
) -> list[Path]:
    """The one generator: a run folder under `root` per cell (arm x lr x N x MoE layers) and seed, each
    `run(rng, arm, lr, N, L, s, seed)` (s: the seed's index; rng seeded by rng_seed, the cell's index and
    the seed) written to the run-folder contract; returns the run dirs in grid order."""
    root = Path(root)
    dirs = []
    grid = [(a, lr, N, L) for a in arms for lr in lrs for N in Ns for L in layers]
    for i, (arm, lr, N, L) in enumerate(grid):
        for s, seed in enumerate(seeds):
            fake = run(np.random.default_rng([rng_seed, i, seed]), arm, lr, N, L, s, seed)
            dirs.append(_write_run(root / fake.folder, fake))
    return dirs


@dataclass
class FakeRun:
    """One run folder's contents: metrics.parquet (the run keys as columns, then step, key, value),
    meta.json (with the run keys), status.json, and config.yaml when `config` is set."""

    folder: str  # below the results root
    run_keys: dict
    rows: list[tuple[int, str, float]]
    events: list[dict]
    steps_done: int
    meta: dict = field(default_factory=dict)  # besides seed and run_keys
    status: dict = field(default_factory=dict)  # besides status, steps_done, collapse_events
    config: str | None = None
    dtypes: dict[str, str] | None = None


def _write_run(run_dir: Path, fake: FakeRun) -> Path:
    metrics = pd.DataFrame(fake.rows, columns=["step", "key", "value"])
    for col, value in reversed(fake.run_keys.items()):
        metrics.insert(0, col, value)
    if fake.dtypes:
        metrics = metrics.astype(fake.dtypes)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics.to_parquet(run_dir / "metrics.parquet", index=False)
    if fake.config is not None:
        (run_dir / "config.yaml").write_text(fake.config)
    meta = {**fake.meta, "seed": fake.run_keys["seed"], "run_keys": fake.run_keys}
    (run_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    status = {
        "status": "collapsed" if fake.events else "completed",
        "steps_done": fake.steps_done,
        "collapse_events": fake.events,
        **fake.status,
    }
    (run_dir / "status.json").write_text(json.dumps(status, indent=2))
    return run_dir


def make_fake_results(
    root: str | PathLike,
    *,
    arms: tuple[str, ...] = ("grpo+r2", "grpo+none", "gspo+none"),
    seeds: tuple[int, ...] = (0, 1, 2),
    steps: int = 12,
    num_layers: int = 2,
    collapse: tuple[str, int] | None = ("grpo+none", 1),
    experiment: str = "compare",
    num_buckets: int = 4,
    eval_every: int = 4,
    rng_seed: int = 0,
) -> list[Path]:
    """Runs of a `compare`-like sweep (one cell per arm, the full metric set) under
    root/experiment/arm/seed_<s>; return the run dirs.

    `collapse=(arm, k)`: the first k seeds of `arm` collapse (status "collapsed", one event, the
    run stops at that step); None for no collapses.
    """

    def run(rng: np.random.Generator, arm: str, lr: float, N: int, L: int, s: int, seed: int) -> FakeRun:
        algo, replay = arm.split("+")
        collapses = collapse is not None and arm == collapse[0] and s < collapse[1]
        collapse_step = int(rng.integers(steps // 2, steps - 1)) if collapses else None
        run_keys = {
            "run": f"{experiment}-{arm}-s{seed}",
            "experiment": experiment,
            "arm": arm,
            "algo": algo,
            "replay": replay,
            "family": "qwen3_moe",
            "task": "reversal",
            "seed": seed,
            "N": N,
            "lr": lr,
            "rollout_dtype": "bfloat16",
            "num_layers": L,
            "num_experts": 8,
        }
        rows = _run_metrics(
            rng,
            arm,
            steps=steps,
            num_layers=L,
            num_buckets=num_buckets,
            eval_every=eval_every,
            collapse_step=collapse_step,
        )
        meta = {
            "git_sha": "".join(rng.choice(list("0123456789abcdef"), 40)),
            "versions": {"python": sys.version.split()[0], "numpy": np.__version__, "pandas": pd.__version__},
            "device": "cpu",
        }
        events = []
        if collapse_step is not None:
            reward = [value for _, key, value in rows if key == "reward/mean"]
            events.append(
                {
                    "step": collapse_step,
                    "trigger": "reward_drop",
                    "detail": f"rolling reward {reward[-1]:.3f} < 0.5 x best {max(reward):.3f}",
                }
            )
        return FakeRun(
            folder=f"{experiment}/{arm}/seed_{seed}",
            run_keys=run_keys,
            rows=rows,
            events=events,
            steps_done=(collapse_step + 1) if events else steps,
            meta=meta,
            status={"wall_s": float(rng.uniform(30, 90))},
            config="".join(f"{k}: {v}\n" for k, v in run_keys.items() if k != "run") + f"steps: {steps}\n",
            dtypes={
                "seed": "int64",
                "N": "int64",
                "num_layers": "int64",
                "num_experts": "int64",
                "lr": "float64",
                "step": "int64",
                "value": "float64",
            },
        )

    return make_fake_runs(root, run, arms=arms, seeds=seeds, layers=(num_layers,), rng_seed=rng_seed)


def make_fake_grid(
    root: str | PathLike,
    *,
    experiment: str = "phase",
    arms: tuple[str, ...] = ("grpo+none", "grpo+r2", "gspo+none"),
    lrs: tuple[float, ...] = (1e-4, 1e-3),
    Ns: tuple[int, ...] = (1, 4),
    layers: tuple[int, ...] = (2,),
    seeds: tuple[int, ...] = tuple(range(8)),
    steps: int = 40,
    eval_every: int = 5,
    n_collapse=lambda arm, lr, N, L: 0,
    flip=lambda arm, lr, N, L, seed: 0.01,
    final_acc=lambda arm, lr, N, L, seed: 0.45,
    shift_lag: int | None = None,
    log_shift: bool = True,
    acc_noise: float = 0.005,
    rollout_dtype: str = "float32",
    family: str = "qwen3_moe",
    starts: int | None = None,
    rng_seed: int = 0,
) -> list[Path]:
    """A sweep grid (arm x lr x N x MoE layers x seed) of small runs under root/experiment/runs/.

    The first `n_collapse(arm, lr, N, L)` seeds of a cell collapse: reward falls from ~0.3 to ~0.03
    and accuracy from 0.4 to 0.05 at a step in the middle third, which every collapse definition
    flags; status.json holds the in-loop (absolute) events. `flip` sets the off-policy flip rate
    (per-layer values rise with depth around it), `final_acc` the last evaluation of a run that
    does not collapse. `shift_lag`: the router shift (1 - `route/old_vs_new/shift/mean`) leads the
    clip fraction by that many steps (negative: lags it); None: unrelated. `family`: the runs' model family
    (a second call with another family adds that model's runs to the same folder). `starts`: how many cold
    starts the runs began from, the seed's index modulo `starts` picking one (a `cold_start.key` in meta.json per
    family, depth and start; every arm of a cell shares them); None: none recorded, so all runs share one start.
    """
    from moe_rl.metrics.collapse import detect_collapse

    def run(rng: np.random.Generator, arm: str, lr: float, N: int, L: int, s: int, seed: int) -> FakeRun:
        algo, replay = arm.split("+")
        c = int(rng.integers(steps // 3, 2 * steps // 3)) if s < n_collapse(arm, lr, N, L) else None
        f = flip(arm, lr, N, L, seed)
        acc_end = final_acc(arm, lr, N, L, seed)
        x = rng.normal(0.0, 1.0, steps + 20)
        shift = 0.95 - 0.01 * x  # router-shift ratio gamma: lower = the router moved more
        if shift_lag is None:
            clip = 0.02 + 0.005 * rng.normal(0.0, 1.0, steps + 20)
        else:
            clip = 0.02 + 0.005 * (np.roll(x, shift_lag) + 0.3 * rng.normal(0.0, 1.0, steps + 20))
        rows: list[tuple[int, str, float]] = [(0, "task/accuracy", 0.4)]
        for step in range(1, steps + 1):
            down = c is not None and step >= c
            reward = (0.03 if down else 0.3) + rng.normal(0, 0.01)
            rows += [
                (step, "reward/mean", reward),
                (step, "loss", rng.normal(0, 0.05)),
                (step, "optim/grad_norm", rng.lognormal(0, 0.2)),
                (step, "policy/entropy", 1.0),
                (step, "ratio/clipfrac_low", clip[step + 10] / 2),
                (step, "ratio/clipfrac_high", clip[step + 10] / 2),
            ]
            if log_shift:
                rows.append((step, "route/old_vs_new/shift/mean", shift[step + 10]))
            if N > 1:
                rows.append((step, "route/old_vs_new/flip_rate/offpolicy", f * rng.lognormal(0, 0.05)))
                rows.append((step, "route/old_vs_new/expert_flip_frac/offpolicy", f / 2 * rng.lognormal(0, 0.05)))
                rows.append((step, "route/old_vs_new/token_flip_rate/offpolicy", 1 - (1 - f) ** L))
            rows.append((step, "route/old_vs_new/flip_rate", f * (N - 1) / N))
            for layer in range(L):
                depth = 0.5 + layer / max(L - 1, 1)
                rows.append((step, f"route/old_vs_new/flip_rate/layer_{layer}", f * depth * (N - 1) / N))
            if step % eval_every == 0 or step == steps:
                acc = 0.05 if down else 0.4 + (acc_end - 0.4) * step / steps
                rows.append(
                    (step, "task/accuracy", acc + (0 if step == steps and not down else rng.normal(0, acc_noise)))
                )
        history: dict[str, list] = {}
        for step, key, value in rows:
            history.setdefault(key, []).append((step, value))
        events = [{"step": e.step, "trigger": e.trigger, "detail": e.detail} for e in detect_collapse(history)]
        name = f"{experiment}-{arm}-lr{lr:g}-N{N}-L{L}-s{seed}" + ("" if family == "qwen3_moe" else f"-{family}")
        run_keys = {
            "run": name,
            "experiment": experiment,
            "arm": arm,
            "algo": algo,
            "replay": replay,
            "family": family,
            "task": "reversal",
            "seed": seed,
            "N": N,
            "lr": lr,
            "rollout_dtype": rollout_dtype,
            "num_layers": L,
            "num_moe_layers": L,
            "num_experts": 8,
        }
        meta = {} if starts is None else {"cold_start": {"key": f"fake-{family}-L{L}-start{s % starts}"}}
        return FakeRun(f"{experiment}/runs/{name}", run_keys, rows, events, steps, meta)

    return make_fake_runs(root, run, arms=arms, seeds=seeds, lrs=lrs, Ns=Ns, layers=layers, rng_seed=rng_seed)


def write_fake_fit(
    root: str | PathLike, *, predicted: float = 0.1, ci: tuple[float, float] = (0.06, 0.15), r2_holdout: float = 0.9
) -> Path:
    """results/drift_scaling/fit.json in the schema the drift-scaling fit writes."""
    path = Path(root) / "drift_scaling" / "fit.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    metrics = {
        key: {"measured_max": 0.02, "predicted": predicted, "ci": list(ci), "r2_holdout": r2_holdout}
        for key in (
            "route/old_vs_new/expert_flip_frac/offpolicy",
            "route/old_vs_new/flip_rate/offpolicy",
            "route/old_vs_new/token_flip_rate/offpolicy",
        )
    }
    doc = {
        "target": {"num_experts": 128, "top_k": 8, "num_moe_layers": 48, "lr": 1e-6},
        "metrics": metrics,
        "assumptions": "log-linear in log E, k, depth and log lr (fake)",
    }
    path.write_text(json.dumps(doc, indent=2))
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/fake_results.py OUT_DIR")
    for path in make_fake_results(sys.argv[1]):
        print(path)
