"""Advantages and policy losses: hand-computed values, clip cases, gradients, GSPO == GSPO-token, DPPO's trust
regions, VESPO's kernel and the off-policy sequence mask."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from moe_rl.algos import (
    AGG_MODES,
    LOSSES,
    Loss,
    cispo_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    get_loss,
    group_advantages,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    offpolicy_sequence_mask,
    sapo_loss,
    vespo_loss,
)
from moe_rl.algos.corrections import engine_weight
from moe_rl.algos.loss_record import ABOVE_0, AT_LEAST_0, EPS_RANGES, UNIT, Range
from moe_rl.algos.losses import SHARED_ARGS

LN = math.log
DT = torch.float64


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=DT)


# ---------------------------------------------------------------- group_advantages


def test_group_advantages_by_hand_population_std():
    # group 0: [0, 3, 3], mean 2, deviations [-2, 1, 1], population var (4+1+1)/3 = 2, std sqrt(2)
    # group 1: [1, 1, 1], zero variance -> zeros
    # group 2: [0.1, 0.1, 0.1], zero variance even though its float mean need not equal 0.1 exactly
    # group 3: [1, 0, 0], mean 1/3, deviations [2/3, -1/3, -1/3], var (4/9+1/9+1/9)/3 = 2/9
    rewards = _t([0, 3, 3, 1, 1, 1, 0.1, 0.1, 0.1, 1, 0, 0])
    adv = group_advantages(rewards, group_size=3, eps=0.0)
    s2, s29 = math.sqrt(2), math.sqrt(2 / 9)
    expected = [-2 / s2, 1 / s2, 1 / s2, 0, 0, 0, 0, 0, 0, (2 / 3) / s29, (-1 / 3) / s29, (-1 / 3) / s29]
    torch.testing.assert_close(adv, _t(expected))
    assert adv[3:9].eq(0).all()


def test_group_advantages_eps_and_int_rewards():
    # [1, 0] -> mean 0.5, population std 0.5 -> A = +-0.5 / (0.5 + eps)
    adv = group_advantages(torch.tensor([1, 0, 0, 0]), group_size=2, eps=0.25)
    assert adv.is_floating_point()
    torch.testing.assert_close(adv, torch.tensor([0.5 / 0.75, -0.5 / 0.75, 0.0, 0.0]))


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="not divisible by group_size=3"):
        group_advantages(torch.zeros(7), group_size=3)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), group_size=4)


# ---------------------------------------------------------------- GRPO by hand

# Token ratios r = exp(logp - old_logp) with eps_low 0.2, eps_high 0.27, clip range [0.8, 1.27].
# seq 0, A = +1, 3 valid tokens:
#   r = 1.5 > 1.27, A > 0: min(1.5, 1.27) = 1.27          -> loss -1.27  clipped (high)
#   r = 0.5 < 0.8,  A > 0: min(0.5, 0.8)  = 0.5           -> loss -0.5   unclipped
#   r = 1.0 inside:                                        -> loss -1.0   unclipped
# seq 1, A = -2, 2 valid tokens (third masked):
#   r = 1.5 > 1.27, A < 0: min(-3, -2.54) = -3            -> loss  3.0   unclipped
#   r = 0.5 < 0.8,  A < 0: min(-1, -1.6)  = -1.6          -> loss  1.6   clipped (low)
# seq-mean-token-mean = (-(1.27 + 0.5 + 1)/3 + (3 + 1.6)/2) / 2 = (-2.77/3 + 2.3) / 2
# token-mean          = (-1.27 - 0.5 - 1 + 3 + 1.6) / 5 = 1.83 / 5
SEQ_MEAN = (-2.77 / 3 + 2.3) / 2
TOKEN_MEAN = 1.83 / 5


def _grpo_example():
    old_logp = _t([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])
    delta = _t([[LN(1.5), LN(0.5), 0.0], [LN(1.5), LN(0.5), LN(1.1)]])
    logp = (old_logp + delta).requires_grad_(True)
    adv = _t([1.0, -2.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return logp, old_logp, adv, mask


@pytest.mark.parametrize(("agg", "expected"), [("seq-mean-token-mean", SEQ_MEAN), ("token-mean", TOKEN_MEAN)])
def test_grpo_by_hand(agg, expected):
    logp, old_logp, adv, mask = _grpo_example()
    loss, m = grpo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg=agg)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["loss/policy"] == pytest.approx(expected, rel=1e-12)
    # one of 5 valid tokens clipped on each side
    assert m["ratio/clipfrac_high"] == pytest.approx(1 / 5)
    assert m["ratio/clipfrac_low"] == pytest.approx(1 / 5)
    assert "kl/ref_k3" not in m
    assert all(isinstance(v, float) for v in m.values())


def test_grpo_gradient_by_hand_token_mean():
    # d loss / d logp = -A r / N on unclipped tokens (d r / d logp = r), 0 on clipped or masked ones:
    # seq 0: [0, -1 * 0.5 / 5, -1 * 1 / 5] = [0, -0.1, -0.2]; seq 1: [2 * 1.5 / 5, 0, 0] = [0.6, 0, 0]
    logp, old_logp, adv, mask = _grpo_example()
    loss, _ = grpo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean")
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _t([[0.0, -0.1, -0.2], [0.6, 0.0, 0.0]]))


def test_grpo_empty_sequence_and_garbage_at_masked_positions():
    # an all-masked row contributes nothing; inf / NaN / huge logp at masked positions stay out
    logp, old_logp, adv, mask = _grpo_example()
    logp = torch.cat([logp.detach(), _t([[1000.0, float("inf"), float("nan")]])]).requires_grad_(True)
    logp.data[1, 2] = 1000.0  # masked position of a non-empty row
    old_logp = torch.cat([old_logp, _t([[0.0, 0.0, 0.0]])])
    adv = torch.cat([adv, _t([5.0])])
    mask = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])
    ref_logp = old_logp.clone()
    for agg, expected in (("seq-mean-token-mean", SEQ_MEAN), ("token-mean", TOKEN_MEAN)):
        loss, m = grpo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg=agg, ref_logp=ref_logp, beta=0.1)
        assert m["loss/policy"] == pytest.approx(expected, rel=1e-12)
        assert m["ratio/clipfrac_high"] == pytest.approx(1 / 5)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert grad[2].eq(0).all() and grad[1, 2] == 0


@pytest.mark.parametrize("delta", [None, 0.1], ids=["no_mask", "offpolicy_mask"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_positions_never_leak(name, agg, delta):
    # Every loss, with a weight and (token losses) a ratio scale, with and without the off-policy sequence
    # mask: garbage (inf / NaN / huge) in logp, weight and ratio_scale at masked positions, plus an all-masked
    # row, gives bitwise the value and gradient of the clean batch, and a zero gradient at every masked position.
    logp, old_logp, adv, mask = _grpo_example()
    weight = _t([[2.0, 0.5, 1.0], [0.5, 1.0, 1.0]])
    scale = _t([[0.5, 1.0, 1.0], [1.0, 2.0, 1.0]]) if LOSSES[name].takes_ratio_scale else None
    if not LOSSES[name].weighs_tokens:
        weight = _t([[2.0, 2.0, 2.0], [0.5, 0.5, 0.5]])  # a sequence-level weight
    kw = dict(agg=agg, beta=0.1, offpolicy_mask_delta=delta)
    clean, _ = LOSSES[name](
        logp=logp, old_logp=old_logp, adv=adv, mask=mask, ref_logp=old_logp, weight=weight, ratio_scale=scale, **kw
    )
    (clean_grad,) = torch.autograd.grad(clean, logp)
    bad = _t([[1000.0, float("inf"), float("nan")]])
    dirty = torch.cat([logp.detach(), bad])
    dirty[1, 2] = float("nan")
    dirty.requires_grad_(True)
    nan_row = _t([[float("nan")] * 3])
    dirty_weight = torch.cat([weight, nan_row])
    dirty_weight[1, 2] = float("inf")
    dirty_scale = None
    if scale is not None:
        dirty_scale = torch.cat([scale, nan_row])
        dirty_scale[1, 2] = float("nan")
    loss, _ = LOSSES[name](
        logp=dirty,
        old_logp=torch.cat([old_logp, _t([[0.0, float("nan"), 0.0]])]),
        adv=torch.cat([adv, _t([5.0])]),
        mask=torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)]),
        ref_logp=torch.cat([old_logp, bad]),
        weight=dirty_weight,
        ratio_scale=dirty_scale,
        **kw,
    )
    (grad,) = torch.autograd.grad(loss, dirty)
    assert loss.item() == clean.item()
    assert torch.equal(grad[:2], clean_grad) and grad[2].eq(0).all() and grad[1, 2] == 0


def test_all_empty_batch_gives_zero_loss():
    z = torch.zeros(2, 3, dtype=DT, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for name, fn in LOSSES.items():
        loss, m = fn(logp=z, old_logp=z.detach(), adv=_t([1.0, -1.0]), mask=mask)
        assert loss.item() == 0.0, name
        assert m["ratio/clipfrac_low"] == 0.0 and m["ratio/clipfrac_high"] == 0.0


def test_grpo_token_level_advantage_equals_broadcast():
    logp, old_logp, adv, mask = _grpo_example()
    a, _ = grpo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask)
    b, _ = grpo_loss(logp=logp, old_logp=old_logp, adv=adv[:, None].expand(2, 3), mask=mask)
    assert a.item() == b.item()


def test_grpo_gradient_on_policy_is_advantage_weighted_logp_gradient():
    # at theta == theta_old every r = 1 is inside the clip range, so
    # grad loss = -mean_i (A_i / |y_i|) sum_t grad logp_{i,t}   (seq-mean-token-mean)
    g = torch.Generator().manual_seed(0)
    B, T, V, H = 4, 5, 7, 3
    w = torch.randn(H, V, generator=g, dtype=DT, requires_grad=True)
    x = torch.randn(B, T, H, generator=g, dtype=DT)
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(x @ w, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    adv = _t([1.0, -0.5, 2.0, -1.5])
    loss, m = grpo_loss(logp=logp, old_logp=logp.detach(), adv=adv, mask=mask)
    surrogate = -((adv[:, None] * logp * mask).sum(-1) / mask.sum(-1)).mean()
    torch.testing.assert_close(loss, -(adv.mean()))  # value: -mean_i A_i * 1
    (grad_loss,) = torch.autograd.grad(loss, w, retain_graph=True)
    (grad_surrogate,) = torch.autograd.grad(surrogate, w)
    torch.testing.assert_close(grad_loss, grad_surrogate)
    assert m["ratio/clipfrac_low"] == 0.0 and m["ratio/clipfrac_high"] == 0.0


# ---------------------------------------------------------------- KL term


def _kl_example():
    # ref - logp = [ln 2, -ln 2] (seq 0), [ln 2, masked] (seq 1)
    # k3 = exp(x) - x - 1: ln 2 -> 2 - ln2 - 1 = 1 - ln2;  -ln 2 -> 1/2 + ln2 - 1 = ln2 - 1/2
    # seq 0 mean = (1 - ln2 + ln2 - 1/2) / 2 = 1/4;  seq 1 mean = 1 - ln2
    logp = _t([[-1.0, -2.0], [-0.5, -0.3]]).requires_grad_(True)
    ref_logp = logp.detach() + _t([[LN(2), -LN(2)], [LN(2), 9.0]])
    mask = torch.tensor([[True, True], [True, False]])
    return logp, ref_logp, mask


@pytest.mark.parametrize(
    ("agg", "kl"),
    [("seq-mean-token-mean", (0.25 + 1 - LN(2)) / 2), ("token-mean", (0.5 + 1 - LN(2)) / 3)],
)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_kl_term(name, agg, kl):
    # policy term is 0 (A = 0), so loss = beta * kl; and at beta = 0 the KL is reported but not added
    logp, ref_logp, mask = _kl_example()
    adv = _t([0.0, 0.0])
    loss, m = LOSSES[name](logp=logp, old_logp=logp.detach(), adv=adv, mask=mask, ref_logp=ref_logp, beta=0.1, agg=agg)
    assert m["kl/ref_k3"] == pytest.approx(kl, rel=1e-12)
    assert loss.item() == pytest.approx(0.1 * kl, rel=1e-12)
    assert m["loss/policy"] == 0.0
    loss0, m0 = LOSSES[name](logp=logp, old_logp=logp.detach(), adv=adv, mask=mask, ref_logp=ref_logp, agg=agg)
    assert loss0.item() == 0.0 and m0["kl/ref_k3"] == pytest.approx(kl, rel=1e-12)


def test_kl_gradient_by_hand():
    # d k3 / d logp = d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    # token-mean over 3 tokens, beta 0.1: 0.1 * [(1 - 2)/3, (1 - 1/2)/3, (1 - 2)/3]
    logp, ref_logp, mask = _kl_example()
    loss, _ = grpo_loss(
        logp=logp, old_logp=logp.detach(), adv=_t([0.0, 0.0]), mask=mask, ref_logp=ref_logp, beta=0.1, agg="token-mean"
    )
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, 0.1 * _t([[-1 / 3, 0.5 / 3], [-1 / 3, 0.0]]))


# ---------------------------------------------------------------- GSPO by hand


# Sequence ratio s_i = exp(mean of valid deltas); custom eps 0.2 / 0.27, clip range [0.8, 1.27].
# seq 0, A = +1, deltas [ln 4, 0]        -> s = exp(ln 2) = 2  > 1.27, A > 0: min(2, 1.27)     -> -1.27 clipped high
# seq 1, A = -1, deltas [ln 1/4, 0]      -> s = 1/2 < 0.8,     A < 0: min(-0.5, -0.8)  -> 0.8   clipped low
# seq 2, A = +1, deltas [ln 1/4, 0, ln 4] -> s = 1 inside                              -> -1.0
# seq 3, A = -1, deltas [ln 4, 0]        -> s = 2,             A < 0: min(-2, -1.27)   -> 2.0   unclipped
# seq 4, A = +1, deltas [ln 1/4, 0]      -> s = 1/2,           A > 0: min(0.5, 0.8)    -> -0.5  unclipped
# (the third column of seqs 0, 1, 3, 4 is masked and holds a large delta that must be ignored)
# loss = (-1.27 + 0.8 - 1 + 2 - 0.5) / 5 = 0.03 / 5
def _gspo_example():
    old_logp = -torch.arange(15, dtype=DT).view(5, 3) / 10 - 0.1
    delta = _t([[LN(4), 0, 5], [LN(0.25), 0, 5], [LN(0.25), 0, LN(4)], [LN(4), 0, 5], [LN(0.25), 0, 5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    return (old_logp + delta).requires_grad_(True), old_logp, _t([1.0, -1.0, 1.0, -1.0, 1.0]), mask


@pytest.mark.parametrize(("fn", "n_valid"), [(gspo_loss, 5), (gspo_token_loss, 11)])
def test_gspo_by_hand(fn, n_valid):
    # gspo counts clipped sequences (1 of 5 per side); gspo_token counts tokens (2 of 11 per side)
    logp, old_logp, adv, mask = _gspo_example()
    loss, m = fn(logp=logp, old_logp=old_logp, adv=adv, mask=mask, eps_low=0.2, eps_high=0.27)
    assert loss.item() == pytest.approx(0.03 / 5, rel=1e-9)
    assert m["loss/policy"] == pytest.approx(0.03 / 5, rel=1e-9)
    clipped = 1 if fn is gspo_loss else 2
    assert m["ratio/clipfrac_high"] == pytest.approx(clipped / n_valid)
    assert m["ratio/clipfrac_low"] == pytest.approx(clipped / n_valid)


def test_gspo_gradient_by_hand():
    # unclipped sequences: d loss / d logp_t = -(1/B) A_i s_i / |y_i|; clipped ones: 0
    # seq 2: -(1/5) * 1 * 1 / 3;  seq 3: (1/5) * 2 / 2;  seq 4: -(1/5) * 0.5 / 2
    logp, old_logp, adv, mask = _gspo_example()
    loss, _ = gspo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, eps_low=0.2, eps_high=0.27)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = _t([[0, 0, 0], [0, 0, 0], [-1 / 15] * 3, [0.2, 0.2, 0], [-0.05, -0.05, 0]])
    torch.testing.assert_close(grad, expected)


def test_gspo_default_eps_clips_almost_everything():
    # with eps 3e-4 / 4e-4 the same batch is clipped wherever the clipped branch can be active
    logp, old_logp, adv, mask = _gspo_example()
    loss, m = gspo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask)
    # seq 0: -(1 + 4e-4); seq 1: (1 - 3e-4); seq 2: -1; seq 3: 2; seq 4: -0.5
    assert loss.item() == pytest.approx((-(1 + 4e-4) + (1 - 3e-4) - 1 + 2 - 0.5) / 5, rel=1e-9)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_gspo_equals_gspo_token_on_random_inputs(agg):
    g = torch.Generator().manual_seed(1)
    B, T = 8, 9
    old_logp = -torch.rand(B, T, generator=g, dtype=DT) * 3
    delta = torch.randn(B, T, generator=g, dtype=DT) * 1e-3  # sequence ratios straddle 1 +- 4e-4
    logp = (old_logp + delta).requires_grad_(True)
    ref_logp = old_logp + torch.randn(B, T, generator=g, dtype=DT) * 0.1
    lengths = torch.tensor([9, 1, 4, 0, 7, 2, 9, 5])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=g, dtype=DT)
    kw = dict(old_logp=old_logp, mask=mask, ref_logp=ref_logp, beta=0.05, agg=agg)
    a, ma = gspo_loss(logp=logp, adv=adv, **kw)
    b, mb = gspo_token_loss(logp=logp, adv=adv, **kw)
    c, _ = gspo_token_loss(logp=logp, adv=adv[:, None].expand(B, T), **kw)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
    ga, gb = (torch.autograd.grad(x, logp)[0] for x in (a, b))
    torch.testing.assert_close(ga, gb)
    # the batch exercises both clipped and unclipped sequences
    assert 0 < ma["ratio/clipfrac_low"] + ma["ratio/clipfrac_high"] < 1
    assert ma["kl/ref_k3"] == pytest.approx(mb["kl/ref_k3"])


# ---------------------------------------------------------------- registry and errors


def test_registry_records():
    assert list(LOSSES) == ["grpo", "gspo", "gspo_token", "sapo", "cispo", "dppo_tv", "dppo_kl", "vespo"]
    assert {name for name, loss in LOSSES.items() if loss.clip == "ratio"} == {"grpo", "gspo", "gspo_token"}
    assert {name for name, loss in LOSSES.items() if loss.clip == "divergence"} == {"dppo_tv", "dppo_kl"}
    assert LOSSES["cispo"].clip == "weight" and LOSSES["sapo"].clip is None and LOSSES["vespo"].clip is None
    assert {name for name, loss in LOSSES.items() if loss.ratio_level == "sequence"} == {"gspo"}
    assert {name for name, loss in LOSSES.items() if loss.seq_mean_policy} == {"gspo", "gspo_token"}
    # the papers' values, read from the functions' keyword defaults
    assert LOSSES["grpo"].defaults == {"eps_low": 0.2, "eps_high": 0.27}  # the GSPO paper's GRPO runs
    assert LOSSES["gspo"].defaults == LOSSES["gspo_token"].defaults == {"eps_low": 3e-4, "eps_high": 4e-4}
    assert LOSSES["sapo"].defaults == {"tau_pos": 1.0, "tau_neg": 1.05}  # arXiv 2511.20347
    assert LOSSES["cispo"].defaults == {"eps_low": 1.0, "eps_high": 0.28}  # no lower bound on the weight
    # arXiv 2602.04879 (the authors' verl script): TV 0.15, binary KL 0.05; no (log r)^2 term
    assert LOSSES["dppo_tv"].defaults == {"eps_low": 0.15, "eps_high": 0.15, "kl_tau": 0.0}
    assert LOSSES["dppo_kl"].defaults == {"eps_low": 0.05, "eps_high": 0.05, "kl_tau": 0.0}
    assert LOSSES["vespo"].defaults == {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
    for name, loss in LOSSES.items():
        assert get_loss(name) is loss
        params = inspect.signature(loss.fn).parameters
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
        own = {k: p.default for k, p in params.items() if k not in SHARED_ARGS}
        assert dict(loss.defaults) == own and list(loss.defaults) == list(own)  # no copy: the signature's
        assert loss.takes_ratio_scale == loss.weighs_tokens == (loss.ratio_level == "token")
        with pytest.raises(TypeError):
            loss.defaults["eps_low"] = 0.5  # a record is read-only
    with pytest.raises(ValueError, match="unknown loss 'ppo'; valid: cispo, dppo_kl, dppo_tv, grpo, gspo, gspo_token"):
        get_loss("ppo")


def _formula(
    *,
    logp,
    old_logp,
    adv,
    mask,
    eps_low=0.2,
    eps_high=0.2,
    ref_logp=None,
    beta=0.0,
    agg="token-mean",
    weight=None,
    ratio_scale=None,
):
    return logp.sum(), {}


def test_a_record_refuses_a_function_off_the_shared_signature():
    Loss(_formula, ratio_level="token", clip="ratio", seq_mean_policy=False, ranges=EPS_RANGES)  # fits

    def positional(
        logp, *, old_logp, adv, mask, ref_logp=None, beta=0.0, agg="token-mean", weight=None, ratio_scale=None
    ):
        return logp.sum(), {}

    def no_weight(*, logp, old_logp, adv, mask, ref_logp=None, beta=0.0, agg="token-mean", ratio_scale=None):
        return logp.sum(), {}

    def int_default(
        *, logp, old_logp, adv, mask, ref_logp=None, beta=0.0, agg="token-mean", weight=None, ratio_scale=None, tau=1
    ):
        return logp.sum(), {}

    with pytest.raises(TypeError, match="keyword-only"):
        Loss(positional, ratio_level="token", clip=None, seq_mean_policy=False)
    with pytest.raises(TypeError, match=r"lacks the shared arguments \['weight'\]"):
        Loss(no_weight, ratio_level="token", clip=None, seq_mean_policy=False)
    with pytest.raises(TypeError, match="float default"):
        Loss(int_default, ratio_level="token", clip=None, seq_mean_policy=False)
    with pytest.raises(ValueError, match="needs eps_low and eps_high"):
        Loss(_formula, ratio_level="token", clip=None, seq_mean_policy=False, ranges=EPS_RANGES)  # it has a clip range
    with pytest.raises(ValueError, match="ratio_level='tokens'"):
        Loss(_formula, ratio_level="tokens", clip="ratio", seq_mean_policy=False, ranges=EPS_RANGES)
    with pytest.raises(
        ValueError, match=r"ranges names \['eps_low'\]; its own hyperparameters are \['eps_high', 'eps_low'\]"
    ):
        Loss(_formula, ratio_level="token", clip="ratio", seq_mean_policy=False, ranges={"eps_low": UNIT})
    with pytest.raises(ValueError, match=r"_formula: its paper's value eps_high=0.2 must lie in \[0, 0.1\]"):
        Loss(
            _formula,
            ratio_level="token",
            clip="ratio",
            seq_mean_policy=False,
            ranges={**EPS_RANGES, "eps_high": Range(0.0, 0.1)},
        )


def test_ranges_by_hand():
    assert (0.0 in AT_LEAST_0, 0.0 in ABOVE_0, 1e-9 in ABOVE_0, math.inf in AT_LEAST_0) == (True, False, True, True)
    assert (0.0 in UNIT, 1.0 in UNIT, 1.5 in UNIT, -0.1 in UNIT, math.nan in UNIT) == (True, True, False, False, False)
    assert [str(r) for r in (AT_LEAST_0, ABOVE_0, UNIT, Range(0.0, 1.0, closed=False))] == [
        "be >= 0",
        "be > 0",
        "lie in [0, 1]",
        "lie in (0, 1]",
    ]
    for name, loss in LOSSES.items():  # every own hyperparameter has a range, and its paper's value lies in it
        assert set(loss.ranges) == set(loss.defaults), name
        assert loss.out_of_range(loss.defaults) is None


# an out-of-range own hyperparameter of each loss, and the error it raises
OWN_PARAM_ERRORS = {
    "grpo": ({"eps_low": 1.5}, r"grpo_loss: eps_low=1.5 must lie in \[0, 1\]"),
    "gspo": ({"eps_high": -0.1}, "gspo_loss: eps_high=-0.1 must be >= 0"),
    "gspo_token": ({"eps_low": 1.5}, r"gspo_token_loss: eps_low=1.5 must lie in \[0, 1\]"),
    "cispo": ({"eps_low": float("nan")}, r"cispo_loss: eps_low=nan must lie in \[0, 1\]"),
    "dppo_tv": ({"kl_tau": -1.0}, "dppo_tv_loss: kl_tau=-1.0 must be >= 0"),
    "dppo_kl": ({"eps_low": 1.5}, r"dppo_kl_loss: eps_low=1.5 must lie in \[0, 1\]"),
    "sapo": ({"tau_pos": 0.0}, "sapo_loss: tau_pos=0.0 must be > 0"),
    "vespo": ({"lambda_neg": 0.0}, "vespo_loss: lambda_neg=0.0 must be > 0"),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_input_errors(name):
    fn = LOSSES[name]
    x = torch.zeros(2, 3)
    ok = dict(logp=x, old_logp=x, adv=torch.zeros(2), mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="unknown agg 'mean'; valid: seq-mean-token-mean, token-mean"):
        fn(**ok, agg="mean")
    with pytest.raises(ValueError, match=r"old_logp shape \(2, 4\) != logp shape \(2, 3\)"):
        fn(**{**ok, "old_logp": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match=r"mask shape"):
        fn(**{**ok, "mask": torch.ones(3, 3, dtype=torch.bool)})
    with pytest.raises(ValueError, match=r"adv shape \(3,\)"):
        fn(**{**ok, "adv": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"logp must be \(B, T\)"):
        fn(**{**ok, "logp": torch.zeros(6)})
    with pytest.raises(ValueError, match="beta=0.1 needs ref_logp"):
        fn(**ok, beta=0.1)
    with pytest.raises(ValueError, match=r"ref_logp shape"):
        fn(**ok, ref_logp=torch.zeros(2, 2))
    assert set(OWN_PARAM_ERRORS) == set(LOSSES)
    bad, match = OWN_PARAM_ERRORS[name]
    with pytest.raises(ValueError, match=match):
        fn(**ok, **bad)
    with pytest.raises(ValueError, match=r"offpolicy_mask_delta=-0.1 must be >= 0"):
        fn(**ok, offpolicy_mask_delta=-0.1)
    with pytest.raises(ValueError, match=r"weight shape \(2, 2\)"):
        fn(**ok, weight=torch.zeros(2, 2))


def test_gspo_rejects_token_advantage():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"adv shape \(2, 3\) must be \(2,\)"):
        gspo_loss(logp=x, old_logp=x, adv=torch.zeros(2, 3), mask=torch.ones(2, 3, dtype=torch.bool))


def test_gspo_refuses_ratio_scale():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="gspo_loss is a sequence loss; ratio_scale"):
        gspo_loss(logp=x, old_logp=x, adv=torch.zeros(2), mask=torch.ones(2, 3, dtype=torch.bool), ratio_scale=x)


# ---------------------------------------------------------------- weight and ratio_scale (GRPO by hand)


def test_grpo_token_weight_by_hand():
    # the token terms of _grpo_example, [-1.27, -0.5, -1.0] and [3.0, 1.6], times the weights
    # [2, 0, 1] and [0.5, 1]: [-2.54, 0, -1] and [1.5, 1.6]; token-mean (-3.54 + 3.1) / 5 = -0.088.
    # gradient: -A r w / 5 on unclipped tokens: seq 0 [0 (clipped), 0 (w = 0), -0.2]; seq 1 [2 * 1.5 * 0.5 / 5, 0 (clipped)]
    logp, old_logp, adv, mask = _grpo_example()
    weight = _t([[2.0, 0.0, 1.0], [0.5, 1.0, 7.0]])
    loss, m = grpo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean", weight=weight)
    assert loss.item() == pytest.approx(-0.088, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _t([[0.0, 0.0, -0.2], [0.3, 0.0, 0.0]]), rtol=0, atol=1e-15)
    assert m["ratio/clipfrac_high"] == pytest.approx(1 / 5)  # clip fractions are of the ratio, not the weight


def test_grpo_ratio_scale_by_hand():
    # the ratios of _grpo_example, [1.5, 0.5, 1] and [1.5, 0.5], times [0.5, 1, 1] and [1, 2]:
    # seq 0 (A = 1): 0.75 (below 0.8, but A > 0: min(0.75, 0.8) = 0.75, unclipped), 0.5, 1  -> -0.75, -0.5, -1
    # seq 1 (A = -2): 1.5 (A < 0: unclipped) -> 3;  0.5 * 2 = 1 inside the range -> 2
    # token-mean (-2.25 + 5) / 5 = 0.55; gradient -A r s / 5 everywhere (nothing clipped):
    # seq 0 [-0.15, -0.1, -0.2], seq 1 [0.6, 0.4]
    logp, old_logp, adv, mask = _grpo_example()
    scale = _t([[0.5, 1.0, 1.0], [1.0, 2.0, 9.0]])
    loss, m = grpo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean", ratio_scale=scale)
    assert loss.item() == pytest.approx(0.55, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _t([[-0.15, -0.1, -0.2], [0.6, 0.4, 0.0]]), rtol=1e-14, atol=1e-15)
    assert m["ratio/clipfrac_high"] == 0.0 and m["ratio/clipfrac_low"] == 0.0


# ---------------------------------------------------------------- SAPO by hand


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# SAPO on _grpo_example, f(r) = sigma(tau (r - 1)) * 4 / tau, token term -f(r) A:
# seq 0, A = +1, tau_pos = 1: r = 1.5, 0.5, 1 -> f = 4 sigma(0.5), 4 sigma(-0.5), 2; since
#   sigma(x) + sigma(-x) = 1 the terms sum to -(4 + 2) = -6, mean -2
# seq 1, A = -2, tau_neg = 1.05: r = 1.5, 0.5 -> f = (4 / 1.05) sigma(0.525), (4 / 1.05) sigma(-0.525),
#   which sum to 4 / 1.05; terms +2 f sum to 8 / 1.05, mean 4 / 1.05
SAPO_SEQ_MEAN = (-2 + 4 / 1.05) / 2
SAPO_TOKEN_MEAN = (-6 + 8 / 1.05) / 5


@pytest.mark.parametrize(("agg", "expected"), [("seq-mean-token-mean", SAPO_SEQ_MEAN), ("token-mean", SAPO_TOKEN_MEAN)])
def test_sapo_by_hand(agg, expected):
    logp, old_logp, adv, mask = _grpo_example()
    loss, m = sapo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg=agg)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["loss/policy"] == pytest.approx(expected, rel=1e-12)
    assert m["ratio/clipfrac_low"] == 0.0 and m["ratio/clipfrac_high"] == 0.0  # no clipped branch


def test_sapo_gradient_by_hand_token_mean():
    # d(-f(r) A)/d logp = -A * 4 sigma (1 - sigma) * r, over 5 tokens; nothing is dropped
    logp, old_logp, adv, mask = _grpo_example()
    loss, _ = sapo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean")
    (grad,) = torch.autograd.grad(loss, logp)
    g_pos = 4 * _sig(0.5) * _sig(-0.5)  # tau 1 at r = 1.5 and r = 0.5 (sigma(x) sigma(-x) is even in x)
    g_neg = 4 * _sig(0.525) * _sig(-0.525)  # tau 1.05
    expected = [[-g_pos * 1.5 / 5, -g_pos * 0.5 / 5, -1.0 / 5], [2 * g_neg * 1.5 / 5, 2 * g_neg * 0.5 / 5, 0.0]]
    torch.testing.assert_close(grad, _t(expected), rtol=1e-13, atol=0)


@pytest.mark.parametrize("tau", [0.5, 1.0, 3.0])
def test_sapo_on_policy_gradient_is_the_policy_gradient_for_any_tau(tau):
    # the 4 / tau normalisation: at r = 1, f'(1) = 4 sigma(0) (1 - sigma(0)) = 1 whatever tau, so the
    # gradient is GRPO's on-policy gradient; the value there is -mean(A) * 2 / tau
    logp, _, adv, mask = _grpo_example()
    kw = dict(logp=logp, old_logp=logp.detach(), adv=adv, mask=mask, agg="token-mean")
    loss, _ = sapo_loss(**kw, tau_pos=tau, tau_neg=tau)
    reference, _ = grpo_loss(**kw)
    assert loss.item() == pytest.approx(-(3 * 1 + 2 * -2) / 5 * 2 / tau, rel=1e-12)
    ga, gb = (torch.autograd.grad(x, logp)[0] for x in (loss, reference))
    torch.testing.assert_close(ga, gb, rtol=1e-15, atol=1e-16)


def test_sapo_negative_advantages_decay_faster():
    # the asymmetry: at the same |r - 1| the larger tau_neg shrinks the gradient weight 4 sigma (1 - sigma) more
    logp = _t([[LN(2.0)], [LN(2.0)]]).requires_grad_(True)
    loss, _ = sapo_loss(
        logp=logp, old_logp=_t([[0.0], [0.0]]), adv=_t([1.0, -1.0]), mask=torch.ones(2, 1, dtype=torch.bool)
    )
    (grad,) = torch.autograd.grad(loss, logp)
    # seq mean over 2 rows: -A * 4 sigma(tau) sigma(-tau) * 2 / 2
    torch.testing.assert_close(
        grad, _t([[-4 * _sig(1.0) * _sig(-1.0)], [4 * _sig(1.05) * _sig(-1.05)]]), rtol=1e-13, atol=0
    )
    assert -grad[0, 0] > grad[1, 0] > 0


# ---------------------------------------------------------------- CISPO by hand

# CISPO on _grpo_example with the defaults (eps_low 1, eps_high 0.28: weights clipped to [0, 1.28]):
# seq 0, A = +1: w = 1.28 (r = 1.5 truncated), 0.5, 1   -> terms -1.28, -0.5, -1
# seq 1, A = -2: w = 1.28 (truncated), 0.5              -> terms 2.56, 1.0
CISPO_TOKEN_MEAN = (-2.78 + 3.56) / 5
CISPO_SEQ_MEAN = (-2.78 / 3 + 3.56 / 2) / 2


@pytest.mark.parametrize(
    ("agg", "expected"), [("seq-mean-token-mean", CISPO_SEQ_MEAN), ("token-mean", CISPO_TOKEN_MEAN)]
)
def test_cispo_by_hand(agg, expected):
    logp, old_logp, adv, mask = _grpo_example()
    loss, m = cispo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg=agg)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["ratio/clipfrac_high"] == pytest.approx(2 / 5)  # both r = 1.5 tokens, whatever the sign of A
    assert m["ratio/clipfrac_low"] == 0.0


def test_cispo_gradient_keeps_every_token():
    # d loss / d logp = -A sg[w] / 5 (token-mean): the truncated tokens keep a gradient (GRPO's is 0 there)
    # seq 0: [-1.28, -0.5, -1] / 5; seq 1: [2 * 1.28, 2 * 0.5] / 5
    logp, old_logp, adv, mask = _grpo_example()
    loss, _ = cispo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean")
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _t([[-0.256, -0.1, -0.2], [0.512, 0.2, 0.0]]), rtol=1e-13, atol=0)
    grpo, _ = grpo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean")
    (grpo_grad,) = torch.autograd.grad(grpo, logp)
    assert grpo_grad[0, 0] == 0 and grpo_grad[1, 1] == 0 and grad[0, 0] != 0 and grad[1, 1] != 0


def test_cispo_weight_is_stop_gradient():
    # sg[w]: inside the range w = r, and the gradient of -sg[w] A pi / sg[pi] is -A r = -0.5 at r = 0.5;
    # a weight that carried a gradient would give d(-r A pi / sg[pi]) / d logp = -2 A r = -1.0
    logp = _t([[LN(0.5)]]).requires_grad_(True)
    loss, _ = cispo_loss(logp=logp, old_logp=_t([[0.0]]), adv=_t([1.0]), mask=torch.ones(1, 1, dtype=torch.bool))
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-0.5, rel=1e-15)
    assert grad.item() == pytest.approx(-0.5, rel=1e-15)


# ---------------------------------------------------------------- engine-gap corrections by hand


# behaviour/trainer ratios rho = exp(old_logp - rollout_logp): seq 0 [3, 0.25, 1], seq 1 [0.4, 6, masked]
def _engine_example():
    rollout_logp = _t([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])
    old_logp = rollout_logp + _t([[LN(3.0), LN(0.25), 0.0], [LN(0.4), LN(6.0), float("nan")]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return old_logp, rollout_logp, mask


@pytest.mark.parametrize(
    ("correction", "level", "weight", "truncated", "masked"),
    [
        # tis, cap 2: min(rho, 2); the 3 and the 6 are truncated
        ("tis", "token", [[2, 0.25, 1], [0.4, 2, 0]], [[1, 0, 0], [0, 1, 0]], [[0, 0, 0], [0, 0, 0]]),
        # mis, cap 2: rho, or 0 above the cap
        ("mis", "token", [[0, 0.25, 1], [0.4, 0, 0]], [[0, 0, 0], [0, 0, 0]], [[1, 0, 0], [0, 1, 0]]),
        # icepop, band [0.5, 5]: rho inside, 0 outside (0.25, 0.4 and 6 are outside)
        ("icepop", "token", [[3, 0, 1], [0, 0, 0]], [[0, 0, 0], [0, 0, 0]], [[0, 1, 0], [1, 1, 0]]),
        # sequence level: rho_0 = 3 * 0.25 * 1 = 0.75, rho_1 = 0.4 * 6 = 2.4 for every token of the sequence
        ("tis", "sequence", [[0.75] * 3, [2, 2, 0]], [[0, 0, 0], [1, 1, 0]], [[0, 0, 0], [0, 0, 0]]),
        ("mis", "sequence", [[0.75] * 3, [0, 0, 0]], [[0, 0, 0], [0, 0, 0]], [[0, 0, 0], [1, 1, 0]]),
        ("icepop", "sequence", [[0.75] * 3, [2.4, 2.4, 0]], [[0, 0, 0], [0, 0, 0]], [[0, 0, 0], [0, 0, 0]]),
    ],
)
def test_engine_weight_by_hand(correction, level, weight, truncated, masked):
    old_logp, rollout_logp, mask = _engine_example()
    out = engine_weight(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask, correction=correction, level=level)
    torch.testing.assert_close(out.weight, _t(weight), rtol=1e-14, atol=0)  # exp(log) round trip: a few ulp
    assert out.truncated.tolist() == [[bool(x) for x in row] for row in truncated]
    assert out.masked.tolist() == [[bool(x) for x in row] for row in masked]


def test_engine_weight_on_the_loss_by_hand():
    # tis weights [2, 0.25, 1] and [0.4, 2] on GRPO's terms [-1.27, -0.5, -1] and [3, 1.6] of _grpo_example:
    # token-mean (-2.54 - 0.125 - 1 + 1.2 + 3.2) / 5 = 0.735 / 5; gradient -A r w / 5 on unclipped tokens:
    # seq 0 [0, -0.5 * 0.25 / 5, -1 / 5], seq 1 [2 * 1.5 * 0.4 / 5, 0]
    logp, old_logp, adv, mask = _grpo_example()
    e_old, e_rollout, _ = _engine_example()
    w = engine_weight(old_logp=e_old, rollout_logp=e_rollout, mask=mask, correction="tis").weight
    loss, _ = grpo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean", weight=w)
    assert loss.item() == pytest.approx(0.735 / 5, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _t([[0.0, -0.025, -0.2], [0.24, 0.0, 0.0]]), rtol=1e-13, atol=1e-16)


def test_engine_weight_errors():
    old_logp, rollout_logp, mask = _engine_example()
    with pytest.raises(ValueError, match="unknown correction 'is'; valid: tis, mis, icepop"):
        engine_weight(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask, correction="is")
    with pytest.raises(ValueError, match="unknown level 'batch'; valid: token, sequence"):
        engine_weight(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask, correction="tis", level="batch")


# ---------------------------------------------------------------- DPPO by hand

# Probabilities chosen so that the trust regions are easy to read (the ratio r = p / p_old):
# seq 0, A = +1:  p_old 0.01 -> p 0.1 (r 10), 0.5 -> 0.7 (r 1.4), 0.8 -> 0.4 (r 0.5)
# seq 1, A = -1:  p_old 0.9 -> p 0.72 (r 0.8), 0.2 -> 0.3 (r 1.5), then a masked position holding garbage
DPPO_P_OLD = [[0.01, 0.5, 0.8], [0.9, 0.2, 0.5]]
DPPO_P = [[0.1, 0.7, 0.4], [0.72, 0.3, float("nan")]]


def _dppo_example():
    old_logp = _t([[LN(p) for p in row] for row in DPPO_P_OLD])
    logp = _t([[LN(p) if p == p else p for p in row] for row in DPPO_P]).requires_grad_(True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return logp, old_logp, _t([1.0, -1.0]), mask


# TV, bound 0.15 on either side:
#   seq 0 (A > 0, masked when p - p_old > 0.15): +0.09 kept (GRPO would clip r = 10 at 1.27), +0.2 masked,
#         -0.4 kept (a fall is not what A > 0 pushes)                    -> terms -10, 0, -0.5
#   seq 1 (A < 0, masked when p - p_old < -0.15): -0.18 masked (GRPO keeps r = 0.8, on its boundary),
#         +0.1 kept                                                     -> terms 0, +1.5
# token-mean (-10 - 0.5 + 1.5) / 5 = -1.8; seq-mean (-10.5 / 3 + 1.5 / 2) / 2 = -1.375
# gradient -M r A / 5: seq 0 [-2, 0, -0.1], seq 1 [0, 0.3]
@pytest.mark.parametrize(("agg", "expected"), [("token-mean", -1.8), ("seq-mean-token-mean", -1.375)])
def test_dppo_tv_by_hand(agg, expected):
    logp, old_logp, adv, mask = _dppo_example()
    loss, m = dppo_tv_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg=agg)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["loss/policy"] == pytest.approx(expected, rel=1e-12)
    assert m["ratio/clipfrac_high"] == pytest.approx(1 / 5) and m["ratio/clipfrac_low"] == pytest.approx(1 / 5)
    assert m.clipped.tolist() == [[False, True, False], [True, False, False]]
    if agg == "token-mean":
        (grad,) = torch.autograd.grad(loss, logp)
        torch.testing.assert_close(grad, _t([[-2.0, 0.0, -0.1], [0.0, 0.3, 0.0]]), rtol=1e-12, atol=0)


# Binary KL D = p_old ln(p_old / p) + (1 - p_old) ln((1 - p_old) / (1 - p)), worked out:
#   seq 0: 0.01 ln 0.1 + 0.99 ln(0.99 / 0.9) = -0.02303 + 0.09436 = 0.0713 (a rise);
#          0.5 ln(5/7) + 0.5 ln(5/3) = -0.16824 + 0.25541 = 0.0872 (a rise); the third token fell (A > 0: kept)
#   seq 1: 0.9 ln(0.9 / 0.72) + 0.1 ln(0.1 / 0.28) = 0.20083 - 0.10296 = 0.0979 (a fall); the second rose (kept)
# bound 0.05 (the default): both rises of seq 0 and the fall of seq 1 are masked -> terms [0, 0, -0.5], [0, 1.5]:
#   token-mean 1.0 / 5 = 0.2, gradient seq 0 [0, 0, -0.1], seq 1 [0, 0.3]; clip fractions 2/5 high, 1/5 low
# bound 0.08: the 0.01 -> 0.1 token (D 0.0713) is kept, the rest as at 0.05 -> TV's terms, token-mean -1.8
@pytest.mark.parametrize(("eps", "expected", "high"), [(None, 0.2, 2 / 5), (0.08, -1.8, 1 / 5)])
def test_dppo_kl_by_hand(eps, expected, high):
    logp, old_logp, adv, mask = _dppo_example()
    kw = {} if eps is None else {"eps_low": eps, "eps_high": eps}
    loss, m = dppo_kl_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean", **kw)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["ratio/clipfrac_high"] == pytest.approx(high) and m["ratio/clipfrac_low"] == pytest.approx(1 / 5)
    (grad,) = torch.autograd.grad(loss, logp)
    first = 0.0 if eps is None else -2.0
    torch.testing.assert_close(grad, _t([[first, 0.0, -0.1], [0.0, 0.3, 0.0]]), rtol=1e-12, atol=0)


def test_binary_kl_by_hand_and_at_the_edges():
    from moe_rl.algos.trust_regions import _binary_kl

    old = _t([LN(0.01), LN(0.5), LN(0.9), 0.0, LN(0.5)])
    new = _t([LN(0.1), LN(0.7), LN(0.72), 0.0, 0.0])
    kl = _binary_kl(old, new)
    hand = [
        0.01 * LN(0.1) + 0.99 * LN(0.99 / 0.9),
        0.5 * LN(5 / 7) + 0.5 * LN(5 / 3),
        0.9 * LN(0.9 / 0.72) + 0.1 * LN(0.1 / 0.28),
    ]
    torch.testing.assert_close(kl[:3], _t(hand), rtol=1e-12, atol=0)
    assert kl[3] == 0.0  # p_old = p = 1: 0 log 0 terms are 0, not NaN
    assert kl[4] == float("inf")  # 0.5 -> 1: the rest of the vocabulary lost all its mass


def test_dppo_kl_tau_term_by_hand():
    # kl_tau adds tau * agg (log r)^2 over every valid token, masked or not; loss/policy leaves it out.
    # token-mean over the 5 tokens of _dppo_example, tau 0.01:
    #   0.01 * (ln^2 10 + ln^2 1.4 + ln^2 0.5 + ln^2 0.8 + ln^2 1.5) / 5, and its gradient 0.01 * 2 ln r / 5
    logp, old_logp, adv, mask = _dppo_example()
    loss, m = dppo_tv_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean", kl_tau=0.01)
    logs = [[LN(10), LN(1.4), LN(0.5)], [LN(0.8), LN(1.5), 0.0]]
    term = 0.01 * sum(x * x for row in logs for x in row) / 5
    assert loss.item() == pytest.approx(-1.8 + term, rel=1e-12)
    assert m["loss/policy"] == pytest.approx(-1.8, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    policy = _t([[-2.0, 0.0, -0.1], [0.0, 0.3, 0.0]])
    torch.testing.assert_close(grad, policy + 0.01 * 2 * _t(logs) / 5, rtol=1e-12, atol=1e-15)


def _slow_dppo(logp, old_logp, adv, mask, eps_low, eps_high, divergence, agg):
    """DPPO token by token, in plain Python floats for the decisions: sum of -M r A over valid tokens, then the
    aggregation; the surrogate keeps logp's graph."""
    terms, per_seq = [], []
    for i in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            p, p_old, a = math.exp(logp[i, t].item()), math.exp(old_logp[i, t].item()), adv[i].item()
            if divergence == "tv":
                up, down = p - p_old > eps_high, p - p_old < -eps_low
            else:
                d = p_old * LN(p_old / p) + (1 - p_old) * LN((1 - p_old) / (1 - p))
                up, down = p > p_old and d > eps_high, p < p_old and d > eps_low
            masked = (a > 0 and up) or (a < 0 and down)
            r = torch.exp(logp[i, t] - old_logp[i, t])
            row.append(0.0 * r if masked else -r * a)
        terms += row
        if row:
            per_seq.append(sum(row) / len(row))
    return sum(terms) / len(terms) if agg == "token-mean" else sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize(("fn", "divergence"), [(dppo_tv_loss, "tv"), (dppo_kl_loss, "kl")])
