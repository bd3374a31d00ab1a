"""Sequence packing (`train.packing`): the sequences of a micro-batch share rows, each at its
own positions, attention kept within it, and the loss, gradients and log-probs are the padded
path's. Shared prompts (`train.share_prompts`): a group's prompt is computed once, its samples'
tokens attend to it through a 4-D mask, and again the loss, gradients and log-probs are the
padded path's."""

from __future__ import annotations

import random

import pytest
import torch
from test_trainer import GRAD_TOL

from tidal.algorithms import AGGREGATIONS
from tidal.config import AlgorithmConfig, TrainConfig
from tidal.trainer.layout import pack_rows, packed_inputs, shared_inputs, shared_micro_batches, shared_units
from tidal.trainer.trainer import TrainBatch, Trainer


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


def _grouped_batch(groups=5, samples=4, seed=0, answers=None) -> TrainBatch:
    """GRPO-shaped: each prompt sampled several times, answers of long-tailed lengths; one group's
    prompt is another's first tokens (a shared prefix that is not a whole prompt stays unshared)."""
    rng = random.Random(seed)
    tokens, masks, behav, old = [], [], [], []
    prompts = [[rng.randrange(10, 200) for _ in range(rng.randint(3, 9))] for _ in range(groups)]
    prompts[1] = prompts[0] + prompts[1][:2]
    for g, prompt in enumerate(prompts):
        for j in range(samples):
            r = rng.randint(*answers) if answers else rng.randint(20, 30) if j == 0 and g % 2 == 0 else rng.randint(1, 6)
            tokens.append(prompt + [rng.randrange(10, 200) for _ in range(r)])
            masks.append([False] * len(prompt) + [True] * r)
            behav.append([0.0] * len(prompt) + [rng.uniform(-6, -4) for _ in range(r)])
            old.append([rng.uniform(-6.5, -4.5) for _ in range(len(prompt) + r - 1)])
    adv = [[rng.uniform(-1.5, 1.5) if m else 0.0 for m in mk[1:]] for mk in masks]
    return TrainBatch(tokens, masks, adv, behav, old)


def _run(model_dir, packing: bool, agg="token-mean", budget=10_000, kl=0.0, share=False, attention="auto",
         batch=None):
    torch.manual_seed(0)
    tr = Trainer(str(model_dir), TrainConfig(micro_batch_tokens=budget, packing=packing, share_prompts=share,
                                             attention=attention),
                 AlgorithmConfig(loss_agg=agg, kl_coef=kl), pad_token_id=0)
    batch = batch or _long_tailed_batch()
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


