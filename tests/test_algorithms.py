"""Advantages, policy and value losses, KL estimators and control, loss aggregation and DAPO's
batch shaping against hand-computed values and the invariants they promise.

Legend: B sequences, T tokens, V vocab, F features, N episodes, G groups."""

import math

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms import (
    AGGREGATIONS,
    ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    aggregate,
    cispo_loss,
    discounted_returns,
    entropy_from_logits,
    estimate_advantages,
    gae,
    group_advantages,
    gspo_loss,
    informative_groups,
    kl_estimate,
    masked_whiten,
    overlong_penalty,
    policy_loss,
    ppo_clip_loss,
    remax_advantages,
    rloo_advantages,
    terminal_rewards,
    token_logprobs,
    value_loss,
)

# ---------------------------------------------------------------- group_advantages

# Tolerances in this file: the expected values are exact or hand-computed to 6 digits, and the code
# under test is a few float32 ops on small tensors, so atol=1e-5 / approx(abs=1e-5) absorbs the 6-digit
# rounding of the written constants and float32 rounding (~1e-7 relative) only; a bare assert_close
# (float32: rtol 1.3e-6, atol 1e-5) likewise. No comparison here is between two summation orders
# (the data-parallel one is tests/test_aggregation_dp.py).
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def test_group_scale_hand_values():
    # group 0: mean .5, unbiased std sqrt(1/3) = .57735 → ±.5/.57735 = ±.866025; group 1: equal rewards → 0
    adv = group_advantages(REWARDS, GROUPS, scale="group")
    expected = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0, 0.0, 0.0])
    assert adv.dtype == torch.float32
    assert_close(adv, expected, atol=1e-5, rtol=0)


def test_scale_none_is_reward_minus_group_mean():
    adv = group_advantages(REWARDS, GROUPS, scale="none")
    assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))


def test_scale_batch_divides_by_batch_std():
    # batch mean .75, unbiased batch std sqrt(1.5 / 7) = .462910 → ±.5/.462910 = ±1.080123
    adv = group_advantages(REWARDS, GROUPS, scale="batch")
    expected = torch.tensor([1.080123, -1.080123, -1.080123, 1.080123, 0.0, 0.0, 0.0, 0.0])
    assert_close(adv, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_mean_per_group(scale):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(60, generator=g)
    groups = torch.randint(0, 7, (60,), generator=g)
    adv = group_advantages(rewards, groups, scale=scale)
    for k in groups.unique():
        assert adv[groups == k].sum().item() == pytest.approx(0.0, abs=1e-5)


def test_group_of_one_gets_zero():
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 1, 1]), scale="group")
    assert adv[0].item() == 0.0
    assert_close(adv[1:], torch.tensor([-0.707106, 0.707106]), atol=1e-5, rtol=0)


def test_invalid_scale_raises():
    with pytest.raises(ValueError, match="scale"):
        group_advantages(REWARDS, GROUPS, scale="mean")


# ---------------------------------------------------------------- ppo_clip_loss


def test_ratio_one_loss_and_grad_are_minus_advantage():
    adv = torch.tensor([[2.0, -1.0, 0.5]])
    logp = torch.tensor([[-1.0, -2.0, -0.3]], requires_grad=True)
    loss, clipped = ppo_clip_loss(logp, logp.detach().clone(), adv, clip_low=0.2, clip_high=0.28)
    assert_close(loss, -adv)
    loss.sum().backward()
    assert_close(logp.grad, -adv)
    assert not clipped.any()


def test_asymmetric_clip_values_grads_and_mask():
    # ratios 1.5, .5, .5, 1.5, 1 with advantages 2, -1, 2, -1, 3
    log_ratio = torch.tensor([[math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.5), 0.0]])
    adv = torch.tensor([[2.0, -1.0, 2.0, -1.0, 3.0]])
    old = torch.full_like(log_ratio, -1.0)
    logp = (old + log_ratio).requires_grad_(True)
    loss, clipped = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # A>0, ρ=1.5 → -1.28·A; A<0, ρ=.5 → -.8·A; the other side of each bound is not clipped: -ρ·A
    assert_close(loss, torch.tensor([[-2.56, 0.8, -1.0, 1.5, -3.0]]))
    loss.sum().backward()
    # d(-ρA)/dlogp = -ρA; clipped tokens get no gradient
    assert_close(logp.grad, torch.tensor([[0.0, 0.0, -1.0, 1.5, -3.0]]))
    assert clipped.tolist() == [[True, True, False, False, False]]


# ---------------------------------------------------------------- kl_estimate