def test_dppo_equals_a_slow_loop_on_random_inputs(fn, divergence, agg):
    g = torch.Generator().manual_seed(3)
    B, T = 6, 7
    old_logp = torch.log_softmax(torch.randn(B, T, 5, generator=g, dtype=DT) * 2, dim=-1)[..., 0]
    logp = (old_logp + torch.randn(B, T, generator=g, dtype=DT) * 0.6).clamp(max=-1e-3).requires_grad_(True)
    mask = torch.arange(T)[None, :] < torch.tensor([7, 3, 0, 5, 1, 6])[:, None]
    adv = torch.randn(B, generator=g, dtype=DT)
    eps = (0.1, 0.12) if divergence == "tv" else (0.03, 0.05)
    loss, m = fn(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg=agg, eps_low=eps[0], eps_high=eps[1])
    slow = _slow_dppo(logp, old_logp, adv, mask, *eps, divergence, agg)
    torch.testing.assert_close(loss, slow, rtol=1e-12, atol=1e-14)
    ga, gb = (torch.autograd.grad(x, logp)[0] for x in (loss, slow))
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)
    assert 0 < m["ratio/clipfrac_low"] + m["ratio/clipfrac_high"] < 1  # the batch has masked and kept tokens


def test_dppo_on_policy_is_the_policy_gradient():
    # at theta == theta_old nothing has moved, so nothing is masked and DPPO's gradient is GRPO's
    logp, _, adv, mask = _grpo_example()
    kw = dict(logp=logp, old_logp=logp.detach(), adv=adv, mask=mask)
    for fn in (dppo_tv_loss, dppo_kl_loss):
        a, m = fn(**kw)
        b, _ = grpo_loss(**kw)
        assert a.item() == b.item() and m["ratio/clipfrac_low"] == m["ratio/clipfrac_high"] == 0.0
        ga, gb = (torch.autograd.grad(x, logp)[0] for x in (a, b))
        torch.testing.assert_close(ga, gb, rtol=0, atol=0)


