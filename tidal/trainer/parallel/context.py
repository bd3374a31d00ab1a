"""Context parallelism (Ulysses): one micro-batch's sequence positions split over the cp ranks.

Each cp rank runs the model on a contiguous slice of every row's positions (the rows padded to
a multiple of cp), so its activations are 1/cp of the micro-batch's. Everything in a decoder
layer is per position except attention; there the ranks exchange, by one all-to-all, their
slice of every head for every position of a group of heads (DeepSpeed-Ulysses: [B, H, S/cp, D]
-> [B, H/cp, S, D]), attend over the whole sequence under the whole mask, and exchange back.
Key-value heads are repeated to the query heads first, so a model with fewer kv heads than cp
still splits (its query heads per tp rank must divide by cp). Positions keep their global
values (RoPE is right as it is), and the mask is built here for the whole row: causal and
padding for the padded layout, one block per sequence for `train.packing`, the 4-D mask of
`train.share_prompts` as it is.

The output head runs on each rank's own kept positions; their log-probs and entropy are
made whole by one all-reduce of disjoint parts (`_Gather`), so every cp rank computes the same
loss on the whole micro-batch, with unchanged denominators, and the backward pass sends each
rank the gradient of its own positions. Parameter gradients are partial per cp rank and FSDP
sums them (its shard dimension is dp_shard x cp: tidal/trainer/parallel/mesh.py).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

NAME = "tidal_ulysses"
# The whole-row mask and group of the last forward. A module-level holder, not thread-local: on a
# GPU the backward pass (and its checkpointed recomputation) runs in autograd's device thread.
_active = types.SimpleNamespace(cp=1, group=None, mask=None)


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
    built for the local slice is not used: the whole row's is (`_active.mask`)."""
    cp, group, mask = _active.cp, _active.group, _active.mask
    if mask is None or mask.shape[-1] != query.shape[2] * cp:
        raise RuntimeError("context-parallel attention outside ContextParallel.forward, or with another "
                           "micro-batch's mask (a forward ran between this one and its backward)")
    if key.shape[1] != query.shape[1]:  # repeat kv heads to the query heads (GQA), before splitting heads
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    if query.shape[1] % cp:
        raise ValueError(f"train.parallel.cp={cp} does not divide the {query.shape[1]} attention heads of a rank")
    q, k, v = (_seq_to_heads(t, cp, group) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), dropout_p=dropout, scale=scaling)
    return _heads_to_seq(out, cp, group).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, ulysses_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def whole_mask(ids: torch.Tensor, pos: torch.Tensor | None, attn: torch.Tensor | None,
               allowed: torch.Tensor | None) -> torch.Tensor:
    """[R, 1, S, S] bool (True: a query may attend a key) for the whole rows: `allowed` as given
    (shared prompts); else causal within each sequence, the sequences found where `pos` restarts
    at 0 (packing); else causal over the keys `attn` marks (padding). A padding query attends
    itself, so no softmax row is empty."""
    R, S = ids.shape
    causal = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril()
    eye = torch.eye(S, dtype=torch.bool, device=ids.device)
    if allowed is not None:
        return allowed.bool() | eye
    if pos is not None:
        seg = (pos == 0).cumsum(-1)  # [R, S]: which sequence of the row each position belongs to
        return (causal & (seg[:, :, None] == seg[:, None, :]))[:, None] | eye
    valid = attn.bool() if attn is not None else torch.ones(R, S, dtype=torch.bool, device=ids.device)
    return (causal & valid[:, None, :])[:, None] | eye


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

    def forward(self, model, ids, pos, attn, allowed, rows, run_head):
        """Run `model` on this rank's slice of the rows; `rows`: the flat indices (into [R, S]) of
        the kept positions; `run_head(model, local_rows, selected) -> [n_local, 2]` runs the
        model with its head on `local_rows` (flat indices into [R, S/cp]) for the kept positions
        `selected`. Returns the whole [len(rows), 2], the same on every cp rank."""
        R, S = ids.shape
        L = -(-S // self.cp)
        pad = L * self.cp - S
        mask = whole_mask(ids, pos, attn, allowed)
        if pos is None:
            pos = torch.arange(S, device=ids.device).expand(R, S)
        if pad:  # padding positions: attend themselves, never attended
            ids = F.pad(ids, (0, pad))
            pos = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(pad, device=pos.device)], 1)
            mask = F.pad(mask, (0, pad, 0, pad))
            idx = torch.arange(S, S + pad, device=mask.device)
            mask[:, :, idx, idx] = True
        lo = self.rank * L
        r, t = rows // S, rows % S
        mine = (t >= lo) & (t < lo + L)
        selected = mine.nonzero()[:, 0]
        local_rows = r[selected] * L + (t[selected] - lo)
        # The mask stays set after the forward: with train.activation_checkpointing the backward
        # pass runs each block's attention again (its recomputation) and must find this micro-batch's
        # mask; the trainer runs a micro-batch's backward before the next forward replaces it.
        _active.cp, _active.group, _active.mask = self.cp, self.group, mask
        part = run_head(model, ids[:, lo:lo + L], split_positions(pos, lo, L), local_rows, selected)
        whole = torch.zeros((rows.shape[0], part.shape[-1]), dtype=part.dtype, device=part.device)
        whole = whole.index_put((selected,), part)
        return _Gather.apply(whole, self.group)