KL_LOGP = torch.tensor([[-1.0, -2.0, -0.5]])
KL_REF = torch.tensor([[-2.0, -1.0, -0.5]])  # log-ratios 1, -1, 0


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", [1.0, -1.0, 0.0]),
        ("k2", [0.5, 0.5, 0.0]),
        ("k3", [0.367879, 0.718282, 0.0]),  # e^-1 - 1 + 1, e^1 - 1 - 1, 0
    ],
)
def test_kl_hand_values(kind, expected):
    assert_close(kl_estimate(KL_LOGP, KL_REF, kind), torch.tensor([expected]), atol=1e-5, rtol=0)


def test_k3_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(8, 50, generator=g) * 3, torch.randn(8, 50, generator=g) * 3
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert (kl_estimate(logp, logp, "k3") == 0).all()


def test_kl_invalid_kind_raises():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(KL_LOGP, KL_REF, "k4")


# ---------------------------------------------------------------- aggregate

AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
AGG_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])  # per-seq sums 3 and 15; 5 tokens, 2 seqs


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 3.6),  # 18 / 5
        ("seq-mean-token-sum", 9.0),  # 18 / 2
        ("seq-mean-token-mean", 3.25),  # (3/2 + 15/3) / 2
        ("seq-mean-token-sum-norm", 3.0),  # 18 / (2 · 3)
    ],
)
def test_aggregate_hand_values(mode, expected):
    got = aggregate(AGG_LOSS, AGG_MASK, mode, total_tokens=5, total_seqs=2, norm_len=3.0)
    # plain pytest.approx in this file (rel 1e-6): hand values (0.1, 1/3, 18/5) against a few float
    # operations on them, which round alike on every CPU; the margin is decimal representation only
    assert got.item() == pytest.approx(expected)


def test_aggregate_covers_every_mode():
    assert set(AGGREGATIONS) == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(AGG_LOSS, AGG_MASK, "mean", total_tokens=5, total_seqs=2)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_aggregate_shares_add_up_to_batch_loss(mode, parts):
    g = torch.Generator().manual_seed(2)
    loss = torch.randn(7, 9, generator=g, dtype=torch.float64)
    lengths = torch.tensor([9, 1, 4, 6, 2, 8, 5])
    mask = torch.arange(9)[None, :] < lengths[:, None]
    totals = {"total_tokens": float(mask.sum()), "total_seqs": 7.0, "norm_len": 9.0}
    whole = aggregate(loss, mask, mode, **totals)
    shares = [aggregate(l, m, mode, **totals) for l, m in zip(loss.tensor_split(parts), mask.tensor_split(parts))]
    assert len(shares) == parts
    assert_close(sum(shares), whole)


# ---------------------------------------------------------------- log-probs and entropy


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_token_logprobs_matches_manual_gather(temperature):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 11, generator=g)
    targets = torch.randint(0, 11, (2, 4), generator=g)
    got = token_logprobs(logits, targets, temperature=temperature)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    expected = torch.tensor([[logp[b, t, targets[b, t]].item() for t in range(4)] for b in range(2)])
    assert got.shape == (2, 4)
    assert_close(got, expected)


def test_token_logprobs_hand_values():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probs .25, .75
    target = torch.tensor([[1]])
    assert token_logprobs(logits, target).item() == pytest.approx(math.log(0.75), abs=1e-6)  # -0.287682
    # T=2: logits [0, ln√3] → p₁ = √3 / (1 + √3) = .633975
    assert token_logprobs(logits, target, temperature=2.0).item() == pytest.approx(-0.455746, abs=1e-5)


@pytest.mark.parametrize("V", [2, 7, 1000])
def test_entropy_of_uniform_is_log_v(V):
    h = entropy_from_logits(torch.full((2, 3, V), 0.37))
    assert_close(h, torch.full((2, 3), math.log(V)))


# ---------------------------------------------------------------- rloo, remax, dr.grpo


def test_rloo_hand_values():
    # group 0 (n=4, rewards 1 0 0 1): 1 − mean(0, 0, 1) = 2/3, 0 − mean(1, 0, 1) = −2/3; group 1: equal → 0
    adv = rloo_advantages(REWARDS, GROUPS)
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0])
    assert adv.dtype == torch.float32
    assert_close(adv, expected)


def test_rloo_equals_reward_minus_mean_of_the_others():
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(40, generator=g)
    groups = torch.randint(0, 6, (40,), generator=g)
    adv = rloo_advantages(rewards, groups)
    for i in range(40):
        others = [rewards[j].item() for j in range(40) if j != i and groups[j] == groups[i]]
        expected = rewards[i].item() - sum(others) / len(others) if others else 0.0
        assert adv[i].item() == pytest.approx(expected, abs=1e-5)


