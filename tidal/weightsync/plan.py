"""The transfer plan of shard-to-shard weight sync: which bytes go from which trainer rank to
which engine rank, computed once when the sync group forms.

Inputs are two layouts over the same Hugging Face parameter names:
- the trainer's: for every parameter, the box (a `[start, stop)` range per dimension) of the
  global tensor each trainer rank holds, read from its DTensor's placements on the mesh
  (`local_box`, the same function torch.distributed.checkpoint uses, strided FSDP2+TP shards
  included) and exchanged once (`gather_layout`). Replicas (HSDP, a parameter tensor
  parallelism leaves whole) hold the same box;
- the engines': for every engine rank, the box of each parameter it holds (`full_slices` for an
  engine that holds whole tensors: the torch engine, vLLM at TP 1; `boxes_from_slices` for a
  tensor-parallel engine's `engine_slices`).

`build_plan` intersects them: every engine rank's box of a parameter is cut by the trainer
boxes it overlaps, each piece is sent by one owner (among replicas, the one that has sent the
fewest bytes so far), and a piece larger than a bucket is split along its first dimension.
Each engine rank's pieces are grouped, in parameter order, into buckets of at most
`bucket_bytes`; a bucket's pieces from one trainer rank travel as one message. So a trainer
rank never stages more than one bucket (`TransferPlan.peak_staging_bytes`), no process
gathers the model, and each engine rank receives exactly the bytes of its slices.

Pure and deterministic: every process that builds the plan from the same inputs gets the same
plan, and it travels as JSON (no pickle) to the engines.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tidal.weightsync.base import WeightSyncError, dtype_name, torch_dtype

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension of the global tensor


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of one tensor, or None when they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(s < e for s, e in out) else None


def relative(box: Box, within: Box) -> tuple[slice, ...]:
    """The slices that select `box` from a tensor holding `within` (box ⊆ within)."""
    return tuple(slice(s - w0, e - w0) for (s, e), (w0, _) in zip(box, within))


@dataclass(frozen=True)
class ParamLayout:
    """One parameter on the trainer: global shape, dtype and the box each rank holds."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    owners: tuple[tuple[int, Box], ...]  # (trainer rank, box), one per rank that holds a non-empty part

    @property
    def itemsize(self) -> int:
        return torch_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Piece:
    """One box of one parameter, sent by trainer rank `src` to engine rank `dst`."""

    name: str
    src: int
    dst: int
    box: Box
    nbytes: int


@dataclass(frozen=True)
class Message:
    """The pieces of one bucket from one trainer rank to one engine rank, packed back to back."""

    src: int
    dst: int
    bucket: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass
class TransferPlan:
    params: dict[str, ParamLayout]  # by name, in the trainer's order
    engine_boxes: list[dict[str, Box]]  # per engine rank: the box of each parameter it holds
    messages: list[Message]  # in send order: bucket by bucket, then engine rank, then trainer rank
    bucket_bytes: int
    trainer_ranks: int

    @property
    def engine_ranks(self) -> int:
        return len(self.engine_boxes)

    def bytes_to(self, dst: int) -> int:
        return sum(m.nbytes for m in self.messages if m.dst == dst)

    def bytes_from(self, src: int) -> int:
        return sum(m.nbytes for m in self.messages if m.src == src)

    def buckets_of(self, dst: int) -> int:
        return len({m.bucket for m in self.messages if m.dst == dst})

    def peak_staging_bytes(self, src: int) -> int:
        """The most bytes trainer rank `src` holds beyond its own shards during a sync: its largest
        message (one staging buffer, reused message after message)."""
        return max((m.nbytes for m in self.messages if m.src == src), default=0)

    def model_bytes(self) -> int:
        return sum(math.prod(p.shape) * p.itemsize for p in self.params.values())

    def summary(self) -> str:
        """A few lines for the run's log: bytes per engine rank, buckets, senders."""
        mb = 1e6
        head = (f"weight-sync plan: {len(self.params)} tensors, {self.model_bytes() / mb:.1f} MB; "
                f"{self.trainer_ranks} trainer rank(s) -> {self.engine_ranks} engine rank(s), "
                f"buckets of <= {self.bucket_bytes / mb:.0f} MB")
        lines = [head]
        for d in range(self.engine_ranks):
            senders = sorted({m.src for m in self.messages if m.dst == d})
            lines.append(f"  engine rank {d}: {self.bytes_to(d) / mb:.1f} MB in {self.buckets_of(d)} bucket(s) "
                         f"from trainer rank(s) {senders}")
        for s in range(self.trainer_ranks):
            lines.append(f"  trainer rank {s}: sends {self.bytes_from(s) / mb:.1f} MB, "
                         f"stages <= {self.peak_staging_bytes(s) / mb:.1f} MB")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({
            "bucket_bytes": self.bucket_bytes, "trainer_ranks": self.trainer_ranks,
            "params": [[p.name, list(p.shape), p.dtype, [[r, [list(x) for x in b]] for r, b in p.owners]]
                       for p in self.params.values()],
            "engine_boxes": [{n: [list(x) for x in b] for n, b in e.items()} for e in self.engine_boxes],
            "messages": [[m.src, m.dst, m.bucket, [[p.name, [list(x) for x in p.box], p.nbytes] for p in m.pieces]]
                         for m in self.messages],
        })

    @classmethod
    def from_json(cls, text: str) -> TransferPlan:
        d = json.loads(text)
        box = lambda b: tuple((int(s), int(e)) for s, e in b)
        params = {n: ParamLayout(n, tuple(s), dt, tuple((int(r), box(b)) for r, b in own))
                  for n, s, dt, own in d["params"]}
        messages = [Message(s, t, k, tuple(Piece(n, s, t, box(b), int(nb)) for n, b, nb in ps))
                    for s, t, k, ps in d["messages"]]
        return cls(params, [{n: box(b) for n, b in e.items()} for e in d["engine_boxes"]], messages,
                   int(d["bucket_bytes"]), int(d["trainer_ranks"]))