# ---------------------------------------------------------------- VESPO by hand

# phi(W) = W^k exp(lambda (1 - W)) of the whole sequence ratio W = prod_t r_t (k 2 / lambda 3 for A >= 0,
# k 3 / lambda 2 for A < 0); each token's term is -sg[phi] A (times pi / sg[pi]):
# seq 0, A = +1, log r = [ln 2, 0] (third position masked, garbage): W = 2, phi = 4 e^-3
# seq 1, A = -1, log r = [ln 1/2, 0]:                                  W = 1/2, phi = (1/8) e^1
# seq 2, A = +2, log r = [ln 2, ln 1/2, 0]:                            W = 1, phi = 1
# token-mean over 7 tokens: (-2 * 4 e^-3 + 2 * e / 8 - 3 * 2) / 7; gradient -phi A / 7 per valid token
# (GSPO's s would be sqrt 2, 1 / sqrt 2 and 1: VESPO does not normalise by length)
VESPO_PHI = [4 * math.exp(-3), math.exp(1) / 8, 1.0]


def _vespo_example():
    old_logp = _t([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0], [-0.2, -1.1, -0.9]])
    delta = _t([[LN(2), 0.0, 40.0], [LN(0.5), 0.0, float("nan")], [LN(2), LN(0.5), 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False], [True, True, True]])
    return (old_logp + delta).requires_grad_(True), old_logp, _t([1.0, -1.0, 2.0]), mask


