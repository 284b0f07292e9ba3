"""Fingerprint the harness's behaviour: the metrics of four short reference runs and the claims page.

A refactor must leave every logged number bitwise the same. This script runs, each in a fresh folder,
a short R2 run, an R3 run, the R3 run on two ranks (torchrun, gloo) and an engine run (vLLM, when
installed), then regenerates the claims page from `results/` into a scratch folder, and writes one
sha256 per item (metrics without the `time/` keys, sorted by step and key; the page's bytes).

    python scripts/fingerprint.py --write runs/fingerprint_before.json   # before a change
    python scripts/fingerprint.py --check runs/fingerprint_before.json   # after: exit 1 on any difference

The digests hold on the machine (and kernels) they were written on. `--pinned` fingerprints only the R2
run under `numerics=avx2` (the kernels every AVX2 x86 CPU runs alike): `tests/test_fingerprint.py` keeps
that digest, which holds on any such CPU.

    python scripts/fingerprint.py --pinned --write tests/data/fingerprint_pinned.json
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
]
RUNS: dict[str, tuple[int, list[str]]] = {
    "r2": (0, ["replay=r2"]),
    "r3": (0, ["replay=r3"]),
    "r3_two_ranks": (2, ["replay=r3"]),
    "engine": (0, ["replay=r3", "model.head_dim=32", "rollout.engine=vllm"]),
}


def metrics_digest(run: Path) -> str:
    """sha256 of a run's logged values (wall-clock keys aside), in a fixed order."""
    frame = pd.read_parquet(run / "metrics.parquet")
    frame = frame[~frame["key"].str.startswith("time/")].sort_values(["step", "key"])
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


def fingerprint(scratch: Path, *, pinned: bool = False) -> dict[str, str]:
    digests: dict[str, str] = {}
    runs = {"r2_avx2": (0, [*RUNS["r2"][1], "numerics=avx2"])} if pinned else RUNS
    for name, (nproc, overrides) in runs.items():
        if name == "engine" and importlib.util.find_spec("vllm") is None:
            print("engine: skipped (vllm not installed)", file=sys.stderr)
            continue
        launch(scratch / name, nproc, overrides)
        digests[name] = metrics_digest(scratch / name)
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
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        digests = fingerprint(Path(scratch), pinned=args.pinned)
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


if __name__ == "__main__":
    raise SystemExit(main())
