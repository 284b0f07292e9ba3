"""`compile=true` (moe_rl.loop.compiled): route recording and replay under a compiled policy, and the loop's graphs.

The tests trace with Dynamo's `eager` backend (`compiled.BACKEND`): the graphs Dynamo captures, hooks included, run
by ATen instead of inductor's generated kernels, so a compiled pass must give the eager pass's numbers bitwise, and
a hook Dynamo dropped or ran on a stale context shows as a difference. Inductor's own numbers are its own domain.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.config as dynamo_config
from helpers import run_values, tiny_config

from moe_rl.loop import compiled
from moe_rl.models import build_model
from moe_rl.routing import RoutedPass, RouteRecorder, Routes


@pytest.fixture(autouse=True)
def _traced_by_dynamo_only(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    names = ("skip_nnmodule_hook_guards", "recompile_limit", "accumulated_recompile_limit")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with dynamo_config.patch({name: getattr(dynamo_config, name) for name in names}):  # restored after the test
        yield
    torch._dynamo.reset()


def _pass(model, ids: torch.Tensor, routes: Routes | None = None) -> tuple[torch.Tensor, Routes]:
    with torch.no_grad(), RoutedPass(model, routes) as routed:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    return logits, routed.used


def test_route_contexts_opened_after_a_hookless_compiled_pass_record_and_replay() -> None:
    """The loop's rollout records routes on some steps only: a graph traced without hooks must not serve a pass
    with them (Dynamo's default, `skip_nnmodule_hook_guards`, would: the recorder then records nothing). Each new
    context, recording or replaying, gets the eager pass's logits and routes bitwise, with no graph per context."""
    eager = build_model("qwen3_moe")
    model = build_model("qwen3_moe")
    compiled.compile_policy(model, numerics="native")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, eager.config.vocab_size, (3, 7), generator=gen)
    with torch.no_grad():
        model(input_ids=ids)  # traced with no hook on any router
    graphs = []
    for _ in range(5):
        x = torch.randint(3, eager.config.vocab_size, (3, 7), generator=gen)
        want_logits, want = _pass(eager, x)
        got_logits, got = _pass(model, x)
        assert torch.equal(got.indices, want.indices) and torch.equal(got_logits, want_logits)
        forced = Routes.from_topk((want.indices.long() + 1) % want.num_experts, want.mask, want.layer_map, 8)
        want_logits, _ = _pass(eager, x, forced)
        got_logits, used = _pass(model, x, forced)
        assert torch.equal(used.indices, forced.indices) and torch.equal(got_logits, want_logits)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[-1], graphs  # a graph per set of hooks, not one per context
    with torch.no_grad(), RouteRecorder(model) as recorder:  # a recorder alone, as the rollout's
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert torch.equal(recorder.routes.indices, _pass(eager, ids)[1].indices)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs[-1]


def test_a_recorded_sampling_traces_no_graph_per_decode_step() -> None:
    """A recorder grows its record by one pass per KV-cache step; traced, the list lengths would be guards and every
    decode step a recompile (47 graphs in a 20-step R2 run, 25 without). The hooks' bookkeeping runs eager: a longer
    recorded sampling adds no graph, and its routes are the eager sampler's."""
    from moe_rl.rollout.sampler import sample_loop

    eager = build_model("qwen3_moe")
    model = build_model("qwen3_moe")
    compiled.compile_policy(model, numerics="native")
    ids = torch.randint(3, eager.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))

    def sampled(m, tokens: int) -> Routes:
        torch.manual_seed(1)
        with torch.no_grad(), RouteRecorder(m) as recorder:
            sample_loop(m, ids, torch.ones_like(ids), max_new_tokens=tokens, eos_token_id=-1, pad_token_id=0)
        return recorder.routes

    assert torch.equal(sampled(model, 3).indices, sampled(eager, 3).indices)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    longer = sampled(model, 8)
    assert torch.equal(longer.indices, sampled(eager, 8).indices) and longer.indices.shape[1] == 5 + 8 - 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