def test_vespo_by_hand():
    logp, old_logp, adv, mask = _vespo_example()
    loss, m = vespo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean")
    expected = (-2 * VESPO_PHI[0] + 2 * VESPO_PHI[1] - 3 * 2 * VESPO_PHI[2]) / 7
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["ratio/clipfrac_low"] == m["ratio/clipfrac_high"] == 0.0 and not m.clipped.any()
    (grad,) = torch.autograd.grad(loss, logp)
    g0, g1, g2 = (-VESPO_PHI[0] / 7, VESPO_PHI[1] / 7, -2 / 7)
    torch.testing.assert_close(grad, _t([[g0, g0, 0.0], [g1, g1, 0.0], [g2, g2, g2]]), rtol=1e-12, atol=0)
    # seq-mean-token-mean: each sequence's mean term is -phi A, then the mean over 3 sequences
    loss, _ = vespo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask)
    assert loss.item() == pytest.approx((-VESPO_PHI[0] + VESPO_PHI[1] - 2) / 3, rel=1e-12)


def test_vespo_own_parameters_by_hand():
    # k 1 / lambda 1 for both signs: phi(2) = 2 e^-1, phi(1/2) = e^(1/2) / 2
    logp, old_logp, adv, mask = _vespo_example()
    one = dict(k_pos=1.0, lambda_pos=1.0, k_neg=1.0, lambda_neg=1.0)
    loss, _ = vespo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean", **one)
    expected = (-2 * 2 * math.exp(-1) + 2 * math.exp(0.5) / 2 - 3 * 2) / 7
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_vespo_equals_a_slow_reinforce_loop():
    # the REINFORCE form of the peers, -sum phi_i A_i logp_{i,t} / N with phi from plain floats, has the same
    # gradient; phi is a constant (a weight that carried a gradient would add phi'(W) W A to every token)
    g = torch.Generator().manual_seed(4)
    B, T = 5, 6
    old_logp = -torch.rand(B, T, generator=g, dtype=DT) * 2 - 0.1
    logp = (old_logp + torch.randn(B, T, generator=g, dtype=DT) * 0.3).requires_grad_(True)
    mask = torch.arange(T)[None, :] < torch.tensor([6, 2, 4, 0, 5])[:, None]
    adv = _t([1.0, -0.5, 0.0, 2.0, -1.5])
    loss, _ = vespo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg="token-mean")
    slow, n = 0.0, int(mask.sum())
    for i in range(B):
        log_w = sum(logp[i, t].item() - old_logp[i, t].item() for t in range(T) if mask[i, t])
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        phi = math.exp(log_w) ** k * math.exp(lam * (1 - math.exp(log_w)))
        for t in range(T):
            if mask[i, t]:
                slow = slow - phi * adv[i].item() * logp[i, t] / n
    ga, gb = (torch.autograd.grad(x, logp)[0] for x in (loss, slow))
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-15)


