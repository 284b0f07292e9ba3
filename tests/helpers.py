"""What the tests share: the repo root, one tiny-config builder, a run's metrics, the launchers of
`experiments/train.py` (plain python and torchrun), and routes (planted ids, or random ones for a model).
Fixtures (the cold-start cache) are in conftest.py."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "experiments" / "conf" / "preset"  # the presets folder the report and the claims read

# The tiny run the tests start from, as Hydra overrides; a test names only what it changes.
TINY = (
    "eval_size=16",
    "snapshot_every=0",
    "progress=false",
    "task.n_train=400",
    "task.n_eval=32",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "optim.updates_per_rollout=2",
    "optim.lr=1e-3",
    "cold_start.band=[0.15,1.0]",
    "cold_start.max_steps=200",
    "metrics.route_every=1",  # every route instrument on every step and row, which the tests read
    "metrics.split_rows=null",
)

# What some test files change: the loop tests' run (test_train, test_dense), the faults' (test_faults, test_runs).
LOOP = ("eval_every=2", "snapshot_every=2", "rollout.prompts_per_step=8", "cold_start.eval_every=25")
FAULTS = ("steps=10", "eval_every=3", "checkpoint_every=2", "rollout.prompts_per_step=8", "optim.lr=3e-3")


def tiny_overrides(*changes: str, base: tuple[str, ...] = TINY) -> list[str]:
    """`base` with each `key=value` of `changes` in place of its key's (a new key goes at the end)."""
    out = {arg.partition("=")[0]: arg for arg in base}
    for arg in changes:
        out[arg.partition("=")[0]] = arg
    return list(out.values())


def tiny_config(out_dir: str | Path, *changes: str, cache: str | Path | None = None, **values: object):
    """The TrainConfig of `tiny_overrides(*changes)` (then `values`, `key=value`, and the cold-start `cache`)
    applied to the dataclass defaults the way Hydra applies them, writing to `out_dir`."""
    from omegaconf import OmegaConf

    from moe_rl.config import TrainConfig

    dotlist = tiny_overrides(*changes, *(f"{k}={v}" for k, v in values.items()))
    if cache is not None:
        dotlist.append(f"cold_start.cache_dir={cache}")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.from_dotlist(dotlist)))
    assert isinstance(cfg, TrainConfig)
    cfg.out_dir = str(out_dir)
    return cfg


def loop_config(tmp_path: Path, cache: Path, *, algo="grpo", replay="none", steps=3, name=None, N=2, lr=1e-3):
    """The loop tests' tiny run (LOOP) of `algo` and `replay`, in tmp_path/name (default `algo_replay`)."""
    return tiny_config(
        tmp_path / (name or f"{algo}_{replay}"),
        *LOOP,
        f"steps={steps}",
        f"algo.name={algo}",
        f"replay.mode={replay}",
        f"optim.updates_per_rollout={N}",
        f"optim.lr={lr}",
        cache=cache,
    )


def run_metrics(run: Path) -> pd.DataFrame:
    """A run's metrics without the wall-clock timings (which no rerun reproduces), sorted by step and key."""
    frame = pd.read_parquet(run / "metrics.parquet")
    return frame[~frame["key"].str.startswith("time/")].sort_values(["step", "key"]).reset_index(drop=True)


def run_values(run: Path) -> pd.DataFrame:
    """`run_metrics` down to step, key and value (what two launches of one config must share bitwise)."""
    return run_metrics(run)[["step", "key", "value"]]


# What a launched run's environment sets: one thread, this checkout first, Hydra's full errors.
TRAIN_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "1"}


def train_env(**extra: str) -> dict[str, str]:
    """The environment a launched run gets: this one with TRAIN_ENV (and `extra`) set."""
    return {**os.environ, **TRAIN_ENV, **extra}


