"""How the trainer lays a micro-batch's sequences out as tensors: split by a token budget, padded or packed.

Sequences are split into micro-batches under a token budget (`micro_batches`), then either
right-padded to the longest (`pad_rows`) or, with `train.packing`, packed first-fit into rows as
long as the longest (`pack_rows`, `packed_inputs`), with each sequence's positions restarting at
0 so that attention stays within it. Only the positions that are scored reach the output head
(`keep_rows`), and their values are laid back out in the padded layout (`at_mask`).
"""

from __future__ import annotations

import torch


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Split sequence indices into micro-batches whose padded size (rows × longest) stays
    within `token_budget`. Sorting by length keeps padding low; the split never changes the
    loss (tidal/trainer/trainer.py's docstring)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if lengths[i] > token_budget:
            raise ValueError(f"a sequence of {lengths[i]} tokens exceeds train.micro_batch_tokens={token_budget}")
        if cur and (len(cur) + 1) * lengths[i] > token_budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence indices per row, first-fit decreasing: each row's lengths sum to at most
    `capacity` (at least the longest length)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, f in enumerate(free) if f >= lengths[i]), None)
        if r is None:
            rows.append([])
            free.append(capacity)
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def packed_order(lengths: list[int]) -> list[int]:
    """Sequence indices in the order `packed_inputs` lays them out (row by row, left to right):
    the order in which a vision-language model's image pads, and so its images, appear."""
    return [i for members in pack_rows(lengths, max(lengths)) for i in members]


def packed_inputs(tokens: list[list[int]], pad_token_id: int, device="cpu", rope: list[torch.Tensor] | None = None):
    """The sequences packed into rows as long as the longest (`pack_rows`): input ids and
    position ids [rows, longest], each sequence at positions 0..n-1 (a row's unused tail is a
    sequence of padding of its own), and for every sequence the flat index of each of its
    positions but the last, padded with 0 to [len(tokens), longest - 1] (the padded layout of
    `logits[:, :-1]`).

    `rope`: each sequence's mRoPE positions [3, n] (a vision-language model); the position ids
    are then [4, rows, longest]: the text positions above first (Qwen2-VL derives the packed
    mask from them), then the sequences' own three components (a row's tail: its text positions)."""
    capacity = max(len(t) for t in tokens)
    rows = pack_rows([len(t) for t in tokens], capacity)
    ids = torch.full((len(rows), capacity), pad_token_id, dtype=torch.long)
    pos = torch.zeros((len(rows), capacity), dtype=torch.long)
    mrope = None if rope is None else torch.zeros((3, len(rows), capacity), dtype=torch.long)
    index = torch.zeros((len(tokens), capacity - 1), dtype=torch.long)
    for r, members in enumerate(rows):
        offset = 0
        for i in members:
            n = len(tokens[i])
            ids[r, offset:offset + n] = torch.tensor(tokens[i], dtype=torch.long)
            pos[r, offset:offset + n] = torch.arange(n)
            if mrope is not None:
                mrope[:, r, offset:offset + n] = rope[i]
            index[i, :n - 1] = r * capacity + offset + torch.arange(n - 1)
            offset += n
        pos[r, offset:] = torch.arange(capacity - offset)
        if mrope is not None:
            mrope[:, r, offset:] = pos[r, offset:]
    if mrope is not None:
        pos = torch.cat([pos[None], mrope])
    return ids.to(device), pos.to(device), index.to(device)


def at_mask(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` ([N], one per True entry of `mask`, in row-major order) laid out as `mask`'s
    shape, 0 elsewhere; differentiable in `values`."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def pad_rows(rows: list[list], value, dtype, device="cpu") -> torch.Tensor:
    """Right-pad ragged rows into one [len(rows), longest] tensor."""
    L = max(len(r) for r in rows)
    out = torch.full((len(rows), L), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out.to(device)


class keep_rows:
    """While active, `model`'s output head sees only the hidden states at `rows` (flat indices
    into [batch × positions]): a forward pre-hook on `get_output_embeddings()`, so the model's
    own forward (and FSDP's hooks around it) run unchanged and its logits come out [N, V].
    `rows=None`: nothing changes."""

    def __init__(self, model, rows: torch.Tensor | None):
        self.head, self.rows, self.handle = model.get_output_embeddings(), rows, None

    def __enter__(self):
        if self.rows is not None:
            rows = self.rows
            self.handle = self.head.register_forward_pre_hook(lambda _m, args: (args[0].flatten(0, 1)[rows],))
        return self

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.remove()
