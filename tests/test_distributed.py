"""One run over many processes: reductions against one-process references, and torchrun runs on gloo.

The pure reductions are checked in-process against the one-process metric functions on the union of
the rows. The torchrun tests launch `experiments/train.py` on 2 CPU processes (gloo) and compare the run
directories with one process's (torchrun with one process once, plain python, bitwise the same, elsewhere: the
script run in this process, `run_train`);
`dist_worker.py` checks replay and gradient checkpointing on FSDP2-sharded routers.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import ROOT, launch, planted_routes, run_train, run_values, tiny_overrides, train_command, train_env

from moe_rl.algos import cispo_loss, grpo_loss, gspo_loss, gspo_token_loss, sapo_loss
from moe_rl.loop.distributed import Dist, SilentWriter, group_block, local_rows
from moe_rl.metrics.partial import Partial, mean_finalize, mean_parts, pool
from moe_rl.metrics.ratio_stats import (
    margin_finalize,
    margin_parts,
    margin_stats,
    ratio_finalize,
    ratio_parts,
    ratio_split_finalize,
    ratio_split_parts,
    ratio_stats,
    rollout_gap_finalize,
    rollout_gap_parts,
)
from moe_rl.models import build_model
from moe_rl.rollout.generate import generate
from moe_rl.rollout.sampler import GlobalRows
from moe_rl.routing import compare_routes
from moe_rl.routing.compare import (
    compare_finalize,
    compare_parts,
    flip_by_position,
    position_finalize,
    position_parts,
)
from moe_rl.run.folder import RunDirectoryError
from moe_rl.tasks import make_tokenizer


def _split(B: int, parts: list[int]) -> list[slice]:
    edges = [0, *torch.tensor(parts).cumsum(0).tolist()]
    assert edges[-1] == B
    return [slice(a, b) for a, b in itertools.pairwise(edges)]


# --- pure helpers -------------------------------------------------------------------------------------


def test_group_blocks_and_local_rows() -> None:
    assert [list(group_block(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="prompts_per_step=6 must be divisible by the world size 4"):
        group_block(6, 0, 4)
    rows = torch.tensor([7, 2, 9, 4, 5])  # a global mini-batch; this rank holds rows 4..7
    assert local_rows(rows, 4, 4).tolist() == [3, 0, 1]  # local ids, in mini-batch order
    assert local_rows(rows, 0, 2).tolist() == []


def test_losses_report_their_denominators() -> None:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)  # 5 tokens, 2 non-empty seqs
    logp, old_logp, adv = -torch.rand(3, 3, generator=g), -torch.rand(3, 3, generator=g), torch.randn(3, generator=g)
    args = {"logp": logp, "old_logp": old_logp, "adv": adv, "mask": mask, "ref_logp": logp - 0.1, "beta": 0.1}
    cases = [
        (grpo_loss, "seq-mean-token-mean", 2, 5, 2),
        (grpo_loss, "token-mean", 5, 5, 5),
        (gspo_loss, "seq-mean-token-mean", 2, 2, 2),
        (gspo_token_loss, "token-mean", 2, 5, 5),
        (sapo_loss, "seq-mean-token-mean", 2, 5, 2),
        (cispo_loss, "token-mean", 5, 5, 5),
    ]
    for loss_fn, agg, policy, clip, kl in cases:
        _, metrics = loss_fn(**args, agg=agg)
        assert metrics.weights == {
            "loss": policy,
            "loss/policy": policy,
            "ratio/clipfrac_low": clip,
            "ratio/clipfrac_high": clip,
            "kl/ref_k3": kl,
        }, (loss_fn.fn.__name__, agg)


@pytest.mark.parametrize(
    "loss_fn, agg, extras",
    [
        (grpo_loss, "seq-mean-token-mean", ()),
        (grpo_loss, "token-mean", ()),
        (gspo_loss, "seq-mean-token-mean", ()),
        (sapo_loss, "seq-mean-token-mean", ("weight", "ratio_scale")),
        (cispo_loss, "token-mean", ("weight", "ratio_scale")),
        (grpo_loss, "seq-mean-token-mean", ("weight", "ratio_scale")),
    ],
)
def test_loss_shares_make_the_mean_of_rank_gradients_the_one_process_gradient(loss_fn, agg, extras) -> None:
    g = torch.Generator().manual_seed(0)
    B, T, W = 6, 5, 3
    logp = (-torch.rand(B, T, generator=g)).requires_grad_()
    old_logp = logp.detach() + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[1] = False  # an empty sequence
    kwargs = {"old_logp": old_logp, "mask": mask, "adv": adv, "agg": agg}
    kwargs.update({name: 0.5 + torch.rand(B, T, generator=g) for name in extras})  # engine weight, RSPO factor
    loss, metrics = loss_fn(logp=logp, **kwargs)
    (reference,) = torch.autograd.grad(loss, logp)
    total = metrics.weights["loss"]
    mean = torch.zeros_like(logp)
    for rows in _split(B, [1, 3, 2]):  # unequal shares, as a rank's rows of a mini-batch are
        sub = {k: v[rows] if torch.is_tensor(v) else v for k, v in kwargs.items()}
        loss, metrics = loss_fn(logp=logp[rows], **sub)
        share = W * metrics.weights["loss"] / total  # Dist.scale_loss
        mean += torch.autograd.grad(loss * share, logp)[0] / W  # what FSDP/DDP average
    torch.testing.assert_close(mean, reference, rtol=1e-6, atol=1e-7)


def _pooled(parts_of, finalize, splits, *args):
    """finalize(pool(parts of each block of rows)): what W ranks holding those blocks log."""
    return finalize(pool([parts_of(*(x[rows] for x in args)) for rows in splits]))


def test_pooled_metrics_are_the_one_process_metrics_of_the_union() -> None:
    g = torch.Generator().manual_seed(1)
    B, T = 7, 6
    logp, old_logp = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[2] = False
    splits = _split(B, [2, 0, 5])  # one rank without rows
    reference = ratio_stats(logp=logp, old_logp=old_logp, mask=mask)
    got = _pooled(lambda a, b, m: ratio_parts(logp=a, old_logp=b, mask=m), ratio_finalize, splits, logp, old_logp, mask)
    assert got.keys() == reference.keys()
    for key in reference:  # the same values, summed in another order
        assert got[key] == pytest.approx(reference[key], rel=1e-12, abs=1e-15), key
    assert ratio_stats(logp=logp, old_logp=logp, mask=mask)["ratio/token_var"] == 0.0
    # routes: counts are integers, so a flip rate of the union is the same float32 ratio
    L, E, k = 3, 8, 2
    g = torch.Generator().manual_seed(2)
    a, b = (planted_routes(torch.rand(B, T, L, E, generator=g).argsort(-1)[..., :k], mask, E) for _ in range(2))
    assert _pooled(lambda x, y: compare_parts(x, y), compare_finalize, splits, a, b) == compare_routes(a, b)
    response = torch.zeros(B, T, dtype=torch.bool)
    response[:, 2:] = True
    reference = flip_by_position(a, b, response, start=2, bucket=3)
    assert len(reference) == 2
    got = _pooled(
        lambda x, y, m: position_parts(x, y, m, 2, 3, buckets=2),
        lambda p: position_finalize(p, 3),
        splits,
        a,
        b,
        response,
    )
    assert got.keys() == reference.keys()
    for key in reference:
        assert got[key] == pytest.approx(reference[key], rel=1e-6)
    margins = torch.rand(B, T, 3, generator=g)
    assert _pooled(margin_parts, margin_finalize, splits, margins, mask) == margin_stats(margins, mask)
    # the ratio split and the rollout gap pool rows: the one-process values up to summation order
    native, flipped, clipped = -torch.rand(B, T, generator=g), torch.rand(B, T, generator=g) > 0.5, mask.clone()
    clipped[0] = False
    cases = [
        (
            lambda a, b, c, m, f, k: ratio_split_parts(
                native_logp=a, replayed_logp=b, old_logp=c, mask=m, flipped=f, clipped=k
            ),
            ratio_split_finalize,
            (native, logp, old_logp, mask, flipped, clipped),
        ),
        (
            lambda a, b, m: rollout_gap_parts(rollout_logp=a, train_logp=b, mask=m),
            rollout_gap_finalize,
            (logp, old_logp, mask),
        ),
    ]
    for parts_fn, finalize, tensors in cases:
        reference = finalize(parts_fn(*tensors))
        got = _pooled(parts_fn, finalize, splits, *tensors)
        assert got.keys() == reference.keys()
        for key in reference:
            assert got[key] == pytest.approx(reference[key], rel=1e-12, abs=1e-15), key


def test_one_part_pools_to_itself_bitwise() -> None:
    """A world of size 1 finalizes its own parts: the values the metric functions return, to the bit."""
    values, weights = {"loss": 0.1 + 0.2, "loss/policy": -1 / 3}, {"loss": 3.0, "loss/policy": 0.0}
    assert mean_finalize(pool([mean_parts(values, weights)])) == values
    two = pool(
        [mean_parts({"m": 1.0}, {"m": 1.0}), mean_parts({"m": 4.0}, {"m": 2.0}), mean_parts({"m": 9.0}, {"m": 0.0})]
    )
    assert mean_finalize(two) == {"m": 3.0}  # (1 * 1 + 4 * 2) / 3; a rank without rows does not count
    with pytest.raises(RuntimeError, match="pool different metric sets"):
        pool([Partial(sums={"n": torch.tensor(1)}), Partial(sums={"m": torch.tensor(1)})])


def test_a_slice_of_the_batch_samples_what_the_whole_batch_gives_it() -> None:
    model, tokenizer = build_model("qwen3_moe"), make_tokenizer()
    prompts = ["12345=", "987=", "55="]
    full = generate(model, tokenizer, prompts, group_size=2, max_new_tokens=6, seed=5)
    running = iter([True] * 6)  # the other "rank" keeps the batch running until max_new_tokens
    tail = generate(
        model,
        tokenizer,
        prompts[1:],
        group_size=2,
        max_new_tokens=6,
        seed=5,
        rows=GlobalRows(first=2, total=6, any_running=lambda flag: next(running)),
    )
    assert full.completions[2:] == tail.completions  # the same rows on a "rank" holding prompts 1..2 only
    assert len(set(full.completions)) > 2  # and they are samples, not one greedy answer
    whole = generate(
        model,
        tokenizer,
        prompts,
        group_size=2,
        max_new_tokens=6,
        seed=5,
        rows=GlobalRows(first=0, total=6, any_running=lambda flag: flag),
    )
    assert torch.equal(whole.sequences, full.sequences)  # a world of size 1 is the plain sampler
    # Log-probs of a row agree too, up to the batch's left pads and float rounding.
    offset, width = full.prompt_len - tail.prompt_len, full.sequences.shape[1] - full.prompt_len
    torch.testing.assert_close(
        tail.rollout_logp[:, tail.prompt_len - 1 : tail.prompt_len - 1 + width],
        full.rollout_logp[2:, full.prompt_len - 1 :],
        rtol=1e-5,
        atol=1e-6,
    )
    assert offset >= 0


def test_only_rank_0_touches_the_run_folder_on_resume(tmp_path) -> None:
    """Ranks > 0 neither read nor delete metric parts: on resume rank 0 truncates them while the others
    would be reading (a race that once failed a rerun with a vanished part)."""
    from moe_rl.run.folder import RunWriter

    keys = {"seed": 0}
    writer = RunWriter(tmp_path, keys)
    for step in (2, 4):
        writer.log(step, {"reward/mean": step / 10})
        writer.flush("running", step, 0.0)
    silent = SilentWriter(tmp_path, keys)
    assert silent.history(("reward/mean",)) == {"reward/mean": []}
    silent.truncate_after(2)
    assert len(list((tmp_path / "metrics").glob("part-*.parquet"))) == 2
    assert writer.history(("reward/mean",)) == {"reward/mean": [(2, 0.2), (4, 0.4)]}


def test_a_dead_peer_is_an_interruption_not_a_failure() -> None:
    from moe_rl.loop.distributed import peer_lost

    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41512: Connection reset by peer"
    )
    assert peer_lost(gloo) and peer_lost(torch.distributed.DistNetworkError("Connection closed by peer"))
    assert not peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not peer_lost(ValueError("Connection reset by peer"))  # not what a collective raises


def test_without_torchrun_the_world_has_size_1(monkeypatch) -> None:
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    d = Dist()
    assert not d.active and d.is_writer and d.world_size == 1 and d.meta() == {"world_size": 1}
    model = torch.nn.Linear(2, 2)
    loss = torch.tensor(2.5)
    assert d.wrap(model) is model and d.scale_loss(loss, 3.0) is loss
    rows = [torch.tensor([3, 1]), torch.tensor([0, 2])]
    assert [r.tolist() for r in d.chunks(rows, 0, 4)] == [[3, 1], [0, 2]]
    rows_of_batch = d.batch_rows(4, 2)
    assert (rows_of_batch.first, rows_of_batch.total) == (0, 8) and d.shard([{"a": 1}]) == [{"a": 1}]
    parts = Partial(sums={"n": torch.tensor(3)})
    assert d.merge(parts) is parts


# --- torchrun on CPU (gloo) ---------------------------------------------------------------------------

# In float64 (unit roundoff u = 2^-53 = 1.1e-16) a different summation order moves values by ~1e-16
# relative, while an error of the distributed path (a wrong loss share, a lost row) moves them by O(lr):
# the bounds below sit between the two on any CPU, whatever its kernels' rounding.
OVERRIDES = tiny_overrides("model.dtype=float64", "rollout.dtype=float64", "eval_every=3", "checkpoint_every=2")


def _torchrun(nproc: int, run: Path, cache: Path, *extra: str, wait: bool = True, check: bool = True):
    cmd = train_command(OVERRIDES, run, cache, *extra, nproc=nproc)
    if not wait:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    return launch(cmd, check=check)


def _params(run: Path) -> dict[str, torch.Tensor]:
    """Model parameters of the run's kept checkpoint (a world of size 1: one file; larger: sharded)."""
    if (run / "checkpoint.pt").exists():
        return torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    pointer = json.loads((run / "checkpoint.json").read_text())
    dcp_to_torch_save(run / pointer["path"], run / "full.pt")
    return torch.load(run / "full.pt", weights_only=False)["model"]