@functools.cache
def launcher() -> types.ModuleType:
    """experiments/study.py as a module, to call its `main(argv)` in this process (no interpreter to start)."""
    spec = importlib.util.spec_from_file_location("study_launcher", ROOT / "experiments" / "study.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def study_dry_run(folder: Path | None, name: str) -> subprocess.CompletedProcess:
    """`experiments/study.py NAME --dry-run` on the declarations in `folder` (None: the shipped ones), run in this
    process (`run_study`)."""
    return run_study(name, "--dry-run", *(["--studies", str(folder)] if folder is not None else []))


def exit_status(stop: SystemExit, err: io.StringIO) -> int:
    """The return code the interpreter gives a `sys.exit`: its int, 0 for none, else 1 with its message written to
    `err` (stderr)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    err.write(f"{stop.code}\n")
    return 1


def run_study(*argv: str) -> subprocess.CompletedProcess:
    """`experiments/study.py ARGV` run in this process from the repository root (no interpreter to start, nothing to
    import again; the runs it launches are still processes of their own, with this process's environment), its own
    output captured as a subprocess would give it (an exit message on stderr, return code 1)."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            launcher().main(list(argv))
    except SystemExit as stop:
        code = exit_status(stop, err)
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def run_train(*argv: str) -> subprocess.CompletedProcess:
    """`python experiments/train.py ARGV` as `launch` runs it (from the repository root, TRAIN_ENV set, one torch
    thread), in this process: the script runs as `__main__` (`runpy`), so its Hydra entry point composes, checks and
    runs exactly what a launch's does, with no interpreter to start and nothing to import again. Its output is
    captured as a subprocess would give it: what it prints (its log lines too), the message and return code 1 of a
    `sys.exit`, and a traceback and return code 1 for an exception that escapes it (HYDRA_FULL_ERROR=1 lets Hydra
    re-raise). The environment, the working folder, sys.argv, torch's thread count and the root logger (Hydra
    configures logging for its jobs) are put back after."""
    import logging
    import runpy
    import traceback

    import torch

    out, err, code = io.StringIO(), io.StringIO(), 0
    environ, cwd, args, threads = dict(os.environ), os.getcwd(), sys.argv, torch.get_num_threads()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        os.environ.update(TRAIN_ENV)
        os.chdir(ROOT)
        sys.argv = ["experiments/train.py", *argv]
        torch.set_num_threads(1)  # OMP_NUM_THREADS=1 of a launch
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(ROOT / "experiments" / "train.py"), run_name="__main__")
            except SystemExit as stop:
                code = exit_status(stop, err)
            except Exception:  # noqa: BLE001 - what the interpreter would print, and its exit status
                traceback.print_exc()
                code = 1
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)
        torch.set_num_threads(threads)
        sys.argv = args
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(["experiments/train.py", *argv], code, out.getvalue(), err.getvalue())


def train_in_process(monkeypatch, module: types.ModuleType, launch_if=lambda cmd: False) -> list[list[str]]:
    """Make `module`'s `subprocess.run` (its own name for the module, no one else's) run each
    `python experiments/train.py ARGV` it is given in this process (`run_train`: the script's own entry point, no
    interpreter to start) rather than launch it; those `launch_if(cmd)` picks, and every other command, are run as
    before. Returns the list of the train commands it is given, in order, as they come. A run's output is captured
    (returned where the caller captures it; a failed run's stderr printed)."""
    real = subprocess.run
    given: list[list[str]] = []

    def run(cmd, *args, **kwargs):
        if len(cmd) < 2 or cmd[0] != sys.executable or Path(ROOT, cmd[1]) != ROOT / "experiments" / "train.py":
            return real(cmd, *args, **kwargs)
        given.append(list(cmd))
        if launch_if(cmd):
            return real(cmd, *args, **kwargs)
        assert Path(kwargs.get("cwd", os.getcwd())).resolve() == ROOT, kwargs  # the paths in cmd are the root's
        done = run_train(*cmd[2:])
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
        if kwargs.get("check") and done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
        return done

    monkeypatch.setattr(module, "subprocess", types.SimpleNamespace(**{**vars(subprocess), "run": run}))
    return given