def test_vespo_on_policy_is_the_policy_gradient_and_far_ratios_vanish():
    logp, _, adv, mask = _grpo_example()
    kw = dict(logp=logp, old_logp=logp.detach(), adv=adv, mask=mask, agg="token-mean")
    a, _ = vespo_loss(**kw)  # W = 1: phi = 1 whatever k and lambda
    b, _ = grpo_loss(**kw)
    assert a.item() == b.item()
    ga, gb = (torch.autograd.grad(x, logp)[0] for x in (a, b))
    torch.testing.assert_close(ga, gb, rtol=0, atol=0)
    # a sequence ratio of e^30 (clamped to e^20) or e^-30 gives phi ~ 0, not NaN or inf
    far = _t([[30.0], [-30.0]]).requires_grad_(True)
    loss, _ = vespo_loss(logp=far, old_logp=_t([[0.0], [0.0]]), adv=_t([1.0, -1.0]), mask=torch.ones(2, 1).bool())
    (grad,) = torch.autograd.grad(loss, far)
    assert torch.isfinite(grad).all() and grad.abs().max() < 1e-20


# ---------------------------------------------------------------- off-policy sequence mask by hand


# On _grpo_example the mean log(pi_old / pi) per token is
#   seq 0 (A = +1): -(ln 1.5 + ln 0.5 + 0) / 3 = ln(4/3) / 3 = 0.0959, never dropped (A > 0)
#   seq 1 (A = -2): -(ln 1.5 + ln 0.5) / 2 = ln(4/3) / 2 = 0.1438: dropped at delta 0.1, kept at 0.2
# Dropped, seq 1's terms [3, 1.6] become 0 and every denominator stays: token-mean (-1.27 - 0.5 - 1) / 5,
# seq-mean (-2.77 / 3 + 0) / 2; the gradient is GRPO's with seq 1's row zeroed: [0, -0.1, -0.2], [0, 0].
@pytest.mark.parametrize(
    ("agg", "dropped"), [("token-mean", -2.77 / 5), ("seq-mean-token-mean", -2.77 / 3 / 2)], ids=["token", "seq"]
)
def test_offpolicy_mask_by_hand(agg, dropped):
    logp, old_logp, adv, mask = _grpo_example()
    kw = dict(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg=agg)
    loss, m = grpo_loss(**kw, offpolicy_mask_delta=0.1)
    assert loss.item() == pytest.approx(dropped, rel=1e-12)
    assert m["loss/offpolicy_seq_masked_frac"] == 0.5 and m.weights["loss/offpolicy_seq_masked_frac"] == 2
    assert m["ratio/clipfrac_low"] == pytest.approx(1 / 5)  # the clip fractions still see every token
    if agg == "token-mean":
        (grad,) = torch.autograd.grad(loss, logp)
        torch.testing.assert_close(grad, _t([[0.0, -0.1, -0.2], [0.0, 0.0, 0.0]]))
    kept, m = grpo_loss(**kw, offpolicy_mask_delta=0.2)
    plain, _ = grpo_loss(**kw)
    assert kept.item() == plain.item() and m["loss/offpolicy_seq_masked_frac"] == 0.0
    _, m = grpo_loss(**kw)
    assert "loss/offpolicy_seq_masked_frac" not in m  # off by default