def _python(run: Path, cache: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    """The same launch as `_torchrun`, with plain python: `python experiments/train.py ...` run in this process
    (`run_train`: the script's own entry point, no interpreter to start), a world of size 1."""
    out = run_train(*train_command(OVERRIDES, run, cache, *extra)[2:])
    assert not check or out.returncode == 0, out.stderr[-4000:]
    return out


def _digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (hidden ones and .hydra/ included), by relative path."""
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """This module's own cold-start cache, not the session's (conftest.py): the float64 warm-up is trained by this
    module's first launch (in file order, the `runs` fixture's 2-rank run: a warm-up trained under torchrun), not
    read from another module's (test_staleness warms the same one)."""
    return tmp_path_factory.mktemp("cold_start")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    """One R3 config run on 2 and on 1 ranks (6 steps, the checkpoint of step 4 kept). The 2-rank run
    comes first, so it trains the cold start under torchrun (rank 0 writes it, rank 1 loads it)."""
    root = tmp_path_factory.mktemp("dist")
    for n in (2, 1):
        _torchrun(n, root / f"r3_{n}", cache, "steps=6", "replay=r3", "keep_checkpoint=true")
    return root, cache


@pytest.mark.slow
def test_python_and_torchrun_with_one_process_log_bitwise_the_same(runs) -> None:
    """A plain run is a world of size 1: the same sampling, metrics and checkpoint as torchrun with one process (so
    the other tests' one-process references and resumes are plain python runs, which `_python` runs in this process:
    no interpreter to start). The plain run here is one of those, so it is what they stand on."""
    root, cache = runs
    _python(root / "r3_python", cache, "steps=6", "replay=r3", "keep_checkpoint=true")
    plain, one = run_values(root / "r3_python"), run_values(root / "r3_1")
    assert len(plain) > 300 and plain["key"].eq("reward/mean").sum() == 6
    pd.testing.assert_frame_equal(plain, one, check_exact=True)
    assert plain.loc[plain["key"] == "reward/std", "value"].gt(0).any()  # a learning signal: the runs could differ
    a, b = _params(root / "r3_python"), _params(root / "r3_1")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _composed(run: Path, cache: Path, *extra: str):
    """The TrainConfig that `_python(run, cache, *extra)` runs, composed in this process as experiments/train.py
    composes it (Hydra, then validation; the run folder and the absolute cache as the launch sets them)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import TrainConfig, to_train_config, validate

    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    with initialize_config_dir(config_dir=str(ROOT / "experiments" / "conf"), version_base="1.3"):
        overrides = [*OVERRIDES, *extra, f"cold_start.cache_dir={cache}"]
        cfg = validate(to_train_config(compose("config", overrides=overrides)))
    cfg.out_dir = str(run)
    return cfg


@pytest.mark.slow
def test_refused_launches_leave_every_byte_of_the_folder(runs, tmp_path) -> None:
    """Config mismatch of either checkpoint, other cold start, a single-process checkpoint under N > 1: each
    refused with RunDirectoryError, and the folder (.hydra/ included) is as it was.

    Every refusal is one check, `refuse_foreign_dir`, which `experiments/train.py` makes before it writes anything
    (under python and under torchrun alike): each of the four is checked in this process on the config the launch
    composes, and two are launched, one with plain python (the config mismatch of the sharded checkpoint; the script
    run in this process, `_python`) and one under torchrun (the single-process checkpoint only a world of 2 meets), to
    show that a refused launch writes nothing in the folder, Hydra's record included."""
    from moe_rl.config import config_hash
    from moe_rl.train import refuse_foreign_dir

    root, cache = runs
    extra = ("steps=6", "replay=r3", "keep_checkpoint=true")
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    shutil.copytree(root / "r3_1", single)  # a world of size 1: checkpoint.pt
    shutil.copytree(root / "r3_2", sharded)  # two ranks: checkpoint.json and its shards
    (single / "status.json").unlink()  # as if killed after its last checkpoint: only the checkpoint speaks
    (sharded / "status.json").unlink()
    pointer = json.loads((sharded / "checkpoint.json").read_text())
    (tmp_path / "other_cold").mkdir()
    shutil.copytree(sharded, tmp_path / "other_cold" / "run")
    other_cold = tmp_path / "other_cold" / "run"
    (other_cold / "checkpoint.json").write_text(json.dumps({**pointer, "cold_start_key": "another"}))
    # the composed config is the launched one: both checkpoints carry its hash (so no refusal below is vacuous)
    own = config_hash(_composed(single, cache, *extra))
    assert pointer["config_hash"] == own == torch.load(single / "checkpoint.pt", weights_only=True)["config_hash"]
    checks = [
        (single, ("optim.lr=1e-4",), 1, "another config"),
        (sharded, ("optim.lr=1e-4",), 1, "another config"),
        (single, (), 2, "single-process checkpoint"),
        (other_cold, (), 2, "another cold start"),
    ]
    for run, change, world_size, reason in checks:
        before = _digest(run)
        assert any(name.startswith(".hydra/") for name in before) and "checkpoint" in " ".join(before)
        with pytest.raises(RunDirectoryError, match=reason):
            refuse_foreign_dir(_composed(run, cache, *extra, *change), world_size)
        assert _digest(run) == before, (reason, run.name)
    launches = [
        (lambda run: _python(run, cache, *extra, "optim.lr=1e-4", check=False), sharded, "another config"),
        (lambda run: _torchrun(2, run, cache, *extra, check=False), single, "single-process checkpoint"),
    ]
    for relaunch, run, reason in launches:
        before = _digest(run)
        out = relaunch(run)
        assert out.returncode != 0 and "RunDirectoryError" in out.stderr and reason in out.stderr, out.stderr[-3000:]
        assert _digest(run) == before, (reason, run.name)