def test_rloo_group_of_one_gets_zero():
    # group 0 has one sample; group 1: 2 − 4 = −2, 4 − 2 = 2
    adv = rloo_advantages(torch.tensor([3.0, 2.0, 4.0]), torch.tensor([0, 1, 1]))
    assert_close(adv, torch.tensor([0.0, -2.0, 2.0]))


@pytest.mark.parametrize("estimator", ["rloo", "drgrpo"])
def test_zero_mean_per_group_rloo_and_drgrpo(estimator):
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(60, generator=g)
    groups = torch.randint(0, 7, (60,), generator=g)
    adv = rloo_advantages(rewards, groups) if estimator == "rloo" else group_advantages(rewards, groups, scale="none")
    for k in groups.unique():
        assert adv[groups == k].sum().item() == pytest.approx(0.0, abs=1e-5)


def test_remax_hand_values():
    # 1 − .25, .5 − 1
    adv = remax_advantages(torch.tensor([1.0, 0.5]), torch.tensor([0.25, 1.0]))
    assert adv.dtype == torch.float32
    assert_close(adv, torch.tensor([0.75, -0.5]))


# ---------------------------------------------------------------- terminal rewards, returns, gae, whitening


def test_terminal_rewards_on_last_masked_token():
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    out = terminal_rewards(torch.tensor([3.0, 4.0, 5.0]), mask)
    # row 0 ends at t=1, row 1 at t=3 (after a gap); row 2 has no policy token: its reward goes nowhere
    assert_close(out, torch.tensor([[0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0], [0.0, 0.0, 0.0, 0.0]]))


def test_discounted_returns_skip_gaps():
    # policy tokens at t = 0, 2, 3 (t=1 inserted by the environment; its reward 5 is ignored), γ = .5
    # G₃ = 2; G₂ = 0 + .5·2 = 1; G₀ = 1 + .5·1 = 1.5 (t=1 does not discount)
    rewards = torch.tensor([[1.0, 5.0, 0.0, 2.0]])
    mask = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    assert_close(discounted_returns(rewards, mask, gamma=0.5), torch.tensor([[1.5, 0.0, 1.0, 2.0]]))
    # γ = 1: plain suffix sums of the policy tokens' rewards
    assert_close(discounted_returns(rewards, mask, gamma=1.0), torch.tensor([[3.0, 0.0, 2.0, 2.0]]))


GAE_REWARDS = torch.tensor([[0.0, 0.0, 1.0]])
GAE_VALUES = torch.tensor([[0.5, 0.6, 0.7]])
GAE_MASK = torch.ones(1, 3, dtype=torch.bool)


def test_gae_hand_values():
    # γ = .9, λ = .8, γλ = .72; past the last token V = 0
    # δ₂ = 1 + .9·0 − .7 = .3                A₂ = .3
    # δ₁ = 0 + .9·.7 − .6 = .03              A₁ = .03 + .72·.3 = .246
    # δ₀ = 0 + .9·.6 − .5 = .04              A₀ = .04 + .72·.246 = .21712
    adv, ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.8)
    assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]]))
    assert_close(ret, adv + GAE_VALUES)  # .71712, .846, 1.0
    assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]]))


def test_gae_gamma_lambda_one_is_return_minus_value():
    g = torch.Generator().manual_seed(6)
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6, dtype=torch.bool)
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # telescoping: Σ_{s≥t} δ_s = Σ_{s≥t} r_s − V(t)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    assert_close(adv, returns - values)


