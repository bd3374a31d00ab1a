"""Advantages, PPO loss, KL estimators and loss aggregation against hand-computed values."""

import math

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms import (
    AGGREGATIONS,
    aggregate,
    entropy_from_logits,
    group_advantages,
    kl_estimate,
    ppo_clip_loss,
    token_logprobs,
)

# ---------------------------------------------------------------- group_advantages

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
    totals = dict(total_tokens=float(mask.sum()), total_seqs=7.0, norm_len=9.0)
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
