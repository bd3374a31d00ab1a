"""Sequence packing (`train.packing`): the sequences of a micro-batch share rows, each at its
own positions, attention kept within it, and the loss, gradients and log-probs are the padded
path's."""

from __future__ import annotations

import random

import pytest
import torch
from test_trainer import GRAD_TOL

from tidal.algorithms import AGGREGATIONS
from tidal.config import AlgorithmConfig, TrainConfig
from tidal.trainer.trainer import TrainBatch, Trainer, pack_rows, packed_inputs


def _long_tailed_batch(n=12, seed=0) -> TrainBatch:
    """Mostly short sequences and a few long ones (as a batch of hasty and worked answers is)."""
    rng = random.Random(seed)
    tokens, masks, behav, old = [], [], [], []
    for i in range(n):
        p, r = rng.randint(3, 9), (rng.randint(20, 30) if i % 5 == 0 else rng.randint(1, 6))
        tokens.append([rng.randrange(10, 200) for _ in range(p + r)])
        masks.append([False] * p + [True] * r)
        behav.append([0.0] * p + [rng.uniform(-6, -4) for _ in range(r)])
        old.append([rng.uniform(-6.5, -4.5) for _ in range(p + r - 1)])
    adv = [[rng.uniform(-1.5, 1.5) if m else 0.0 for m in mk[1:]] for mk in masks]
    return TrainBatch(tokens, masks, adv, behav, old)


def _run(model_dir, packing: bool, agg="token-mean", budget=10_000, kl=0.0):
    torch.manual_seed(0)
    tr = Trainer(str(model_dir), TrainConfig(micro_batch_tokens=budget, packing=packing),
                 AlgorithmConfig(loss_agg=agg, kl_coef=kl), pad_token_id=0)
    batch = _long_tailed_batch()
    metrics = tr.forward_backward(batch)
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    tr.model.zero_grad()
    return grads, metrics, tr.logprobs(batch)


def test_pack_rows_places_every_sequence_once_within_capacity():
    rng = random.Random(1)
    for _ in range(50):
        lengths = [rng.choice([rng.randint(2, 8), rng.randint(30, 60)]) for _ in range(rng.randint(1, 40))]
        cap = max(lengths)
        rows = pack_rows(lengths, cap)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in r) <= cap for r in rows)
        # first fit leaves at most one row at most half full (a later such row's sequences would
        # have fitted in the earlier one), so no packing here wastes more than half a row per row
        loads = [sum(lengths[i] for i in r) for r in rows]
        assert sum(load * 2 <= cap for load in loads) <= 1
    assert pack_rows([40, 12, 25, 7, 33, 40, 2], 40) == [[0], [5], [4, 3], [2, 1, 6]]


def test_packed_inputs_restart_positions_and_index_every_target():
    toks = [[5] * 6, [7] * 2, [9] * 3]
    ids, pos, index = packed_inputs(toks, 0)
    assert ids.tolist() == [[5] * 6, [9, 9, 9, 7, 7, 0]]
    assert pos.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 0]]
    # sequence 1 ([7, 7]) sits at row 1, offset 3: its one target position is flat index 6 + 3
    assert index.tolist() == [[0, 1, 2, 3, 4], [9, 0, 0, 0, 0], [6, 7, 0, 0, 0]]


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_packed_gradients_equal_the_padded_ones(tiny_model_dir, agg):
    padded, m_pad, lp_pad = _run(tiny_model_dir, packing=False, agg=agg)
    packed, m_pack, lp_pack = _run(tiny_model_dir, packing=True, agg=agg)
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], **GRAD_TOL)
    assert m_pack["loss"] == pytest.approx(m_pad["loss"], rel=1e-4, abs=1e-7)  # as GRAD_TOL
    # log-probs of an fp32 model: summation order only (logits measured within 7e-6 of each other)
    for a, b in zip(lp_pack, lp_pad):
        assert a == pytest.approx(b, abs=1e-4)


def test_packing_with_a_split_and_a_kl_reference(tiny_model_dir):
    """Several micro-batches (each packed on its own) and the reference's forward packed too."""
    padded, _, _ = _run(tiny_model_dir, packing=False, budget=64, kl=0.1)
    packed, m_pack, _ = _run(tiny_model_dir, packing=True, budget=64, kl=0.1)
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], **GRAD_TOL)
    assert m_pack["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any step


def test_without_restarted_positions_the_sequences_would_see_each_other(tiny_model_dir):
    """The control: the same packed rows with positions running on across sequences (no
    packed-sequence mask) change the logits of every sequence not first in its row, by far
    more than the tolerance above; so the equality above rests on the mask."""
    from tidal.models import load_model

    model = load_model(str(tiny_model_dir)).eval()
    toks = _long_tailed_batch().tokens
    ids, pos, index = packed_inputs(toks, 0)
    with torch.no_grad():
        right = model(input_ids=ids, position_ids=pos, use_cache=False).logits.flatten(0, 1)[index]
        running = torch.arange(ids.shape[1]).expand_as(ids)
        wrong = model(input_ids=ids, position_ids=running, use_cache=False).logits.flatten(0, 1)[index]
    rows = pack_rows([len(t) for t in toks], max(len(t) for t in toks))
    later = [i for r in rows for i in r[1:]]
    assert later
    for i in later:
        n = len(toks[i]) - 1
        assert (right[i, :n] - wrong[i, :n]).abs().max() > 1e-2