def test_gae_skips_environment_tokens():
    # the same three policy tokens as GAE_*, with two environment tokens (garbage reward and value) in between
    rewards = torch.tensor([[0.0, 9.0, 9.0, 0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, -7.0, -7.0, 0.6, 0.7, -7.0]])
    mask = torch.tensor([[1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    compact_adv, compact_ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.8)
    assert_close(adv[mask], compact_adv[0])
    assert_close(ret[mask], compact_ret[0])
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_masked_whiten_hand_values():
    # on the mask 1, 2, 3: mean 2, unbiased std 1 → −1, 0, 1; the 100s are off the mask
    x = torch.tensor([[1.0, 100.0, 2.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 0, 1], [1, 0, 0]], dtype=torch.bool)
    assert_close(masked_whiten(x, mask), torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_masked_whiten_mean_zero_std_one_on_mask():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 9, generator=g) * 4 + 3
    mask = torch.rand(5, 9, generator=g) < 0.6
    out = masked_whiten(x, mask)
    assert out[mask].mean().item() == pytest.approx(0.0, abs=1e-5)
    assert out[mask].std().item() == pytest.approx(1.0, abs=1e-5)  # unbiased, as torch.std
    assert (out[~mask] == 0).all()


# ---------------------------------------------------------------- estimate_advantages

EST_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
EST_GROUPS = torch.tensor([0, 0, 1, 1])
EST_TOKEN_REWARDS = terminal_rewards(torch.tensor([1.0, 0.0, 2.0, 2.0]), EST_MASK)  # group 1 all equal


def _broadcast(adv_B):
    return torch.where(EST_MASK, torch.tensor(adv_B)[:, None], 0.0)


@pytest.mark.parametrize(
    "name, adv_B",
    [
        ("grpo", [0.707107, -0.707107, 0.0, 0.0]),  # group 0: ±.5 / std(1, 0) = ±.5/.707107
        ("drgrpo", [0.5, -0.5, 0.0, 0.0]),  # ±.5, no std
        ("rloo", [1.0, -1.0, 0.0, 0.0]),  # 1 − 0, 0 − 1
        ("remax", [0.5, -0.5, 1.0, -1.0]),  # minus the baselines .5, .5, 1, 3
    ],
)
def test_estimate_sequence_level_hand_values(name, adv_B):
    adv, returns = estimate_advantages(
        name, EST_TOKEN_REWARDS, EST_MASK, EST_GROUPS, baseline_N=torch.tensor([0.5, 0.5, 1.0, 3.0])
    )
    assert returns is None
    assert_close(adv, _broadcast(adv_B), atol=1e-5, rtol=0)


def test_estimate_reinforce_pp_hand_values():
    # γ = 1: every policy token's return is its sequence's reward: 1 1 | 0 | 2 2 2 | 2 2 (8 tokens)
    # mean 12/8 = 1.5; squared deviations .25·2 + 2.25 + .25·5 = 4, var 4/7, std .755929
    # → (1 − 1.5)/.755929 = −.661438, (0 − 1.5)/.755929 = −1.984313, (2 − 1.5)/.755929 = .661438
    adv, returns = estimate_advantages("reinforce++", EST_TOKEN_REWARDS, EST_MASK, EST_GROUPS)
    assert returns is None
    a, b, c = -0.661438, -1.984313, 0.661438
    expected = torch.tensor([[a, a, 0.0], [b, 0.0, 0.0], [c, c, c], [0.0, c, c]])
    assert_close(adv, expected, atol=1e-5, rtol=0)


def test_estimate_reinforce_pp_baseline_hand_values():
    # group means .5 and 2 subtracted at the last token: returns .5 .5 | −.5 | 0 0 0 | 0 0
    # mean .5/8 = .0625; squared deviations .4375²·2 + .5625² + .0625²·5 = .71875, var .71875/7, std .320435
    # The group mean already centres the returns, so only the std divides (no second, token-
    # weighted mean shift): .5/.320435 = 1.560374, −.5/.320435 = −1.560374, group 1 stays 0.
    adv, _ = estimate_advantages("reinforce++-baseline", EST_TOKEN_REWARDS, EST_MASK, EST_GROUPS)
    a, b, c = 1.560374, -1.560374, 0.0
    expected = torch.tensor([[a, a, 0.0], [b, 0.0, 0.0], [c, c, c], [0.0, c, c]])
    assert_close(adv, expected, atol=1e-5, rtol=0)


def test_estimate_gae_whitens_advantages_and_returns_raw_targets():
    # test_gae_hand_values' A = .21712, .246, .3: mean .254373, unbiased std .042070
    # → −.885515, −.199035, 1.084550; returns A + V unwhitened
    adv, returns = estimate_advantages(
        "gae", GAE_REWARDS, GAE_MASK, torch.tensor([0]), values_BT=GAE_VALUES, gamma=0.9, lam=0.8
    )
    assert_close(adv, torch.tensor([[-0.885515, -0.199035, 1.084550]]), atol=1e-5, rtol=0)
    assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0]]))


@pytest.mark.parametrize("name", ESTIMATORS)
def test_every_estimator_runs_and_is_zero_off_mask(name):
    g = torch.Generator().manual_seed(8)
    lengths = torch.tensor([5, 2, 4, 1, 3, 5])
    mask = torch.arange(5)[None, :] < lengths[:, None]
    mask[0, 2] = False  # an environment token inside a sequence
    token_rewards = terminal_rewards(torch.randn(6, generator=g), mask)
    adv, returns = estimate_advantages(
        name,
        token_rewards,
        mask,
        torch.tensor([0, 0, 0, 1, 1, 1]),
        values_BT=torch.randn(6, 5, generator=g),
        baseline_N=torch.randn(6, generator=g),
        gamma=0.9,
    )
    assert adv.shape == mask.shape and adv.dtype == torch.float32
    assert (adv[~mask] == 0).all()
    assert adv[mask].abs().sum() > 0
    assert torch.isfinite(adv).all()
    assert (returns is None) == (name != "gae")
    if returns is not None:
        assert (returns[~mask] == 0).all()


