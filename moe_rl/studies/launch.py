"""What the study launchers share (experiments/divergence.py, staleness.py, causal.py): one Hydra multirun of
experiments/train.py per part of a study, run in order, stopping at the first that fails. Rerunning resumes: a
finished run is read, not rerun."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path


def multirun(train: Path, preset: str, results_dir: Path, jobs: int) -> list[str]:
    """The start of a multirun of `train` under `+preset=<preset>`: runs into <results_dir>/<preset>/runs, `jobs` at
    a time (joblib), one torch thread each, no progress bars."""
    cmd = [sys.executable, str(train), "-m", f"+preset={preset}", f"out_dir={results_dir}/{preset}/runs"]
    return [*cmd, "progress=false", "threads=1", "hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"]


def run_multiruns(parts: Iterable[tuple[str, str, list[str]]], *, study: str, cwd: Path, dry_run: bool = False) -> None:
    """Each (prefix, label, command) in order: print the prefix and the command's arguments, run it unless
    `dry_run`, and exit naming the study and the label at the first that fails."""
    for prefix, label, cmd in parts:
        print(prefix + " ".join(cmd[1:]), flush=True)
        if not dry_run:
            code = subprocess.run(cmd, cwd=cwd).returncode
            if code != 0:
                sys.exit(f"{study}: the multirun of {label} exited {code}")


def member_overrides(preset: str, overrides: list[str], seed: int) -> list[str]:
    """The Hydra overrides of a run of `preset` at `seed` (one thread, as `multirun` launches it)."""
    return [f"+preset={preset}", *overrides, f"seed={seed}", "threads=1"]


def cached_start(overrides: list[str], conf: Path) -> dict | None:
    """The cached warm-up record (`cold_start.json`) of the pool member a run of `overrides` starts from, or None
    where that member is not trained yet."""
    import json

    from moe_rl.forecast import compose_config
    from moe_rl.loop.cold_start import cold_start_key, data_hash_of, member_config

    cfg = compose_config(overrides, conf)
    cold = member_config(cfg.cold_start, cfg.seed)
    key = cold_start_key(cfg.model, cfg.task, cold, data_hash_of(cfg.task), numerics=cfg.numerics)
    path = Path(cold.cache_dir) / key / "cold_start.json"
    return json.loads(path.read_text()) if path.is_file() else None


def warm_start(overrides: list[str], conf: Path) -> dict:
    """Train (or read) the pool member a run of `overrides` starts from, as the run itself would (pinned numerics,
    its threads, the member's task seed): the same cache entry, bitwise the same weights."""
    import logging

    import torch

    from moe_rl.forecast import compose_config
    from moe_rl.loop.cold_start import get_cold_start, member_config
    from moe_rl.run.folder import pin_numerics
    from moe_rl.tasks.setup import setup_task

    cfg = compose_config(overrides, conf)  # (Hydra's compose configures logging: set it after)
    logging.basicConfig(level=logging.INFO, format=f"[warm-up seed {cfg.seed}] %(message)s", force=True)
    pin_numerics(cfg.numerics)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cold = member_config(cfg.cold_start, cfg.seed)
    setup_task(cfg.task, cold.seed)
    _, _, info = get_cold_start(cfg.model, cfg.task, cold, numerics=cfg.numerics)
    return {k: info.get(k) for k in ("steps", "accuracy", "in_band", "stopped", "key")}


def live_seeds(
    preset: str,
    overrides: list[str],
    seeds: tuple[int, ...],
    *,
    jobs: int,
    warm: bool,
    label: str,
    conf: Path = Path("experiments") / "conf",
) -> tuple[int, ...]:
    """`seeds` less those whose pool member's warm-up ended outside its band (a start RL cannot move either way),
    warming the members first (`jobs` at a time) when `warm`; prints each member's state."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    runs = {s: member_overrides(preset, overrides, s) for s in seeds}
    states: dict[int, dict | None]
    if warm:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            states = dict(zip(runs, pool.map(warm_start, runs.values(), [conf] * len(runs)), strict=True))
    else:
        states = {s: cached_start(o, conf) for s, o in runs.items()}
    for s, st in states.items():
        state = "not warmed" if st is None else f"{st['steps']} SFT steps, accuracy {st['accuracy']:.3f}"
        print(f"{label} seed {s}: start {state}" + ("" if st is None or st["in_band"] else ", out of band: skipped"))
    return tuple(s for s, st in states.items() if st is None or st["in_band"])