@pytest.mark.slow
def test_two_ranks_log_what_one_rank_logs(runs) -> None:
    root, _ = runs
    one, two = run_values(root / "r3_1"), run_values(root / "r3_2")
    assert one[["step", "key"]].equals(two[["step", "key"]])
    assert (root / "r3_2" / "metrics.parquet").is_file() and not list(root.rglob("*rank*"))
    meta = json.loads((root / "r3_2" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["strategy"] == "fsdp"
    both = one.merge(two, on=["step", "key"], suffixes=("_1", "_2"))
    # Flip-vs-margin counts: the same (t, l) and flips in total; a margin within ~1e-5 of a bin edge may
    # land in the neighbouring bin, as margins are continuous values of slightly different parameters.
    binned = both[both["key"].str.startswith("route/flip_vs_margin/")].copy()
    binned["kind"] = binned["key"].str.extract(r"flip_vs_margin/(\w+)/bin", expand=False)
    totals = binned.groupby(["step", "kind"])[["value_1", "value_2"]].sum()
    assert len(totals) and (totals["value_1"] == totals["value_2"]).all()
    both = both[~both["key"].str.startswith("route/flip_vs_margin/")]
    # The same rollouts (per-row sampling streams) and the same routes: rewards, accuracy and every
    # route flip rate are ratios of the same integer counts, hence equal to the last bit.
    exact = both["key"].str.match(
        r"(reward/|task/accuracy|route/\w+/(flip_rate|expert_flip_frac|token_flip_rate)"
        r"|rollout/response_len)"
    )
    assert exact.sum() > 50
    pd.testing.assert_series_equal(both.loc[exact, "value_1"], both.loc[exact, "value_2"], check_names=False)
    # Continuous values differ by summation order only: FSDP's reduce-scatter sums the ranks' gradients in
    # another order than one backward over all rows (a few u relative per update). Adam divides by
    # sqrt(v) + 1e-8, so a gradient difference dg moves a parameter by at most lr * dg / 1e-8: with gradients
    # of order 1, dg ~ 1e3 u ~ 1e-13 (sums over ~1e3 terms) gives 1e-8 lr = 1e-11 per update, ~1e-10 after 12
    # updates. Metrics are smooth functions of the parameters: relative 1e-8 bounds them with a margin of 1e2,
    # and a wrong share of the loss (O(lr) = 1e-3 in the parameters) exceeds it by 1e5.
    close = both[~exact]
    worst_metric = ((close["value_1"] - close["value_2"]).abs() / (1 + close["value_1"].abs())).max()
    assert worst_metric <= 1e-8, close.assign(d=(close["value_1"] - close["value_2"]).abs()).nlargest(5, "d")
    # Parameters after K = 6 steps (12 AdamW updates at lr 1e-3; keep_checkpoint keeps the final weights):
    # the bound above (1e-10) with the same margin, 1e-8 = 1e-5 lr; a wrong loss share moves them by O(lr).
    a, b = _params(root / "r3_1"), _params(root / "r3_2")
    assert a.keys() == b.keys() and all(a[k].dtype == torch.float64 for k in a)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"two ranks vs one: worst metric {worst_metric:.3g} relative, worst parameter {worst:.3g}")
    assert worst < 1e-8, worst
    used = both[both["key"] == "route/used_vs_cached/flip_rate"]
    assert len(used) == 6 and (used[["value_1", "value_2"]] == 0).all().all()


def _worker_pid(torchrun: subprocess.Popen, rank: int) -> int:
    """The pid of the torchrun worker with RANK=rank (a child of the torchrun process)."""
    children = Path(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children").read_text().split()
    for pid in children:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no worker with RANK={rank} among {children}")


@pytest.mark.slow
def test_sigkill_of_one_rank_ends_the_job_and_the_rerun_resumes_exactly(runs) -> None:
    root, cache = runs
    run = root / "killed"
    extra = ("steps=6", "replay=r3")
    proc = _torchrun(2, run, cache, *extra, wait=False)
    deadline = time.time() + 300
    while not (run / "metrics" / "part-0000004.parquet").exists():  # checkpoints of steps 2 and 4 exist
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.05)
    os.kill(_worker_pid(proc, 1), signal.SIGKILL)
    assert proc.wait(timeout=120) != 0  # torchrun stops rank 0 too and fails: no hang
    status = json.loads((run / "status.json").read_text())
    # rank 0 either sees its peer's collective fail (peer_lost) or is stopped by torchrun first: either
    # way the run is interrupted and resumable, as a killed `python` run is
    assert status["status"] == "running" and 4 <= status["steps_done"] < 6
    out = _torchrun(2, run, cache, *extra)
    assert "resuming" in out.stdout + out.stderr
    assert json.loads((run / "status.json").read_text())["steps_done"] == 6
    pd.testing.assert_frame_equal(run_values(run), run_values(root / "r3_2"))
    assert not (run / "checkpoint.json").exists() and not list(run.glob("checkpoint-*"))


# The submitit sweep's runs: R2 on 2 ranks, 4 steps, the final checkpoint kept, one job per strategy.
SWEEP = ("steps=4", "replay=r2", "keep_checkpoint=true")


@pytest.fixture(scope="module")
def sweep(runs, tmp_path_factory):
    """The Slurm recipe of docs/scale.md with submitit's local executor (2 tasks per node: each task of a job is one
    rank), a multirun of two jobs, DDP and FSDP2: (its command, its results folder, the launch's output). The
    submitit test reads the sweep and reruns it; the DDP test resumes a copy of its DDP run."""
    _, cache = runs
    results = tmp_path_factory.mktemp("submitit")
    cmd = [
        sys.executable,
        "experiments/train.py",
        "-m",
        *OVERRIDES,
        *SWEEP,
        "dist.strategy=ddp,fsdp",
        f"cold_start.cache_dir={cache}",
        f"results_dir={results}",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=10",
    ]
    out = subprocess.run(cmd, check=False, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=900)
    return cmd, results, out


def _sweep_runs(sweep) -> dict[str, Path]:
    """The sweep's run folders by their strategy (meta.json's), once the launch is seen to have succeeded."""
    _, results, out = sweep
    assert out.returncode == 0, out.stderr[-3000:]
    metas = sorted(results.rglob("meta.json"))
    return {json.loads(meta.read_text())["strategy"]: meta.parent for meta in metas}


@pytest.mark.slow
def test_ddp_r2_replays_exactly_and_resumes_on_another_world_size(runs, sweep, tmp_path) -> None:
    """The DDP run is the submitit sweep's DDP job (2 ranks, one per task), resumed here in a copy of its folder. The
    world of size 1 that resumes its checkpoint is plain python: a world of size 1 takes the same path under torchrun
    with one process (no process group: `Dist` is inactive), and the two launches log bitwise the same
    (`test_python_and_torchrun_with_one_process_log_bitwise_the_same`)."""
    _, cache = runs
    run = tmp_path / "ddp"
    extra = SWEEP
    shutil.copytree(_sweep_runs(sweep)["ddp"], run)  # the sweep's own folder stays as the sweep left it
    meta = json.loads((run / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["strategy"] == "ddp" and (run / "checkpoint.json").is_file()
    first = run_values(run)
    used = first[first["key"] == "route/used_vs_cached/flip_rate"]
    assert len(used) == 4 and (used["value"] == 0).all()
    # The kept checkpoint (the final step's, sharded by DDP on 2 ranks) resumes in a world of size 1: DCP
    # reshards, and the world of size 1 writes back bitwise the weights the two ranks saved.
    (run / "status.json").unlink()  # else the finished run is skipped
    sharded = _params(run)
    out = _python(run, cache, *extra)
    assert "resuming" in out.stdout + out.stderr and "resharding" in out.stdout + out.stderr
    assert json.loads((run / "status.json").read_text())["steps_done"] == 4
    resharded = _params(run)
    assert sharded.keys() == resharded.keys() and all(torch.equal(sharded[k], resharded[k]) for k in sharded)
    again = run_values(run)
    rewards = again["key"].isin(["reward/mean", "route/used_vs_cached/flip_rate"])
    pd.testing.assert_frame_equal(again[rewards], first[rewards])


@pytest.mark.slow
def test_fsdp2_sharded_routers_record_and_replay_under_gradient_checkpointing() -> None:
    worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = launch([*worker, str(ROOT / "tests" / "dist_worker.py")], env=env, check=False, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("ok") == 2


@pytest.mark.slow
def test_submitit_tasks_per_node_runs_each_job_of_a_multirun_on_that_many_ranks(sweep) -> None:
    """The Slurm recipe of docs/scale.md with submitit's local executor: each task of a job is one rank, in each job
    of the sweep (one per strategy, DDP and FSDP2, each as the job's config names it)."""
    cmd, results, _ = sweep
    folders = _sweep_runs(sweep)
    assert sorted(folders) == ["ddp", "fsdp"] and len(list(results.rglob("meta.json"))) == 2
    for strategy, folder in folders.items():
        doc = json.loads((folder / "meta.json").read_text())
        assert doc["world_size"] == 2 and doc["strategy"] == strategy, doc
        assert json.loads((folder / "status.json").read_text())["status"] in ("completed", "collapsed")
    # The same sweep again (Hydra's basic launcher this time), the script run in this process (`run_train`): both
    # runs are finished, so both are skipped and nothing in their folders is rewritten.
    stamps = {s: (folder / "metrics.parquet").stat().st_mtime_ns for s, folder in folders.items()}
    again = run_train(*(c for c in cmd[2:] if not c.startswith("hydra")))
    assert again.returncode == 0, again.stderr[-3000:]
    assert (again.stdout + again.stderr).count("skipping") == 2, again.stdout[-3000:]
    assert {s: (folder / "metrics.parquet").stat().st_mtime_ns for s, folder in folders.items()} == stamps


@pytest.mark.slow
def test_two_ranks_log_what_one_rank_logs_with_the_new_stabilizers(tmp_path, cache) -> None:
    """SAPO with RSPO's factor, thresholded R2 and TIS in one config: 2 ranks log what 1 logs. Their
    statistics are sums of the rows' counts (fallback slots, truncated tokens) or loss means with their
    denominators, so they pool exactly; the bounds are those of `test_two_ranks_log_what_one_rank_logs`."""
    extra = ("steps=3", "algo=sapo", "algo.router_shift=true", "replay=r2_threshold", "rollout.is_correction=tis")
    _python(tmp_path / "run_1", cache, *extra)  # one rank: plain python (torchrun's world of 1, bitwise)
    _torchrun(2, tmp_path / "run_2", cache, *extra)
    one, two = run_values(tmp_path / "run_1"), run_values(tmp_path / "run_2")
    assert one[["step", "key"]].equals(two[["step", "key"]])
    both = one.merge(two, on=["step", "key"], suffixes=("_1", "_2"))
    new = both["key"].isin(
        [
            "route/replay_fallback_frac",
            "ratio/router_shift_scale",
            "rollout/is_weight_mean",
            "rollout/is_truncated_frac",
        ]
    )
    assert new.sum() == 4 * 3
    loss = both[both["key"].isin(["loss", "loss/policy"])]
    assert ((loss["value_1"] - loss["value_2"]).abs() < 1e-5).all()
    close = both[new]
    assert ((close["value_1"] - close["value_2"]).abs() <= 1e-4 * (1 + close["value_1"].abs())).all(), close


def test_two_ranks_anchor_and_scale_expert_steps_as_one_rank(tmp_path, cache) -> None:
    """Anchored routing (each rank's anchor a whole copy of the cold start) with the load-aware expert step (the
    tokens per expert summed over the ranks, FSDP2's sharded experts scaled row by row): 2 ranks end at the
    weights 1 rank ends at, within the bound of `test_two_ranks_log_what_one_rank_logs`."""
    extra = ("steps=3", "replay=anchored", "optim.expert_step=load_aware", "keep_checkpoint=true")
    _python(tmp_path / "run_1", cache, *extra)  # one rank: plain python (torchrun's world of 1, bitwise)
    _torchrun(2, tmp_path / "run_2", cache, *extra)
    one, two = run_values(tmp_path / "run_1"), run_values(tmp_path / "run_2")
    assert one[["step", "key"]].equals(two[["step", "key"]])
    a, b = _params(tmp_path / "run_1"), _params(tmp_path / "run_2")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-8