@pytest.mark.parametrize(
    "name, missing", [("remax", "baseline_N"), ("gae", "values_BT"), ("a2c", "advantage estimator")]
)
def test_estimate_errors(name, missing):
    with pytest.raises(ValueError, match=missing):
        estimate_advantages(name, EST_TOKEN_REWARDS, EST_MASK, EST_GROUPS)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "reinforce++-baseline"])
@pytest.mark.parametrize("loss_name", POLICY_LOSSES)
def test_equal_reward_group_contributes_zero_gradient(estimator, loss_name):
    g = torch.Generator().manual_seed(9)
    B, T, V = 6, 5, 7
    lengths = torch.tensor([5, 2, 4, 3, 5, 1])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.7, 0.7, 0.7])  # group 1 (rows 3–5) all equal
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=g)
    logp = token_logprobs(logits, targets)
    old_logp = logp.detach() + 0.1 * torch.randn(B, T, generator=g)
    adv, _ = estimate_advantages(estimator, terminal_rewards(rewards, mask), mask, groups)
    loss, _ = policy_loss(loss_name, logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28)
    aggregate(loss, mask, "token-mean", total_tokens=float(mask.sum()), total_seqs=float(B)).backward()
    assert (logits.grad[3:] == 0).all()
    assert logits.grad[:3].abs().sum() > 0


# ---------------------------------------------------------------- policy losses at ratio 1