def full_slices(params: Mapping[str, ParamLayout], engine_ranks: int) -> list[dict[str, Box]]:
    """Engine slices of engines that hold whole tensors: every rank every parameter, whole."""
    return [{n: full_box(p.shape) for n, p in params.items()} for _ in range(engine_ranks)]


def boxes_from_slices(slices: Sequence[Mapping[str, object]], shapes: Mapping[str, Sequence[int]]
                      ) -> list[dict[str, Box]]:
    """Engine boxes from a tensor-parallel engine's slices (tidal/weightsync/slices.py's
    `engine_slices`: per rank `{name: Slice(dim, start, stop) | None}`, None = whole): the slice's
    range on its dimension, the other dimensions whole. A rank whose slice of a tensor is empty
    (the last ranks of a padded vocabulary) gets no box for it."""
    out = []
    for rank in slices:
        boxes = {}
        for name, sl in rank.items():
            box = list(full_box(shapes[name]))
            if sl is not None:
                box[sl.dim] = (sl.start, sl.stop)
            if box_numel(tuple(box)) > 0:
                boxes[name] = tuple(box)
        out.append(boxes)
    return out


def tp_engine_boxes(hf_config: Mapping, shapes: Mapping[str, Sequence[int]], tp_size: int, replicas: int = 1
                    ) -> list[dict[str, Box]]:
    """The engine boxes of `replicas` tensor-parallel replicas of `tp_size` ranks (group order:
    replica by replica, TP rank by TP rank) over the trainer's parameters `shapes`: each rank's
    `engine_slices` as boxes. A tied `lm_head.weight` is not among them (the trainer has none):
    a vLLM rank loads it from its slice of the embedding (the same vocabulary rows)."""
    from tidal.weightsync.slices import engine_slices

    per_rank = boxes_from_slices(engine_slices(hf_config, shapes, tp_size), shapes)
    return [dict(b) for _ in range(replicas) for b in per_rank]


def box_slice(box: Box, shape: Sequence[int]):
    """The `Slice` (tidal/weightsync/slices.py) a box is, or None for the whole tensor; a box cut
    on more than one dimension is not a tensor-parallel slice (ValueError)."""
    from tidal.weightsync.slices import Slice

    cut = [d for d, ((s, e), n) in enumerate(zip(box, shape)) if (s, e) != (0, int(n))]
    if not cut:
        return None
    if len(cut) > 1:
        raise ValueError(f"box {box} of a tensor {list(shape)} is cut on dimensions {cut}: not one slice")
    return Slice(cut[0], *box[cut[0]])


