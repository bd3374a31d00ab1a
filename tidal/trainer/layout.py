"""How the trainer lays a micro-batch's sequences out as tensors: split by a token budget, padded or packed.

Sequences are split into micro-batches under a token budget (`micro_batches`), then either
right-padded to the longest (`pad_rows`) or, with `train.packing`, packed first-fit into rows as
long as the longest (`pack_rows`, `packed_inputs`), with each sequence's positions restarting at
0 so that attention stays within it. Only the positions that are scored reach the output head
(`keep_rows`), and their values are laid back out in the padded layout (`at_mask`).

With `train.share_prompts`, sequences that open with the same prompt (a GRPO group's samples)
are laid out as one unit: the prompt once, then each sequence's own tokens after it
(`shared_units`, `shared_inputs`); a group longer than a row should be is split into units
that each hold the prompt. A 4-D mask lets each sequence's tokens see the prompt and
their own earlier tokens, never a sibling's; their positions continue from the prompt's. Each
sequence's targets index the shared prompt's positions, so the gather that lays them out sends
every sibling's gradient to the one prompt: the sum of what each copy would have received.
"""

from __future__ import annotations

import numpy as np
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
    ids = np.full((len(rows), capacity), pad_token_id, dtype=np.int64)  # numpy: see shared_inputs
    pos = np.zeros((len(rows), capacity), dtype=np.int64)
    mrope = None if rope is None else np.zeros((3, len(rows), capacity), dtype=np.int64)
    index = np.zeros((len(tokens), capacity - 1), dtype=np.int64)
    for r, members in enumerate(rows):
        offset = 0
        for i in members:
            n = len(tokens[i])
            ids[r, offset:offset + n] = tokens[i]
            pos[r, offset:offset + n] = np.arange(n)
            if mrope is not None:
                mrope[:, r, offset:offset + n] = rope[i].cpu().numpy()
            index[i, :n - 1] = r * capacity + offset + np.arange(n - 1)
            offset += n
        pos[r, offset:] = np.arange(capacity - offset)
        if mrope is not None:
            mrope[:, r, offset:] = pos[r, offset:]
    ids, pos, index = torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(index)
    if mrope is not None:
        pos = torch.cat([pos[None], torch.from_numpy(mrope)])
    return ids.to(device), pos.to(device), index.to(device)


def shared_units(tokens: list[list[int]], prompts: list[int], max_len: int | None = None) -> list[tuple[int, list[int]]]:
    """Sequences grouped by their prompt: (shared length p, member indices) per unit, in order of
    first appearance. `prompts[i]`: how many of sequence i's leading tokens are its prompt (the
    tokens before its first policy token). Members share min(p_i, len_i - 1) tokens, so every
    member keeps at least one token of its own; a lone sequence is a unit of one. `max_len`: a
    group whose laid-out length (the prompt once, then each member's own tokens) would pass it is
    split into units that stay within it, each with its prompt (a member alone may pass it)."""
    groups: dict[tuple[int, ...], tuple[int, list[int]]] = {}
    for i, (t, p) in enumerate(zip(tokens, prompts)):
        p = max(0, min(p, len(t) - 1))
        groups.setdefault(tuple(t[:p]), (p, []))[1].append(i)
    if max_len is None:
        return list(groups.values())
    units = []
    for p, members in groups.values():
        cur, size = [], p
        for i in members:
            own = len(tokens[i]) - p
            if cur and size + own > max_len:
                units.append((p, cur))
                cur, size = [], p
            cur.append(i)
            size += own
        units.append((p, cur))
    return units


def shared_micro_batches(tokens: list[list[int]], prompts: list[int], token_budget: int,
                         max_len: int | None = None) -> list[list[int]]:
    """`micro_batches` for `shared_inputs`: whole units (`shared_units`, groups split to
    min(`max_len`, `token_budget`)) per micro-batch, their laid-out lengths (the prompt once, each
    member's own tokens) summing to at most `token_budget`."""
    for t in tokens:
        if len(t) > token_budget:
            raise ValueError(f"a sequence of {len(t)} tokens exceeds train.micro_batch_tokens={token_budget}")
    cap = token_budget if max_len is None else min(max_len, token_budget)
    pieces = [(p + sum(len(tokens[i]) - p for i in members), members)
              for p, members in shared_units(tokens, prompts, cap)]
    out: list[list[int]] = []
    load = 0
    for size, members in sorted(pieces, key=lambda x: x[0]):
        if out and load + size <= token_budget:
            out[-1].extend(members)
            load += size
        else:
            out.append(list(members))
            load = size
    return out