def _ratio_one_setup():
    adv = torch.tensor([[2.0, -1.0, 0.5, 0.0], [-3.0, 1.0, 4.0, 4.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    logp = torch.tensor([[-1.0, -2.0, -0.3, -4.0], [-0.1, -0.7, -1.5, -2.5]], requires_grad=True)
    return adv, mask, logp


def test_cispo_ratio_one_gradient_is_minus_advantage():
    adv, _, logp = _ratio_one_setup()
    loss, clipped = cispo_loss(logp, logp.detach().clone(), adv)
    assert_close(loss, -adv * logp.detach())  # weight 1
    loss.sum().backward()
    assert_close(logp.grad, -adv)
    assert not clipped.any()


def test_gspo_ratio_one_seq_mean_token_mean_gradient():
    # per-token advantages of GSPO are the sequence's: take one per row
    adv = torch.tensor([[2.0], [-3.0]]).expand(2, 4)
    _, mask, logp = _ratio_one_setup()
    loss, clipped = gspo_loss(logp, logp.detach().clone(), adv, mask)
    assert_close(loss, -adv)  # s = 1
    # total_seqs=1: the plain sum over sequences of each one's token mean
    aggregate(loss, mask, "seq-mean-token-mean", total_tokens=7.0, total_seqs=1.0).backward()
    # −A·mean_t ∇logp: row 0 has 3 tokens → −2/3 on each; row 1 has 4 → 3/4 on each; 0 off the mask
    assert_close(logp.grad, torch.tensor([[-2 / 3, -2 / 3, -2 / 3, 0.0], [0.75, 0.75, 0.75, 0.75]]))
    assert not clipped.any()


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_policy_loss_ratio_one_gradient_is_minus_advantage(name):
    _, mask, logp = _ratio_one_setup()
    adv = torch.tensor([[2.0], [-3.0]]).expand(2, 4)  # sequence-level, so gspo agrees with the token losses
    loss, clipped = policy_loss(name, logp, logp.detach().clone(), adv, mask, clip_low=0.2, clip_high=0.28)
    (loss * mask).sum().backward()
    assert_close(logp.grad, torch.where(mask, -adv, 0.0))
    assert not clipped.any()


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_policy_loss_dispatches_to_the_named_loss(name):
    g = torch.Generator().manual_seed(10)
    logp, old = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    adv = torch.randn(3, 1, generator=g).expand(3, 4)
    mask = torch.rand(3, 4, generator=g) < 0.7
    got = policy_loss(name, logp, old, adv, mask, clip_low=0.2, clip_high=0.3)
    direct = {
        "ppo": lambda: ppo_clip_loss(logp, old, adv, 0.2, 0.3),
        "gspo": lambda: gspo_loss(logp, old, adv, mask, 0.2, 0.3),
        "cispo": lambda: cispo_loss(logp, old, adv, 0.2, 0.3),
    }[name]()
    assert_close(got[0], direct[0])
    assert torch.equal(got[1], direct[1])


def test_policy_loss_unknown_name_raises():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="policy loss"):
        policy_loss("trpo", x, x, x, x.bool(), 0.2, 0.2)


# ---------------------------------------------------------------- cispo


def test_cispo_hand_values():
    # ratios 1.5, .5, 1 at logp −1, −2, −.5 with A 2, −1, 3
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logp.detach() - torch.tensor([[math.log(1.5), math.log(0.5), 0.0]])
    adv = torch.tensor([[2.0, -1.0, 3.0]])
    # clip_low=1 (MiniMax-M1: no bottom), clip_high .28 → weights 1.28, .5, 1
    # loss = −w·A·logp: −1.28·2·(−1) = 2.56, −.5·(−1)·(−2) = −1, −1·3·(−.5) = 1.5
    loss, clipped = cispo_loss(logp, old, adv, clip_low=1.0, clip_high=0.28)
    assert_close(loss, torch.tensor([[2.56, -1.0, 1.5]]))
    assert clipped.tolist() == [[True, False, False]]
    loss.sum().backward()
    # every token keeps its gradient, −w·A: the clipped one too
    assert_close(logp.grad, torch.tensor([[-2.56, 0.5, -3.0]]))
    # clip_low .2: weight of ratio .5 → .8, loss −.8·(−1)·(−2) = −1.6
    loss, clipped = cispo_loss(logp.detach(), old, adv, clip_low=0.2, clip_high=0.28)
    assert_close(loss, torch.tensor([[2.56, -1.6, 1.5]]))
    assert clipped.tolist() == [[True, True, False]]


# ---------------------------------------------------------------- ppo dual clip


def test_dual_clip_bounds_negative_advantage():
    # log-ratios 5 (ρ ≈ 148), ln 2, 5, 0 with A −1, −1, +1, +1; c = 3
    log_ratio = torch.tensor([[5.0, math.log(2.0), 5.0, 0.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0]])
    old = torch.full_like(log_ratio, -1.0)
    logp = (old + log_ratio).requires_grad_(True)
    loss, cut = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # A<0, ρ=148: −ρA = 148 > −c·A = 3 → exactly 3, no gradient
    # A<0, ρ=2: max(2, 1.28) = 2 < 3 → untouched, gradient −ρA = 2
    # A>0: as without dual clip: ρ=148 → −1.28 (clipped, no gradient); ρ=1 → −1, gradient −1
    assert loss[0, 0].item() == 3.0
    assert_close(loss, torch.tensor([[3.0, 2.0, -1.28, -1.0]]))
    assert cut.tolist() == [[True, False, True, False]]
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0, -1.0]]))
    plain, plain_cut = ppo_clip_loss(logp.detach(), old, adv, clip_low=0.2, clip_high=0.28)
    assert_close(loss[0, 2:], plain[0, 2:])  # positive advantages unaffected
    assert plain_cut.tolist() == [[False, False, True, False]]


# ---------------------------------------------------------------- gspo


def test_gspo_hand_values():
    # row 0 log-ratios .1 .2 .3 → s = e^.2 = 1.221403, A = 1: clipped at 1.0004 → loss −1.0004, no gradient
    # row 1 log-ratios −.1 .1 (t=2 off the mask, log-ratio 5 ignored) → s = 1, A = −2: loss 2, gradient −s·A = 2
    log_ratio = torch.tensor([[0.1, 0.2, 0.3], [-0.1, 0.1, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0], [-2.0]]).expand(2, 3)
    old = torch.full_like(log_ratio, -1.0)
    logp = (old + log_ratio).requires_grad_(True)
    loss, clipped = gspo_loss(logp, old, adv, mask)  # paper's clip: 3e-4 low, 4e-4 high
    assert_close(loss, torch.tensor([[-1.0004, -1.0004, -1.0004], [2.0, 2.0, 2.0]]))
    assert clipped.tolist() == [[True, True, True], [False, False, False]]
    (loss * mask).sum().backward()
    assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 0.0]]))


def test_gspo_token_ratio_value_is_sequence_ratio():
    g = torch.Generator().manual_seed(11)
    logp, old = torch.randn(4, 6, generator=g) * 0.3, torch.randn(4, 6, generator=g) * 0.3
    mask = torch.rand(4, 6, generator=g) < 0.7
    mask[:, 0] = True
    adv = -torch.ones(4, 6)
    loss, clipped = gspo_loss(logp, old, adv, mask, clip_low=10.0, clip_high=10.0)  # wide: nothing clipped
    assert not clipped.any()
    for b in range(4):
        s = math.exp((logp[b] - old[b])[mask[b]].mean().item())
        assert_close(loss[b], torch.full((6,), s))  # −s·A = s on every token of the sequence