def test_offpolicy_mask_function_by_hand():
    # a per-token advantage drops only the negative tokens of a far sequence; empty rows are kept (mean 0)
    logp, old_logp, _, mask = _grpo_example()
    logp = torch.cat([logp.detach(), _t([[float("nan")] * 3])])
    old_logp = torch.cat([old_logp, _t([[0.0] * 3])])
    mask = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])
    adv = _t([[-1.0, -1.0, -1.0], [-1.0, 2.0, -1.0], [-1.0, -1.0, -1.0]])
    keep, dropped = offpolicy_sequence_mask(logp=logp, old_logp=old_logp, adv=adv, mask=mask, delta=0.12)
    # seq 0's mean 0.0959 <= 0.12: kept; seq 1's 0.1438 > 0.12: its A < 0 token dropped, its A > 0 token kept
    assert keep.tolist() == [[True, True, True], [False, True, False], [False, False, False]]
    assert dropped.tolist() == [False, True, False]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_offpolicy_mask_is_a_zero_weight_on_the_dropped_sequences(name):
    # for every loss, the mask equals passing weight 0 on the dropped sequence (1 elsewhere), with any other
    # weight multiplied in; garbage at masked positions and an inf weight on a dropped token stay out
    logp, old_logp, adv, mask = _grpo_example()
    weight = _t([[2.0, 2.0, 2.0], [float("inf"), float("inf"), float("nan")]])
    kw = dict(logp=logp, old_logp=old_logp, adv=adv, mask=mask, ref_logp=old_logp, beta=0.1)
    loss, m = LOSSES[name](**kw, weight=weight, offpolicy_mask_delta=0.1)
    reference, _ = LOSSES[name](**kw, weight=_t([[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]))
    assert loss.item() == reference.item() and m["loss/offpolicy_seq_masked_frac"] == 0.5
    ga, gb = (torch.autograd.grad(x, logp)[0] for x in (loss, reference))
    assert torch.equal(ga, gb) and torch.isfinite(ga).all()


def test_offpolicy_mask_metric_is_defined():
    from moe_rl.metrics.names import LOSS_OFFPOLICY_SEQ_MASKED_FRAC, defines

    assert LOSS_OFFPOLICY_SEQ_MASKED_FRAC == "loss/offpolicy_seq_masked_frac" and defines(
        LOSS_OFFPOLICY_SEQ_MASKED_FRAC
    )


# ---------------------------------------------------------------- plain importance sampling (no trust region)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_grpo_with_the_clip_opened_is_plain_importance_sampling(agg):
    # the is_none arm: eps_low 1, eps_high inf make clip(r, 0, inf) = r, so -min(r A, clip(r) A) = -r A in value
    # and gradient (min's tie splits the gradient in halves, which add back up exactly); nothing is clipped
    g = torch.Generator().manual_seed(5)
    B, T = 6, 5
    old_logp = -torch.rand(B, T, generator=g, dtype=DT) * 3
    logp = (old_logp + torch.randn(B, T, generator=g, dtype=DT)).requires_grad_(True)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 2, 0, 4, 1, 3])[:, None]
    adv = torch.randn(B, generator=g, dtype=DT)
    loss, m = grpo_loss(logp=logp, old_logp=old_logp, adv=adv, mask=mask, agg=agg, eps_low=1.0, eps_high=math.inf)
    r = torch.exp(torch.where(mask, logp - old_logp, 0.0))
    terms = torch.where(mask, -r * adv[:, None], 0.0)
    n = mask.sum(-1)
    plain = terms.sum() / n.sum() if agg == "token-mean" else (terms.sum(-1)[n > 0] / n[n > 0]).mean()
    torch.testing.assert_close(loss, plain, rtol=1e-14, atol=0)
    ga, gb = (torch.autograd.grad(x, logp)[0] for x in (loss, plain))
    torch.testing.assert_close(ga, gb, rtol=1e-14, atol=0)
    assert m["ratio/clipfrac_low"] == m["ratio/clipfrac_high"] == 0.0
    assert r[mask].max() > 1.27 and r[mask].min() < 0.8  # GRPO's default range would have clipped this batch
