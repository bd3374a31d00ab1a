"""Context parallelism's attention without an [S, S] mask (tidal/trainer/parallel/context.py,
`causal_spans`), in one process: span by span causal attention equals attention under the dense
mask the layouts describe (the share_prompts layout's own [rows, S, S] mask, packed sequences'
block-diagonal causal mask), forward and backward. The multi-rank runs are tests/test_parallel.py's
cp shapes."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from tidal.trainer.layout import packed_inputs, shared_inputs
from tidal.trainer.parallel.context import causal_spans, row_spans


def _qkv(rows, S, heads=2, dim=8):
    torch.manual_seed(0)
    return [torch.randn(rows, heads, S, dim, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def _both(mask, spans, keep):
    """Outputs and input gradients of dense-mask attention and of `causal_spans`, at `keep`."""
    out = []
    for run in (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                lambda q, k, v: causal_spans(q, k, v, spans)):
        q, k, v = _qkv(*mask.shape[:1], mask.shape[-1])
        o = run(q, k, v)
        w = torch.randn_like(o, generator=torch.Generator().manual_seed(1)) * keep[:, None, :, None]
        (o * w).sum().backward()
        out.append((o * keep[:, None, :, None], q.grad, k.grad, v.grad))
    return out


def _close(dense, spans):
    # float64: the same sums in another blocking, ~1e-15 apart; a span attending one key too many
    # or too few moves outputs by O(0.1)
    for a, b in zip(dense, spans):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _tokens(seed=0):
    rng = random.Random(seed)
    toks, prompts = [], []
    for _ in range(3):
        p = [rng.randrange(3, 50) for _ in range(rng.randint(2, 6))]
        for _ in range(rng.randint(2, 3)):
            toks.append(p + [rng.randrange(3, 50) for _ in range(rng.randint(1, 7))])
            prompts.append(len(p))
    return toks, prompts


def test_shared_prompt_spans_attend_as_the_layouts_mask():
    toks, prompts = _tokens()
    ids, pos, allowed, index = shared_inputs(toks, prompts, 0, max_len=20)
    ids2, pos2, spans, index2 = shared_inputs(toks, prompts, 0, max_len=20, spans=True)
    assert torch.equal(ids, ids2) and torch.equal(pos, pos2) and torch.equal(index, index2)
    assert all(row[0][0] == 0 and row[-1][1] == ids.shape[1] for row in spans)  # each row covered
    assert any(p0 is not None for row in spans for *_, p0, _ in row)  # members with a prefix: covered
    keep = torch.zeros(ids.shape, dtype=torch.bool)  # the sequences' positions (a row's tail is padding)
    keep.view(-1)[index.flatten()] = True
    _close(*_both(allowed, spans, keep.double()))


def test_packed_spans_attend_within_each_sequence_and_the_cp_padding_gets_its_own():
    toks, _ = _tokens(1)
    ids, pos, _ = packed_inputs(toks, 0)
    S = ids.shape[1] + 3  # as ContextParallel.forward pads to a multiple of cp
    spans = row_spans(pos, None, S)
    seg = F.pad((pos == 0).cumsum(-1), (0, 3), value=-1)  # the padding: a sequence of its own
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    mask = (causal & (seg[:, :, None] == seg[:, None, :]))[:, None]
    assert len(spans[0]) == int((pos[0] == 0).sum()) + 1
    _close(*_both(mask, spans, torch.ones(mask.shape[0], S, dtype=torch.float64)))


def test_a_wrong_span_does_not_match():
    toks, _ = _tokens(1)
    _, pos, _ = packed_inputs(toks, 0)
    seg = (pos == 0).cumsum(-1)
    mask = (torch.ones(pos.shape[1], pos.shape[1], dtype=torch.bool).tril() & (seg[:, :, None] == seg[:, None, :]))
    wrong = [[(0, row[-1][1], None, None)] for row in row_spans(pos, None, pos.shape[1])]  # sequences see each other
    dense, spans = _both(mask[:, None], wrong, torch.ones(pos.shape, dtype=torch.float64))
    assert (dense[0] - spans[0]).abs().max() > 1e-2