def _split_rows(box: Box, itemsize: int, limit: int) -> list[Box]:
    """`box` cut along its first dimension into boxes of at most `limit` bytes (a single row
    larger than `limit` stays whole)."""
    if not box:
        return [box]
    row = box_numel(box[1:]) * itemsize if len(box) > 1 else itemsize
    per = max(1, limit // max(row, 1))
    (s, e), rest = box[0], box[1:]
    return [((a, min(a + per, e)), *rest) for a in range(s, e, per)]


def _check_cover(p: ParamLayout) -> dict[Box, list[int]]:
    """The distinct boxes of `p` with their owners; raises unless they tile the tensor exactly."""
    groups: dict[Box, list[int]] = {}
    for rank, b in p.owners:
        groups.setdefault(b, []).append(rank)
    boxes = list(groups)
    overlap = any(intersect(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    if overlap or sum(box_numel(b) for b in boxes) != math.prod(p.shape):
        raise WeightSyncError(f"weight-sync plan: the trainer ranks' shards of {p.name} {list(p.shape)} do not tile "
                              f"it exactly (boxes {boxes}): cannot say who sends which bytes")
    return groups


def build_plan(params: Mapping[str, ParamLayout], engine_boxes: Sequence[Mapping[str, Box]], bucket_bytes: int,
               trainer_ranks: int) -> TransferPlan:
    """The transfer plan (module docstring). `params` in the trainer's order; every engine rank
    names a box for each parameter it holds (a name outside `params` is an error)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    owners = {n: _check_cover(p) for n, p in params.items()}
    sent = [0] * trainer_ranks  # bytes each trainer rank has been given so far: spreads replicas' work
    messages: list[Message] = []
    per_dst: list[list[list[Piece]]] = []
    for dst, boxes in enumerate(engine_boxes):
        unknown = sorted(set(boxes) - set(params))
        if unknown:
            raise WeightSyncError(f"weight-sync plan: engine rank {dst} expects {unknown[:5]}, which the trainer "
                                  "does not have")
        buckets: list[list[Piece]] = [[]]
        filled = 0
        for name, p in params.items():
            want = boxes.get(name)
            if want is None:
                continue
            for have, ranks in owners[name].items():
                part = intersect(want, have)
                if part is None:
                    continue
                src = min(ranks, key=lambda r: (sent[r], r))
                for piece_box in _split_rows(part, p.itemsize, bucket_bytes):
                    nbytes = box_numel(piece_box) * p.itemsize
                    if buckets[-1] and filled + nbytes > bucket_bytes:
                        buckets.append([])
                        filled = 0
                    buckets[-1].append(Piece(name, src, dst, piece_box, nbytes))
                    filled += nbytes
                    sent[src] += nbytes
        per_dst.append([b for b in buckets if b])
    for k in range(max((len(b) for b in per_dst), default=0)):
        for dst, buckets in enumerate(per_dst):
            if k < len(buckets):
                for src in sorted({q.src for q in buckets[k]}):
                    messages.append(Message(src, dst, k, tuple(q for q in buckets[k] if q.src == src)))
    return TransferPlan(dict(params), [dict(b) for b in engine_boxes], messages, bucket_bytes, trainer_ranks)


# -- the trainer's side: its boxes, read from the DTensors -----------------------------------
def local_box(t: torch.Tensor) -> Box:
    """The box of the global tensor this rank holds: from a DTensor's mesh and placements
    (torch's own computation, the one torch.distributed.checkpoint writes offsets with), or the
    whole tensor for a plain one (replicated)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return full_box(t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(t.to_local().shape):
        raise WeightSyncError(f"weight-sync plan: a DTensor's local shard is {tuple(t.to_local().shape)}, its "
                              f"placements {t.placements} say {tuple(shape)}")
    return tuple((o, o + n) for o, n in zip(offset, shape))


def local_layout(named: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], str, Box]]:
    """This rank's (name, global shape, dtype, box) of every parameter, in order."""
    return [(n, tuple(t.shape), dtype_name(t.dtype), local_box(t)) for n, t in named.items()]


def merge_layouts(per_rank: Sequence[Sequence[tuple[str, tuple[int, ...], str, Box]]]) -> dict[str, ParamLayout]:
    """The trainer's layout from every rank's `local_layout` (rank i at index i)."""
    first = per_rank[0]
    for r, lay in enumerate(per_rank):
        if [(n, tuple(s), d) for n, s, d, _ in lay] != [(n, tuple(s), d) for n, s, d, _ in first]:
            raise WeightSyncError(f"weight-sync plan: trainer rank {r} lists other parameters (names, shapes or "
                                  "dtypes) than rank 0")
    out = {}
    for i, (name, shape, dtype, _) in enumerate(first):
        owners = tuple((r, tuple(tuple(x) for x in lay[i][3])) for r, lay in enumerate(per_rank)
                       if box_numel(tuple(tuple(x) for x in lay[i][3])) > 0)
        out[name] = ParamLayout(name, tuple(shape), dtype, owners)
    return out


def gather_layout(named: Mapping[str, torch.Tensor], group=None) -> dict[str, ParamLayout]:
    """Every trainer rank's boxes (a collective over the trainer group, once per plan; a few
    bytes per parameter): the trainer's layout, the same on every rank."""
    import torch.distributed as dist

    mine = local_layout(named)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return merge_layouts([mine])
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return merge_layouts(every)


def local_piece(t: torch.Tensor, own: Box, piece: Box) -> torch.Tensor:
    """The view of `piece` (global coordinates) in this rank's shard `t` of box `own`."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach()[relative(piece, own)]