def train_command(overrides: list[str], run: Path, cache: Path, *extra: str, nproc: int = 0) -> list[str]:
    """`experiments/train.py` with `overrides`, `extra`, the cold-start cache and the run folder; under
    torchrun with `nproc` processes when `nproc` is set."""
    head = [sys.executable]
    if nproc:
        head += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*head, "experiments/train.py", *overrides, *extra, f"cold_start.cache_dir={cache}", f"hydra.run.dir={run}"]


def launch(
    cmd: list[str], env: dict[str, str] | None = None, check: bool = True, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run `cmd` in the repo root (`timeout` seconds at most); with `check`, a failure shows its stderr's tail."""
    out = subprocess.run(
        cmd, check=False, cwd=ROOT, env=env or train_env(), capture_output=True, text=True, timeout=timeout
    )
    assert not check or out.returncode == 0, out.stderr[-4000:]
    return out


# The columns a run's metrics start with: its run keys (the ones every run has).
RUN_KEY_HEAD = ("run", "experiment", "arm", "algo", "replay", "family", "task", "seed", "N", "lr")

# The drift-scaling design: a base cell (experts, top-k, MoE layers, lr) and the cells that vary one factor.
DRIFT_BASE = (64, 8, 4, 1e-4)
DRIFT_VARIED = [
    (16, 8, 4, 1e-4),
    (128, 8, 4, 1e-4),
    (64, 2, 4, 1e-4),
    (64, 4, 4, 1e-4),
    (64, 8, 2, 1e-4),
    (64, 8, 8, 1e-4),
    (64, 8, 4, 3e-5),
    (64, 8, 4, 3e-4),
]


# --- models: inputs, random routes, generation against teacher forcing -------------------------------

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]  # token ids of a left-padded batch


def token_ids(B: int = 3, T: int = 12, seed: int = 0, device: str = "cpu"):
    """A (B, T) batch of random token ids (3..63), seeded."""
    import torch

    return torch.randint(3, 64, (B, T), generator=torch.Generator().manual_seed(seed)).to(device)


def random_routes(model, B: int, T: int, seed: int = 1):
    """Routes of `model`'s MoE layers for a (B, T) batch: k distinct experts per token, seeded."""
    import torch

    from moe_rl.routing import Routes, find_moe_layers

    layers = find_moe_layers(model)
    E, k = layers[0].num_experts, layers[0].top_k
    topk = torch.rand(B, T, len(layers), E, generator=torch.Generator().manual_seed(seed)).argsort(-1)[..., :k]
    return Routes.from_topk(topk, None, [layer.decoder_layer for layer in layers], E)


def planted_routes(ids, mask=None, num_experts: int = 8):
    """Routes of planted expert ids: `ids` (B, T, L, k) as nested lists or a tensor, in any slot order, `mask`
    (B, T) (None: every position real); MoE layer l is decoder layer l."""
    import torch

    from moe_rl.routing import Routes

    ids = torch.as_tensor(ids)
    return Routes.from_topk(ids, None if mask is None else torch.as_tensor(mask), range(ids.shape[2]), num_experts)


def generated_and_forced(model, prompts: list[list[int]], new_tokens: int):
    """Greedy generation of `new_tokens` tokens from left-padded `prompts` under a RouteRecorder, then the
    generated sequences teacher-forced under another: (generation's recorder, teacher forcing's, the
    generated ids, the attention mask of the whole sequence)."""
    import torch

    from moe_rl.routing import RouteRecorder

    P = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad(), RouteRecorder(model) as rec:
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    full_mask = torch.cat([attention_mask, torch.ones(len(prompts), out.shape[1] - P, dtype=torch.long)], 1)
    with torch.no_grad(), RouteRecorder(model) as tf:
        model(out[:, :-1], attention_mask=full_mask[:, :-1])
    return rec, tf, out, full_mask


def replayed_loss(model, x, replay, handles: list, as_float: bool = True):
    """The mean squared logit of `x` inside `replay` (what the replay tests backpropagate); the capture
    hooks `handles` are removed after, whatever happens."""
    try:
        with replay:
            logits = model(x).logits
            return (logits.float() if as_float else logits).pow(2).mean()
    finally:
        for h in handles:
            h.remove()
