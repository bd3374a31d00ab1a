"""Importance weights and rejection masks of tidal.algorithms.corrections against
hand-computed values and the invariants they promise.

Legend: B sequences, T tokens. log-ratio = prox_logp − behav_logp."""

import math

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms import IS_LEVELS, REJECTION_LEVELS, importance_weights, rejection_mask


def _logps(log_ratio_BT):
    behav = torch.full_like(log_ratio_BT, -1.0)
    return behav + log_ratio_BT, behav


# ---------------------------------------------------------------- importance_weights

# row 0: ratios 1.5, .5, 3 on the mask; row 1: ratios 2, 2, and an off-mask token with ratio e^7
IS_LOG_RATIO = torch.tensor([[math.log(1.5), math.log(0.5), math.log(3.0)], [math.log(2.0), math.log(2.0), 7.0]])
IS_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def test_token_weights_hand_values():
    # min(ρ, 2): 1.5, .5, 2 (truncated) | 2, 2 (at the cap, not truncated) and 1 off the mask
    w, truncated = importance_weights(*_logps(IS_LOG_RATIO), IS_MASK, level="token", cap=2.0)
    assert_close(w, torch.tensor([[1.5, 0.5, 2.0], [2.0, 2.0, 1.0]]))
    assert truncated.tolist() == [[False, False, True], [False, False, False]]


def test_sequence_weights_hand_values():
    # row 0: 1.5·.5·3 = 2.25 → cap 3 keeps it, cap 2 truncates; row 1: 2·2 = 4 (the e^7 is off the mask)
    w, truncated = importance_weights(*_logps(IS_LOG_RATIO), IS_MASK, level="sequence", cap=5.0)
    assert_close(w, torch.tensor([[2.25, 2.25, 2.25], [4.0, 4.0, 1.0]]))
    assert not truncated.any()
    w, truncated = importance_weights(*_logps(IS_LOG_RATIO), IS_MASK, level="sequence", cap=2.0)
    assert_close(w, torch.tensor([[2.0, 2.0, 2.0], [2.0, 2.0, 1.0]]))
    assert truncated.tolist() == [[True, True, True], [True, True, False]]


def test_level_none_is_all_ones():
    w, truncated = importance_weights(*_logps(IS_LOG_RATIO), IS_MASK, level="none", cap=2.0)
    assert (w == 1).all() and not truncated.any()


def _random_logps(seed):
    g = torch.Generator().manual_seed(seed)
    prox = (torch.randn(5, 8, generator=g) * 0.3).requires_grad_(True)
    behav = torch.randn(5, 8, generator=g) * 0.3
    mask = torch.rand(5, 8, generator=g) < 0.7
    mask[:, 0] = True
    return prox, behav, mask


def test_sequence_weight_is_product_of_token_ratios():
    prox, behav, mask = _random_logps(0)
    w, truncated = importance_weights(prox, behav, mask, level="sequence", cap=1e6)
    assert not truncated.any()
    for b in range(5):
        product = math.prod(math.exp(prox[b, t].item() - behav[b, t].item()) for t in range(8) if mask[b, t])
        assert_close(w[b][mask[b]], torch.full((int(mask[b].sum()),), product))
    assert (w[~mask] == 1).all()


def test_token_weight_is_exp_of_token_log_ratio():
    prox, behav, mask = _random_logps(1)
    w, _ = importance_weights(prox, behav, mask, level="token", cap=1e6)
    assert_close(w[mask], (prox - behav).exp()[mask].detach())
    assert (w[~mask] == 1).all()


@pytest.mark.parametrize("level", IS_LEVELS)
def test_weights_are_truncated_and_detached(level):
    prox, behav, mask = _random_logps(2)
    w, truncated = importance_weights(prox * 5, behav, mask, level=level, cap=1.5)
    assert not w.requires_grad and w.grad_fn is None
    assert (w <= 1.5).all()
    assert (w[~mask] == 1).all() and not truncated[~mask].any()
    if level != "none":
        assert truncated.any()
        assert (w[truncated] == 1.5).all()


def test_unknown_is_level_raises():
    with pytest.raises(ValueError, match="importance-weight level"):
        importance_weights(*_logps(IS_LOG_RATIO), IS_MASK, level="segment")


# ---------------------------------------------------------------- rejection_mask

# row 0: ratios 1.5, .4, 2.5 → geometric mean (1.5·.4·2.5)^(1/3) = 1.5^(1/3) = 1.144714: kept
# row 1: ratios 1.9, 1.9, 3  → geometric mean (1.9²·3)^(1/3) = 10.83^(1/3) = 2.212464: dropped
# row 2: ratios 3, 1/3, 1    → geometric mean 1: kept; the off-mask ratio 100 would give 100^(1/3) = 4.64 if counted
REJ_LOG_RATIO = torch.tensor(
    [
        [math.log(1.5), math.log(0.4), math.log(2.5), 0.0],
        [math.log(1.9), math.log(1.9), math.log(3.0), 0.0],
        [math.log(3.0), -math.log(3.0), 0.0, math.log(100.0)],
    ]
)
REJ_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)


def test_token_rejection_hand_values():
    # keep iff .5 ≤ ρ ≤ 2
    kept = rejection_mask(*_logps(REJ_LOG_RATIO), REJ_MASK, level="token", low=0.5, high=2.0)
    assert kept.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, False, True, False],
    ]


def test_geometric_rejection_keeps_or_drops_whole_rows():
    kept = rejection_mask(*_logps(REJ_LOG_RATIO), REJ_MASK, level="geometric", low=0.5, high=2.0)
    assert kept.tolist() == [
        [True, True, True, False],
        [False, False, False, False],
        [True, True, True, False],
    ]
    # a wider band keeps row 1 as well: 2.212464 ≤ 2.5
    kept = rejection_mask(*_logps(REJ_LOG_RATIO), REJ_MASK, level="geometric", low=0.5, high=2.5)
    assert kept.tolist() == [[True, True, True, False]] * 3


def test_geometric_rejection_is_row_constant_on_random_data():
    prox, behav, mask = _random_logps(3)
    kept = rejection_mask(prox * 4, behav, mask, level="geometric", low=0.8, high=1.25)
    for b in range(5):
        row = kept[b][mask[b]]
        assert row.all() or not row.any()
    assert kept.any() and not kept[mask].all()
    assert not kept[~mask].any()


def test_rejection_none_keeps_every_masked_token():
    kept = rejection_mask(*_logps(REJ_LOG_RATIO), REJ_MASK, level="none")
    assert torch.equal(kept, REJ_MASK)


@pytest.mark.parametrize("level", REJECTION_LEVELS)
def test_rejection_never_keeps_off_mask_tokens(level):
    prox, behav, mask = _random_logps(4)
    kept = rejection_mask(prox, behav, mask, level=level, low=0.0, high=math.inf)
    assert torch.equal(kept, mask)  # the widest band keeps exactly the mask


def test_unknown_rejection_level_raises():
    with pytest.raises(ValueError, match="rejection level"):
        rejection_mask(*_logps(REJ_LOG_RATIO), REJ_MASK, level="arithmetic")