def shared_inputs(tokens: list[list[int]], prompts: list[int], pad_token_id: int, device="cpu",
                  max_len: int | None = None, spans: bool = False):
    """The sequences laid out by unit (`shared_units`, groups split to `max_len`), units packed
    first-fit into rows as long as the longest unit: input ids and position ids [rows, S], the
    attention mask [rows, 1, S, S] (bool, True where a query may attend a key), and for every
    sequence the flat index of each of its positions but the last, padded with 0 to
    [len(tokens), longest - 1] (the padded layout of `logits[:, :-1]`), as `packed_inputs`.

    A unit is its prompt (positions 0..p-1, causal), then each member's own tokens (positions p..,
    attending to the whole prompt and causally to themselves). A row's unused tail attends to
    itself alone, so its rows of the softmax stay finite.

    `spans=True`: instead of the [rows, S, S] mask (quadratic in S), each row's spans, in order
    and covering the row: (start, end, prefix_start, prefix_end), the positions [start, end)
    attending causally to themselves and to the whole prefix (none: prefix_start is None); the
    tail is one span of its own (tidal/trainer/parallel/context.py attends span by span)."""
    units = shared_units(tokens, prompts, max_len)
    sizes = [p + sum(len(tokens[i]) - p for i in members) for p, members in units]
    capacity = max(sizes)
    rows = pack_rows(sizes, capacity)
    # Built in numpy, a row slice per sequence: a batch's hundreds of small writes cost
    # microseconds each here, where each would be a torch op of its own.
    ids = np.full((len(rows), capacity), pad_token_id, dtype=np.int64)
    pos = np.zeros((len(rows), capacity), dtype=np.int64)
    allowed = None if spans else np.zeros((len(rows), capacity, capacity), dtype=np.bool_)
    row_spans: list[list[tuple]] = [[] for _ in rows]
    index = np.zeros((len(tokens), max(len(t) for t in tokens) - 1), dtype=np.int64)
    causal = None if spans else np.tri(capacity, dtype=np.bool_)
    for r, placed in enumerate(rows):
        offset = 0
        for u in placed:
            p, members = units[u]
            prompt = slice(offset, offset + p)
            ids[r, prompt] = tokens[members[0]][:p]
            pos[r, prompt] = np.arange(p)
            row_spans[r].append((offset, offset + p, None, None))
            if not spans:
                allowed[r, prompt, prompt] = causal[:p, :p]
            at = offset + p
            for i in members:
                n = len(tokens[i]) - p
                own = slice(at, at + n)
                ids[r, own] = tokens[i][p:]
                pos[r, own] = np.arange(p, p + n)
                row_spans[r].append((at, at + n, offset, offset + p))
                if not spans:
                    allowed[r, own, prompt] = True
                    allowed[r, own, own] = causal[:n, :n]
                base = r * capacity
                index[i, :p] = base + np.arange(offset, offset + p)
                index[i, p:p + n - 1] = base + np.arange(at, at + n - 1)
                at += n
            offset = at
        if offset < capacity:
            row_spans[r].append((offset, capacity, None, None))
            if not spans:
                tail = np.arange(offset, capacity)
                allowed[r, tail, tail] = True
    ids, pos, index = (torch.from_numpy(a).to(device) for a in (ids, pos, index))
    return ids, pos, row_spans if spans else torch.from_numpy(allowed)[:, None].to(device), index


def at_mask(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` ([N], one per True entry of `mask`, in row-major order) laid out as `mask`'s
    shape, 0 elsewhere; differentiable in `values`."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def padded(tokens: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids right-padded to the longest sequence ([B, longest]), and their attention mask (1 on tokens)."""
    ids = pad_rows(tokens, pad_token_id, torch.long, device)
    attn = pad_rows([[1] * len(t) for t in tokens], 0, torch.long, device)
    return ids, attn


def pad_rows(rows: list[list], value, dtype, device="cpu") -> torch.Tensor:
    """Right-pad ragged rows into one [len(rows), longest] tensor."""
    L = max(len(r) for r in rows)
    np_dtype = _NUMPY.get(dtype)
    if np_dtype is None:
        out = torch.full((len(rows), L), value, dtype=dtype)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
        return out.to(device)
    arr = np.full((len(rows), L), value, dtype=np_dtype)  # one numpy write per row: no torch op each
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    return torch.from_numpy(arr).to(device)


_NUMPY = {torch.long: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


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
