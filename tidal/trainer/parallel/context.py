"""Context parallelism (Ulysses): one micro-batch's sequence positions split over the cp ranks.

Each cp rank runs the model on a contiguous slice of every row's positions (the rows padded to
a multiple of cp), so its activations are 1/cp of the micro-batch's. Everything in a decoder
layer is per position except attention; there the ranks exchange, by one all-to-all, their
slice of every head for every position of a group of heads (DeepSpeed-Ulysses: [B, H, S/cp, D]
-> [B, H/cp, S, D]), attend over the whole sequence, and exchange back. Key-value heads are
repeated to the query heads first, so a model with fewer kv heads than cp still splits (its
query heads per tp rank must divide by cp). Positions keep their global values (RoPE is right as
it is).

Attention never takes an [S, S] mask (one per row would be 1 GiB of booleans at 32k tokens, and
the kernel converts it to 4 GiB of float32: quadratic where the rest is linear). Every layout is
causal attention over spans of a row, each one call of `scaled_dot_product_attention` with
`is_causal=True` (its fused CPU and GPU kernels hold no [S, S] tensor): the padded layout is one
span a row (right padding: a real position never sees a later pad; a pad's output is never
scored or attended); `train.packing` one span per sequence, found where the position ids restart
at 0; `train.share_prompts` the prompt, then each member's tokens with the prompt as a prefix
(the layout's spans, tidal/trainer/layout.py). A member attends [prompt; own tokens] causally,
the prompt's queries computed again and dropped: its attention costs (prompt + own)² / 2 where
the dense mask's costs prompt · own + own² / 2, memory still linear.

The output head runs on each rank's own kept positions; their log-probs and entropy are
made whole by one all-reduce of disjoint parts (`_Gather`), so every cp rank computes the same
loss on the whole micro-batch, with unchanged denominators, and the backward pass sends each
rank the gradient of its own positions. Parameter gradients are partial per cp rank and FSDP
sums them (its shard dimension is dp_shard x cp: tidal/trainer/parallel/mesh.py).
"""

from __future__ import annotations

import itertools
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

