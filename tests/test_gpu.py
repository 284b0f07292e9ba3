"""The training loop on a CUDA device (skipped without one; `scripts/gpu_check.sh` runs these).

Every tensor the loop builds from host data (rewards, bin edges, default masks) must land on the
policy's device: a CPU-only suite cannot see such a mix, so these tests run the loop itself.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from helpers import tiny_config

from moe_rl.train import train

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize(("algo", "replay", "rollout_dtype"), [("grpo", "r2", None), ("gspo", "r3", "bfloat16")])
def test_short_run_on_cuda_completes_with_finite_metrics(tmp_path, algo: str, replay: str, rollout_dtype) -> None:
    cfg = tiny_config(
        tmp_path / "run",
        "steps=2",
        "eval_every=2",
        "device=cuda",
        f"algo.name={algo}",
        f"replay.mode={replay}",
        "task.n_train=200",
        "task.n_eval=16",
        *([f"rollout.dtype={rollout_dtype}"] if rollout_dtype else []),
        "optim.updates_per_rollout=4",  # the defaults
        "optim.lr=1e-4",
        "cold_start.band=[0.0,1.0]",
        "cold_start.max_steps=20",
        "cold_start.eval_every=10",
        cache=tmp_path / "cache",
    )
    result = train(cfg)
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == result["status"]
    assert status["steps_done"] == 2, status
    metrics = pd.read_parquet(tmp_path / "run" / "metrics.parquet")
    for key in ("loss", "ratio/token_var", "route/old_vs_new/flip_rate"):
        values = metrics.loc[metrics["key"] == key, "value"]
        assert len(values) == 2 and values.notna().all() and torch.isfinite(torch.tensor(values.to_numpy())).all(), key
