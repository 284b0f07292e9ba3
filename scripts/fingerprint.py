"""Fingerprint the harness's behaviour: the metrics of four short reference runs and the claims page.

A refactor must leave every logged number bitwise the same. This script runs, each in a fresh folder,
a short R2 run, an R3 run, the R3 run on two ranks (torchrun, gloo) and an engine run (vLLM, when
installed), then regenerates the claims page from `results/` into a scratch folder, and writes one
sha256 per item (metrics without the `time/` keys, sorted by step and key; the page's bytes).

    python scripts/fingerprint.py --write runs/fingerprint_before.json   # before a change
    python scripts/fingerprint.py --check runs/fingerprint_before.json   # after: exit 1 on any difference
    python scripts/fingerprint.py --check runs/fingerprint_before.json --without optim/new_metric  # a new metric

The digests hold on the machine (and kernels) they were written on. `--pinned` fingerprints only the R2
run, once under each pinned numerics mode (`numerics=avx2`, `numerics=portable`), and keys each digest by
the CPU it was made on (vendor and model: MKL picks kernels by vendor, docs/numerics.md). `--write` adds
this CPU's digests to the file; `--check` compares with this CPU's and exits 3 when the file has none for
it. `tests/test_fingerprint.py` keeps one digest per CPU it was verified on.

    python scripts/fingerprint.py --pinned --write tests/data/fingerprint_pinned.json

`--pinned --compiled` fingerprints the same R2 run with `compile=true` under `numerics=avx2` (inductor's kernels:
a numerics domain of its own, docs/performance.md), kept per CPU in its own file:

    python scripts/fingerprint.py --pinned --compiled --write tests/data/fingerprint_compiled.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from moe_rl.run.folder import PINNED_ENV, cpu_id

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "steps=4",
    "eval_every=2",
    "eval_size=16",
    "snapshot_every=0",
    "progress=false",
    "threads=1",
    "task.n_train=200",
    "task.n_eval=32",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "optim.updates_per_rollout=2",
    "optim.lr=1e-3",
    "cold_start.mode=none",
    "metrics.route_every=1",  # every route instrument on every step and row: the loop before `metrics`
    "metrics.split_rows=null",
]
RUNS: dict[str, tuple[int, list[str]]] = {
    "r2": (0, ["replay=r2"]),
    "r3": (0, ["replay=r3"]),
    "r3_two_ranks": (2, ["replay=r3"]),
    "engine": (0, ["replay=r3", "model.head_dim=32", "rollout.engine=vllm"]),
}


def metrics_digest(run: Path, without: tuple[str, ...] = ()) -> str:
    """sha256 of a run's logged values (wall-clock keys and keys starting with any of `without` aside), in a
    fixed order."""
    frame = pd.read_parquet(run / "metrics.parquet")
    frame = frame[~frame["key"].str.startswith(("time/", *without))].sort_values(["step", "key"])
    rows = "\n".join(f"{s}\t{k}\t{v!r}" for s, k, v in frame[["step", "key", "value"]].itertuples(index=False))
    return hashlib.sha256(rows.encode()).hexdigest()


def launch(run: Path, nproc: int, overrides: list[str]) -> None:
    head = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc
        else [sys.executable]
    )
    cmd = [*head, "experiments/train.py", *BASE, *overrides, f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{run.name} failed:\n{out.stderr[-3000:]}")


# Keys the pinned digests leave out: metrics added after a CPU's digest was verified, that are pure functions of
# what the other keys already cover (`optim/expert_step/*`: the weights' moves over a step and the routes), or
# that read the weights with no-grad passes of their own and move no other number (`kl/update_k3`).
PINNED_WITHOUT = ("optim/expert_step/", "kl/update_k3")


def fingerprint(
    scratch: Path, *, pinned: bool = False, compiled: bool = False, without: tuple[str, ...] = ()
) -> dict[str, str]:
    digests: dict[str, str] = {}
    without = (*without, *PINNED_WITHOUT) if pinned else without
    pins = {f"r2_{mode}": (0, [*RUNS["r2"][1], f"numerics={mode}"]) for mode in PINNED_ENV}
    if compiled:  # compile=true is its own numerics domain: its digest sits beside the eager ones, never in place
        pins = {"r2_avx2_compiled": (0, [*RUNS["r2"][1], "numerics=avx2", "compile=true"])}
    runs = pins if pinned else RUNS
    for name, (nproc, overrides) in runs.items():
        if name == "engine" and importlib.util.find_spec("vllm") is None:
            print("engine: skipped (vllm not installed)", file=sys.stderr)
            continue
        launch(scratch / name, nproc, overrides)
        digests[name] = metrics_digest(scratch / name, without)
        print(f"{name}: {digests[name][:16]}", file=sys.stderr)
    if pinned:
        return digests
    out = scratch / "claims"
    subprocess.run(
        [sys.executable, "-m", "moe_rl.report", "--claims", "results", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
    )
    digests["claims"] = hashlib.sha256((out / "CLAIMS.md").read_bytes()).hexdigest()
    print(f"claims: {digests['claims'][:16]}", file=sys.stderr)
    return digests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, help="write the digests to this JSON file")
    mode.add_argument("--check", type=Path, help="compare with the digests in this JSON file")
    parser.add_argument("--pinned", action="store_true", help="only the R2 run, under numerics=avx2")
    parser.add_argument(
        "--compiled", action="store_true", help="with --pinned: the R2 run under numerics=avx2 and compile=true"
    )
    parser.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="PREFIX",
        help="leave out keys starting with PREFIX (a change that adds metrics: every other number stays bitwise)",
    )
    args = parser.parse_args(argv)
    if args.compiled and not args.pinned:
        parser.error("--compiled fingerprints the pinned R2 run: add --pinned")
    if any(not prefix for prefix in args.without):
        parser.error("--without needs a non-empty key prefix (an empty one leaves every key out)")
    if args.pinned and args.check and not _known_here(args.check):
        return _per_cpu({}, write=None, check=args.check)
    with tempfile.TemporaryDirectory() as scratch:
        digests = fingerprint(Path(scratch), pinned=args.pinned, compiled=args.compiled, without=tuple(args.without))
    if args.pinned:
        return _per_cpu(digests, write=args.write, check=args.check)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps(digests, indent=1) + "\n")
        return 0
    reference = json.loads(args.check.read_text())
    moved = [k for k in reference if digests.get(k) != reference[k]]
    for key in moved:
        print(f"differs: {key}")
    print("bitwise equal" if not moved else f"{len(moved)} of {len(reference)} differ")
    return 1 if moved else 0


def _known_here(path: Path) -> bool:
    return any(cpu_id() in ref for ref in json.loads(path.read_text()).values())


def _per_cpu(digests: dict[str, str], *, write: Path | None, check: Path | None) -> int:
    """Pinned digests are kept per CPU ({run: {cpu: digest}}): add this CPU's, or compare with them."""
    cpu = cpu_id()
    path = write or check
    assert path is not None
    kept: dict[str, dict[str, str]] = json.loads(path.read_text()) if path.exists() else {}
    if write:
        for name, digest in digests.items():
            kept.setdefault(name, {})[cpu] = digest
        write.parent.mkdir(parents=True, exist_ok=True)
        write.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
        return 0
    known = {name: ref[cpu] for name, ref in kept.items() if cpu in ref}
    if not known:
        print(f"no reference for this CPU ({cpu}); verified on: {sorted({c for ref in kept.values() for c in ref})}")
        return 3
    moved = [k for k in known if digests.get(k) != known[k]]
    for key in moved:
        print(f"differs: {key} on {cpu} ({digests.get(key)} vs {known[key]})")
    print("bitwise equal" if not moved else f"{len(moved)} of {len(known)} differ")
    return 1 if moved else 0


if __name__ == "__main__":
    raise SystemExit(main())