# What the rollout's log-probs move (the sampler's decode steps under Dynamo round differently from eager, in float32's
# last bits): the rollout-vs-old-pass gap metrics. Every other number is bitwise the eager run's.
ROLLOUT_GAP = (
    "rollout/k3_kl",
    "rollout/logp_abs_diff",
    "rollout/logp_gap",
    "rollout/logp_sq_diff",
    "rollout/token_mult_prob_error",
)


@pytest.mark.slow
def test_a_compiled_r2_run_breaks_no_graph_traces_none_after_warm_up_and_is_the_eager_run(
    tmp_path, cache, monkeypatch
) -> None:
    """Six learning steps of R2, eager and compiled, the route instruments and an evaluation every 2nd step: Dynamo
    broke no graph, traced none after step 4 (each pass meets each of its variants by then: with or without the
    route instruments' records, train or eval mode, a first or a later shape), and the losses, ratios, routes,
    grads, router logits and accuracy are the eager run's bitwise; the rollout-vs-old-pass log-prob gap stays at
    float32 rounding (each log-prob of float32 logits below 100 in size is good to ~1e-5). The rollout samples
    without hooks, the old pass records, the updates replay and record."""
    import json

    from moe_rl import train as training

    graphs: list[int] = []
    step = training.Trainer.step

    def counted(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return out

    monkeypatch.setattr(training.Trainer, "step", counted)
    runs = {}
    for flag in ("false", "true"):
        changes = (
            "steps=6",
            "eval_every=2",
            "replay.mode=r2",
            "metrics.route_every=2",
            "optim.lr=2e-4",
            f"compile={flag}",
        )
        assert training.train(tiny_config(tmp_path / flag, *changes, cache=cache))["status"] == "completed"
        runs[flag] = run_values(tmp_path / flag).set_index(["step", "key"])["value"]
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    compiled_graphs = graphs[6:]
    assert graphs[:6] == [0] * 6 and compiled_graphs[0] >= 3  # sampling, the old pass, the updates
    assert compiled_graphs[3:] == [compiled_graphs[3]] * 3, compiled_graphs
    eager, comp = runs["false"], runs["true"]
    assert eager.index.equals(comp.index)
    assert eager.index.get_level_values("key").str.startswith("route/router/logit_rms").any()
    gap = eager.index.get_level_values("key").isin(ROLLOUT_GAP)
    assert comp[~gap].equals(eager[~gap])
    assert (comp[gap] - eager[gap]).abs().max() < 1e-5
    assert json.loads((tmp_path / "true" / "meta.json").read_text())["compiled"] is True


def test_runs_the_harness_does_not_compile_say_why() -> None:
    assert compiled.refuse_compile(engine="hf", world_size=1) is None
    assert "vllm" in str(compiled.refuse_compile(engine="vllm", world_size=1))
    assert "2 processes" in str(compiled.refuse_compile(engine="hf", world_size=2))


def test_a_compiled_warm_up_is_a_start_of_its_own_and_traced_it_is_the_eager_warm_up() -> None:
    """`cold_start.compile=true` compiles the SFT steps: another numerics domain under inductor, so another key (the
    default's key unchanged); traced by Dynamo and run by ATen, its weights and history are the eager warm-up's
    bitwise (the evaluations stay eager)."""
    from moe_rl.config import ColdStartConfig, ModelConfig, TaskConfig
    from moe_rl.loop.cold_start import cold_start_key, train_cold_start

    task = TaskConfig(n_train=64, n_eval=8)
    eager_cold = ColdStartConfig(eval_every=10, max_steps=20)
    compiled_cold = ColdStartConfig(eval_every=10, max_steps=20, compile=True)
    assert cold_start_key(ModelConfig(), task, ColdStartConfig(compile=False)) == cold_start_key(
        ModelConfig(), task, ColdStartConfig()
    )
    assert cold_start_key(ModelConfig(), task, compiled_cold) != cold_start_key(ModelConfig(), task, eager_cold)
    eager, _, eager_info = train_cold_start(ModelConfig(), task, eager_cold)
    model, _, info = train_cold_start(ModelConfig(), task, compiled_cold)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert info["history"] == eager_info["history"] and info["steps"] == 20
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), eager.state_dict().values(), strict=True))