def test_shared_inputs_lay_a_prompt_out_once_with_its_samples_after_it():
    toks = [[5, 6, 1, 2], [5, 6, 3], [9, 4]]  # two samples of the prompt [5, 6], and a lone sequence
    ids, pos, allowed, index = shared_inputs(toks, [2, 2, 1], 0)
    assert ids.tolist() == [[5, 6, 1, 2, 3], [9, 4, 0, 0, 0]]
    assert pos.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]  # each sample continues from the prompt
    a = allowed[0, 0].int().tolist()
    assert a == [[1, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0],
                 [1, 1, 1, 0, 0],
                 [1, 1, 1, 1, 0],
                 [1, 1, 0, 0, 1]]  # the second sample sees the prompt and itself, not its sibling's tokens
    assert allowed[1, 0].int().tolist()[2:] == [[0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]  # the tail
    # sequence 1 = [5, 6, 3]: its targets are scored at the prompt's positions 0, 1 (flat 0, 1)
    assert index.tolist() == [[0, 1, 2], [0, 1, 0], [5, 0, 0]]


def test_shared_micro_batches_keep_groups_whole_within_the_budget():
    rng = random.Random(2)
    for _ in range(50):
        toks, prompts = [], []
        for _g in range(rng.randint(1, 12)):
            prompt = [rng.randrange(10, 200) for _ in range(rng.randint(2, 20))]
            for _s in range(rng.randint(1, 8)):
                toks.append(prompt + [rng.randrange(10, 200) for _ in range(rng.randint(1, 30))])
                prompts.append(len(prompt))
        budget = rng.choice([60, 120, 10_000])
        parts = shared_micro_batches(toks, prompts, budget)
        assert sorted(i for part in parts for i in part) == list(range(len(toks)))
        for part in parts:
            units = shared_units([toks[i] for i in part], [prompts[i] for i in part])
            laid = sum(p + sum(len(toks[part[j]]) - p for j in members) for p, members in units)
            assert laid <= budget
        if budget == 10_000:  # everything fits: one micro-batch, each prompt laid out once
            assert len(parts) == 1
    with pytest.raises(ValueError, match="micro_batch_tokens=8"):
        shared_micro_batches([[1] * 9], [3], 8)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize(("budget", "long_groups"), [(10_000, False), (40, False), (10_000, True)])
def test_shared_prompt_gradients_equal_the_padded_ones(tiny_model_dir, attention, budget, long_groups):
    """One micro-batch; a budget of 40 tokens that splits groups across micro-batches; groups longer
    than the unit length (the test model's hidden size, 64), split into units within one
    micro-batch. With a KL reference, whose forward shares the prompts too. Tolerances as in the
    packing tests above."""
    batch = _grouped_batch(groups=3, samples=6, answers=(10, 20)) if long_groups else _grouped_batch()
    if long_groups:  # each group is laid out as more than one unit
        prompts = [m.index(True) for m in batch.loss_mask]
        longest = max(len(t) for t in batch.tokens)
        assert len(shared_units(batch.tokens, prompts, max(64, longest))) > len(shared_units(batch.tokens, prompts))
    padded, m_pad, lp_pad = _run(tiny_model_dir, packing=False, budget=10_000, kl=0.1, batch=batch)
    shared, m_sh, lp_sh = _run(tiny_model_dir, packing=False, budget=budget, kl=0.1, share=True,
                               attention=attention, batch=batch)
    for name in padded:
        torch.testing.assert_close(shared[name], padded[name], **GRAD_TOL)
    assert m_sh["loss"] == pytest.approx(m_pad["loss"], rel=1e-4, abs=1e-7)
    assert m_sh["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any step
    for a, b in zip(lp_sh, lp_pad):
        assert a == pytest.approx(b, abs=1e-4)


def test_without_the_mask_the_samples_would_see_each_other(tiny_model_dir):
    """The control: the same shared layout under a plain causal mask lets each sample after the
    first attend to its siblings' tokens, which moves its logits far beyond the tolerance above."""
    from tidal.models import load_model

    model = load_model(str(tiny_model_dir)).eval()
    batch = _grouped_batch()
    prompts = [m.index(True) for m in batch.loss_mask]
    ids, pos, allowed, index = shared_inputs(batch.tokens, prompts, 0)
    causal = torch.ones_like(allowed).tril()
    with torch.no_grad():
        right = model(input_ids=ids, position_ids=pos, attention_mask=allowed, use_cache=False).logits.flatten(0, 1)
        wrong = model(input_ids=ids, position_ids=pos, attention_mask=causal, use_cache=False).logits.flatten(0, 1)
    later = [i for p, members in shared_units(batch.tokens, prompts) for i in members[1:]
             if len(batch.tokens[i]) - p >= 2]  # a position of its own that is scored
    assert len(later) >= 5
    for i in later:
        own = index[i, prompts[i]:len(batch.tokens[i]) - 1]  # the sample's own positions
        assert (right[own] - wrong[own]).abs().max() > 1e-2


def test_share_prompts_computes_each_prompt_once(tiny_model_dir):
    """What the option is for: the model is fed each group's prompt once. The real tokens fed
    (non-padding, counted by a hook on the embedding) are the batch's tokens less the prompt
    copies of every sample after its group's first."""
    batch = _grouped_batch()
    prompts = [m.index(True) for m in batch.loss_mask]
    fed = {}
    for share in (False, True):
        tr = Trainer(str(tiny_model_dir), TrainConfig(packing=True, share_prompts=share), AlgorithmConfig(),
                     pad_token_id=0)
        ids = []
        handle = tr.model.get_input_embeddings().register_forward_hook(lambda _m, args, _out, ids=ids: ids.append(args[0]))
        tr.forward_backward(batch)
        handle.remove()
        fed[share] = sum(int((x != 0).sum()) for x in ids)  # the batch's tokens are 10..199; 0 pads
    total = sum(len(t) for t in batch.tokens)
    copies = sum((len(members) - 1) * p for p, members in shared_units(batch.tokens, prompts))
    assert copies > 0
    assert fed[False] == total
    assert fed[True] == total - copies


def test_shared_units_split_a_group_to_the_length_given():
    toks = [[1, 2, 3] + [9] * n for n in (5, 6, 2, 7)] + [[4, 5] + [8] * 3]
    prompts = [3, 3, 3, 3, 2]
    assert shared_units(toks, prompts) == [(3, [0, 1, 2, 3]), (2, [4])]
    # the prompt once, then the members' own tokens, each unit within 14 (a unit's first member may pass it)
    assert shared_units(toks, prompts, 14) == [(3, [0, 1]), (3, [2, 3]), (2, [4])]
    assert shared_units(toks, prompts, 5) == [(3, [0]), (3, [1]), (3, [2]), (3, [3]), (2, [4])]
    ids = shared_inputs(toks, prompts, 0, max_len=14)[0]
    assert ids.shape[1] == 3 + 5 + 6  # rows as long as the longest unit: [1 2 3] then 5 and 6 own tokens