NAME = "tidal_ulysses"
# The group, whole-row length and spans of the last forward. A module-level holder, not
# thread-local: on a GPU the backward pass (and its checkpointed recomputation) runs in autograd's
# device thread.
_active = types.SimpleNamespace(cp=1, group=None, length=None, spans=None)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over equal splits of dim 0; its own inverse, hence its backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous (empty_like keeps a permutation's strides)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class _Gather(torch.autograd.Function):
    """Sum of disjoint parts over the group (a gather); backward: each rank keeps its own
    entries' gradient, which every rank computed alike from the same loss."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[B, H, L, D] (this rank's positions, all heads) -> [B, H/cp, cp*L, D] (all positions, its heads)."""
    B, H, L, D = x.shape
    x = x.reshape(B, cp, H // cp, L, D).permute(1, 2, 0, 3, 4)  # [cp (head group), H/cp, B, L, D]
    x = _AllToAll.apply(x, group)  # dim 0 now: the rank whose positions these are
    return x.permute(2, 1, 0, 3, 4).reshape(B, H // cp, cp * L, D)


def _heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse of `_seq_to_heads`."""
    B, Hc, S, D = x.shape
    L = S // cp
    x = x.reshape(B, Hc, cp, L, D).permute(2, 1, 0, 3, 4)  # [cp (position slice), H/cp, B, L, D]
    x = _AllToAll.apply(x, group)  # dim 0 now: the head group
    return x.permute(2, 0, 1, 3, 4).reshape(B, cp * Hc, L, D)


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: query [B, H, L, D], key/value [B, KV, L, D] of this
    rank's positions; returns [B, L, H, D] as transformers' sdpa does. The mask transformers
    built for the local slice is not used: the whole rows' spans are (`_active.spans`)."""
    cp, group = _active.cp, _active.group
    if _active.length != query.shape[2] * cp:
        raise RuntimeError("context-parallel attention outside ContextParallel.forward, or with another "
                           "micro-batch's spans (a forward ran between this one and its backward)")
    if key.shape[1] != query.shape[1]:  # repeat kv heads to the query heads (GQA), before splitting heads
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    if query.shape[1] % cp:
        raise ValueError(f"train.parallel.cp={cp} does not divide the {query.shape[1]} attention heads of a rank")
    q, k, v = (_seq_to_heads(t, cp, group) for t in (query, key, value))
    out = causal_spans(q, k, v, _active.spans, dropout, scaling)
    return _heads_to_seq(out, cp, group).transpose(1, 2).contiguous(), None


def causal_spans(q, k, v, spans: list[list[tuple]] | None, dropout: float = 0.0, scale=None) -> torch.Tensor:
    """Attention of q, k, v [B, H, S, D] where each row is cut into `spans` (per row, in order,
    covering it: (start, end, prefix_start, prefix_end)): [start, end) attends causally to itself
    and to all of the prefix [prefix_start, prefix_end) if one is given (another span of the row,
    the prompt). None: every row one causal span (the whole batch in one call).

    The rows and spans are cut by `split`, whose backward is one concatenation: a slice's
    backward would make a zero gradient of the whole input per span."""
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
    if spans is None:
        return sdpa(q, k, v)
    rows = []
    for b, (qb, kb, vb) in enumerate(zip(*(t.split(1, 0) for t in (q, k, v)))):
        cuts = [(start, end) for start, end, *_ in spans[b] if end > start]
        at = {c: i for i, c in enumerate(cuts)}
        qs, ks, vs = (t.split([end - start for start, end in cuts], 2) for t in (qb, kb, vb))
        parts = []
        for start, end, p0, p1 in spans[b]:
            if end <= start:
                continue
            i = at[start, end]
            if p0 is None:
                parts.append(sdpa(qs[i], ks[i], vs[i]))
                continue
            j = at.get((p0, p1))
            pre = [t[j] for t in (qs, ks, vs)] if j is not None else [t[:, :, p0:p1] for t in (qb, kb, vb)]
            # the prefix's queries first, so that is_causal (aligned at the top left) lets every own
            # query see the whole prefix; their outputs are dropped
            qq, kk, vv = (torch.cat([a, t[i]], 2) for a, t in zip(pre, (qs, ks, vs)))
            parts.append(sdpa(qq, kk, vv)[:, :, p1 - p0:])
        rows.append(torch.cat(parts, 2))
    return torch.cat(rows, 0)


def _register() -> None:
    """The attention function only: with no mask function of its name, transformers builds no
    mask for the local slice (it would be [L, L] per row, unused)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, ulysses_attention)


def row_spans(pos: torch.Tensor | None, spans: list[list[tuple]] | None, length: int) -> list[list[tuple]] | None:
    """The spans (`causal_spans`) of rows padded to `length` positions: `spans` as given (shared
    prompts) or one per sequence, found where `pos` restarts at 0 (packing), else None (one
    causal span a row); the cp padding past the rows is a span of its own."""
    if spans is None and pos is not None:
        spans = []
        for p in pos.tolist():
            starts = [t for t, x in enumerate(p) if x == 0] + [len(p)]
            spans.append([(a, b, None, None) for a, b in itertools.pairwise(starts) if b > a])
    if spans is not None and spans and spans[0][-1][1] < length:
        spans = [row + [(row[-1][1], length, None, None)] for row in spans]
    return spans


def split_positions(pos: torch.Tensor, lo: int, length: int) -> torch.Tensor:
    """This rank's position ids: its slice of the whole row's, so RoPE sees global positions
    (looked up when called: a test swaps in a wrong split to show the golden runs catch it)."""
    return pos[:, lo:lo + length]


class ContextParallel:
    """The cp group of a trainer's mesh and what a forward under it needs."""

    def __init__(self, cp_mesh):
        self.group, self.cp, self.rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
        _register()

    def prepare(self, model) -> None:
        """Route `model`'s attention through Ulysses (every layer reads the config's choice)."""
        model.config._attn_implementation = NAME
        for sub in model.modules():
            cfg = getattr(sub, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = NAME

    def forward(self, model, ids, pos, spans, rows, run_head):
        """Run `model` on this rank's slice of the rows; `pos`: the position ids (None: 0..S-1 a
        row); `spans`: the rows' attention spans under `train.share_prompts` (`causal_spans`),
        else None (causal within each sequence of `pos`); `rows`: the flat indices (into [R, S])
        of the kept positions; `run_head(model, local_rows, selected) -> [n_local, 2]` runs the
        model with its head on `local_rows` (flat indices into [R, S/cp]) for the kept positions
        `selected`. Returns the whole [len(rows), 2], the same on every cp rank."""
        R, S = ids.shape
        L = -(-S // self.cp)
        pad = L * self.cp - S
        spans = row_spans(pos, spans, L * self.cp)
        if pos is None:
            pos = torch.arange(S, device=ids.device).expand(R, S)
        if pad:  # padding positions: attend (causally) among themselves, never attended
            ids = F.pad(ids, (0, pad))
            pos = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(pad, device=pos.device)], 1)
        lo = self.rank * L
        r, t = rows // S, rows % S
        mine = (t >= lo) & (t < lo + L)
        selected = mine.nonzero()[:, 0]
        local_rows = r[selected] * L + (t[selected] - lo)
        # The spans stay set after the forward: with train.activation_checkpointing the backward
        # pass runs each block's attention again (its recomputation) and must find this micro-batch's
        # spans; the trainer runs a micro-batch's backward before the next forward replaces them.
        _active.cp, _active.group, _active.length, _active.spans = self.cp, self.group, L * self.cp, spans
        part = run_head(model, ids[:, lo:lo + L], split_positions(pos, lo, L), local_rows, selected)
        whole = torch.zeros((rows.shape[0], part.shape[-1]), dtype=part.dtype, device=part.device)
        whole = whole.index_put((selected,), part)
        return _Gather.apply(whole, self.group)