def test_gspo_clip_uses_sequence_ratio():
    # row 0: tokens ρ = 2, .5, 1 (PPO would clip two), s = 1 → nothing clipped
    # row 1: tokens ρ = e^.3 each, s = e^.3 = 1.35 > 1.2 with A > 0 → the whole sequence clipped
    # row 2: tokens log-ratio .5, −.3 → s = e^.1 = 1.105 → nothing clipped, though token 0's ρ = 1.65
    log_ratio = torch.tensor([[math.log(2.0), -math.log(2.0), 0.0], [0.3, 0.3, 0.3], [0.5, -0.3, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.ones(3, 3)
    old = torch.full_like(log_ratio, -1.0)
    logp = (old + log_ratio).requires_grad_(True)
    loss, clipped = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert clipped.tolist() == [[False] * 3, [True] * 3, [False] * 3]
    _, ppo_clipped = ppo_clip_loss(logp, old, adv, 0.2, 0.2)
    assert ppo_clipped[0].tolist() == [True, False, False] and ppo_clipped[2, 0]
    (loss * mask).sum().backward()
    # gradient −s·A per token: 1 on row 0, 0 on row 1, e^.1 on row 2's masked tokens
    e = math.exp(0.1)
    assert_close(logp.grad, torch.tensor([[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0], [-e, -e, 0.0]]))


# ---------------------------------------------------------------- value loss


def test_value_loss_hand_values():
    values = torch.tensor([[1.0, 1.0, 1.0, 0.5]], requires_grad=True)
    old = torch.tensor([[0.9, 0.5, 0.5, 0.5]])
    returns = torch.tensor([[2.0, 0.0, 2.0, 0.6]])
    loss, clipped = value_loss(values, old, returns, clip=0.2)
    # t0: V moved .1 (inside ±.2): ½·(1 − 2)² = .5
    # t1: V clipped to .7, (.7 − 0)² = .49 < (1 − 0)² = 1 → the unclipped .5 wins
    # t2: V clipped to .7, (.7 − 2)² = 1.69 > (1 − 2)² = 1 → ½·1.69 = .845, clipped, no gradient
    # t3: ½·(.5 − .6)² = .005
    assert_close(loss, torch.tensor([[0.5, 0.5, 0.845, 0.005]]))
    assert clipped.tolist() == [[False, False, True, False]]
    loss.sum().backward()
    # d/dV ½(V − R)² = V − R
    assert_close(values.grad, torch.tensor([[-1.0, 1.0, 0.0, -0.1]]))


def test_value_loss_unclipped():
    # ½·(1 − 2)², ½·(1 − 0)², ½·(.5 − .6)² whatever V_old is
    loss, clipped = value_loss(
        torch.tensor([1.0, 1.0, 0.5]), torch.tensor([0.0, 9.0, -9.0]), torch.tensor([2.0, 0.0, 0.6]), clip=None
    )
    assert_close(loss, torch.tensor([0.5, 0.5, 0.005]))
    assert not clipped.any()


# ---------------------------------------------------------------- entropy, k3, adaptive KL


def test_entropy_hand_values():
    # p = .25, .75: H = −(.25·ln .25 + .75·ln .75) = .346574 + .215762 = .562335
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert entropy_from_logits(logits).item() == pytest.approx(0.562335, abs=1e-5)
    # temperature 2 on logits [0, 2 ln 3] is the same distribution
    assert entropy_from_logits(logits * 2, temperature=2.0).item() == pytest.approx(0.562335, abs=1e-5)


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
def test_k3_nonnegative_randomized(scale):
    g = torch.Generator().manual_seed(12)
    logp, ref = torch.randn(64, 64, generator=g) * scale, torch.randn(64, 64, generator=g) * scale
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(k3).all()
    # expm1: exp(x) − 1 − x written plainly rounds a few 1e-8 below 0 in float32
    assert k3.min().item() >= 0.0


def test_adaptive_kl_hand_values():
    # β ← β·(1 + clip(KL/target − 1, ±.2)·n/horizon), n/horizon = 100/1000 = .1
    cases = [
        (0.1, 0.102),  # KL/target − 1 = 1 → clip .2 → ×1.02: grows
        (0.055, 0.101),  # .1 → ×1.01
        (0.05, 0.1),  # on target: unchanged
        (0.045, 0.099),  # −.1 → ×.99: shrinks
        (0.0, 0.098),  # −1 → clip −.2 → ×.98
    ]
    for kl, expected in cases:
        ctrl = AdaptiveKLController(0.1, target=0.05, horizon=1000)
        assert ctrl.update(kl, n_samples=100) == pytest.approx(expected)
        assert ctrl.coef == pytest.approx(expected)


def test_adaptive_kl_bounded_step_and_fixed_without_target():
    ctrl = AdaptiveKLController(1.0, target=0.01, horizon=100)
    for _ in range(3):
        before = ctrl.coef
        ctrl.update(1e6, n_samples=100)  # n = horizon: at most ×1.2 per step
        assert ctrl.coef == pytest.approx(before * 1.2)
    fixed = AdaptiveKLController(0.3, target=None)
    for kl in (0.0, 1.0, 1e6):
        assert fixed.update(kl, n_samples=10_000) == 0.3


def test_adaptive_kl_state_dict_round_trip():
    ctrl = AdaptiveKLController(0.1, target=0.05, horizon=1000)
    for kl in (0.2, 0.01, 0.07):
        ctrl.update(kl, n_samples=64)
    restored = AdaptiveKLController(0.1, target=0.05, horizon=1000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.coef == ctrl.coef
    assert restored.update(0.09, n_samples=64) == ctrl.update(0.09, n_samples=64)


# ---------------------------------------------------------------- DAPO shaping


def test_overlong_penalty_hand_values():
    # max_len 10, buffer 4: free up to 6; 8 → (6 − 8)/4 = −.5; 10 → −1; beyond → −1; × factor .5
    lengths = torch.tensor([3, 6, 7, 8, 10, 15])
    assert_close(overlong_penalty(lengths, max_len=10, buffer=4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    assert_close(
        overlong_penalty(lengths, max_len=10, buffer=4, factor=0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    )
    off = overlong_penalty(lengths, max_len=10, buffer=0)
    assert off.dtype == torch.float32 and (off == 0).all()


def test_informative_groups_hand_values():
    # group 0: 1 ≠ 0 → True; group 1: 1 = 1 → False; group 2: one sample → False; group 3: .3 .3 .30001 → True
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.3, 0.3, 0.30001])
    groups = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3])
    assert informative_groups(rewards, groups).tolist() == [True, False, False, True]


# ---------------------------------------------------------------- gradients do not depend on the micro-batch split


def _micro_batch_grads(model, feats_BTF, targets_BT, old_logp_BT, adv_BT, mask_BT, loss_name, mode, parts, clip):
    # every micro-batch uses the whole batch's totals and a constant norm_len; gradients accumulate
    totals = {"total_tokens": float(mask_BT.sum()), "total_seqs": float(mask_BT.any(-1).sum()), "norm_len": 7.0}
    model.zero_grad()
    clipped_any = []
    micro_batches = zip(*(x.tensor_split(parts) for x in (feats_BTF, targets_BT, old_logp_BT, adv_BT, mask_BT)))
    for f, y, old, adv, m in micro_batches:
        logp = token_logprobs(model(f), y)
        loss, clipped = policy_loss(loss_name, logp, old, adv, m, clip_low=clip, clip_high=clip, dual_clip=3.0)
        aggregate(loss, m, mode, **totals).backward()
        clipped_any.append(clipped[m])
    return [p.grad.clone() for p in model.parameters()], torch.cat(clipped_any)


@pytest.mark.parametrize("loss_name", ["ppo", "gspo"])
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_gradient_does_not_depend_on_micro_batch_split(mode, loss_name):
    g = torch.Generator().manual_seed(13)
    B, T, F, V = 8, 7, 6, 5
    model = torch.nn.Linear(F, V, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    feats = torch.randn(B, T, F, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([7, 1, 4, 6, 2, 5, 3, 7])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    with torch.no_grad():
        old_logp = token_logprobs(model(feats), targets) + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T)  # one advantage per sequence, as GSPO expects
    clip = 0.2 if loss_name == "ppo" else 0.1
    whole, clipped = _micro_batch_grads(model, feats, targets, old_logp, adv, mask, loss_name, mode, 1, clip)
    assert clipped.any() and not clipped.all()  # the clip is exercised on part of the batch
    assert sum(p.abs().sum() for p in whole) > 0
    for parts in (2, 4):
        split, _ = _micro_batch_grads(model, feats, targets, old_logp, adv, mask, loss_name, mode, parts, clip)
        for a, b in zip(split, whole):
            assert_close(a, b)
