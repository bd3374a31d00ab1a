"""Weight sync, as bytes and seconds: how much one sync moves and how long it takes over the cluster's
links, per transport. One small module on purpose: shard-to-shard and delta sync (weightsync-scale) add
or refine a transport here, and the simulator and the planner pick it up by name.

Transports (every time is one sync; `engine pause` is what the engines stop generating for it):
- broadcast: tidal's today (`tidal/weightsync/broadcast.py`): the trainer ranks gather the full weights,
  rank 0 broadcasts them to every engine GPU. A pipelined broadcast runs at the rate of its slowest
  link, whatever the number of receivers; the trainer-side gather is an all-gather.
- slices: `placement.weight_sync=slices` (`tidal/weightsync/sliced.py`, auto for tensor-parallel engines):
  gathered like broadcast, then trainer rank 0 sends each engine rank only its 1/g slices, point to
  point: every engine GPU receives 1/g of the bytes, rank 0 sends the whole model to every replica.
- shard: each trainer GPU sends only the slices an engine GPU needs; every engine GPU receives its
  1/g of the bytes, and replicas relay to each other (a pipelined chain, as checkpoint-engine does).
- delta: the shard path carrying `placement.delta_fraction` of its bytes (the compressed XOR).
The bytes of broadcast, shard and delta follow the transfer plan's rules (`expected_bytes`: what
`tidal.weightsync.plan.build_plan` gives for evenly sharded weights; tests/test_weightsync_shard.py
checks the two agree). Written out here rather than imported so that `tidal plan` needs no torch.
- disk: written once to shared storage, read by every node.
- inprocess: colocated; each GPU gathers its engine's slice from the trainer shards over NVLink and copies it.
Each adds `sync_overhead_s` (pausing the engines, reloading, control messages).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.plan.cost import group_bw, node_link_bw, replicas
from tidal.plan.hardware import Accelerator
from tidal.plan.spec import ClusterSpec, Efficiency, ModelSpec, PlacementSpec

TRANSPORTS = ("broadcast", "slices", "shard", "delta", "disk", "inprocess")
BUCKET_BYTES = 256e6  # placement.weight_sync_bucket_mb's default: a pipelined broadcast's unit


@dataclass(frozen=True)
class SyncBytes:
    """Bytes of one sync to ONE engine replica, by transport."""

    per_engine_rank: float  # received by each of the replica's engine ranks
    per_trainer_rank: float  # sent by each trainer rank (rank 0 alone sends for broadcast)
    gathered: float  # all-gathered into each trainer rank before anything is sent


def expected_bytes(model_bytes: float, trainer_ranks: int, engine_tp: int, transport: str,
                   delta_fraction: float = 1.0) -> SyncBytes:
    """What `tidal.weightsync.plan.build_plan` gives for evenly sharded weights, without a layout:
    `broadcast` (tidal's gather + rank-0 broadcast: every engine rank receives the whole model, each trainer rank
    all-gathers the other ranks' shares first); `shard` (each engine rank receives its 1/engine_tp,
    the trainer ranks send 1/trainer_ranks each, nothing gathered); `delta` (shard's pieces,
    `delta_fraction` of their bytes: the compressed XOR's share, BENCHMARKS.md)."""
    if transport == "broadcast":
        return SyncBytes(model_bytes, model_bytes, model_bytes * (trainer_ranks - 1) / trainer_ranks)
    if transport == "slices":  # rank 0 sends one replica's g ranks their slices: the whole model, once
        return SyncBytes(model_bytes / engine_tp, model_bytes, model_bytes * (trainer_ranks - 1) / trainer_ranks)
    if transport in ("shard", "delta"):
        f = delta_fraction if transport == "delta" else 1.0
        return SyncBytes(model_bytes / engine_tp * f, model_bytes / trainer_ranks * f, 0.0)
    raise ValueError(f"expected_bytes: unknown transport {transport!r} (broadcast, slices, shard, delta)")


def sync_bytes(m: ModelSpec, transport: str, delta_fraction: float = 0.25) -> float:
    """Bytes one sync carries from the trainer to one engine replica (before fan-out)."""
    full = m.params_b * 1e9 * m.dtype_bytes
    return expected_bytes(full, 1, 1, "delta", delta_fraction).per_engine_rank if transport == "delta" else full


@dataclass
class SyncCost:
    bytes: float
    gather_s: float  # trainer side, before anything leaves
    transfer_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return self.gather_s + self.transfer_s + self.overhead_s


def sync_cost(m: ModelSpec, hw: Accelerator, eff: Efficiency, cluster: ClusterSpec, p: PlacementSpec,
              transport: str | None = None) -> SyncCost:
    """Seconds of one sync of the placement's transport (or `transport`) to every engine replica."""
    t = transport or p.sync
    if t not in TRANSPORTS:
        raise ValueError(f"placement.sync: unknown transport `{t}` (known: {', '.join(TRANSPORTS)})")
    nbytes = sync_bytes(m, t, p.delta_fraction)
    n_train = p.trainer_gpus
    g = p.engine_gpus_per_replica
    receivers = replicas(p, cluster) * g
    # NVLink when the trainer and every engine GPU sit in one node, else the network
    cross = (hw.nvlink_bw if n_train + receivers <= cluster.gpus_per_node else node_link_bw(hw, cluster)) * eff.link
    # gather the full tensors on the trainer's side: an all-gather of the shards (broadcast, disk)
    gather = nbytes * (n_train - 1) / n_train / (group_bw(hw, cluster, n_train) * eff.link) if n_train > 1 else 0.0
    if t == "inprocess":  # each GPU gathers only its engine's slice from its node's peers, then copies it
        return SyncCost(nbytes, nbytes / g / (hw.nvlink_bw * eff.link), nbytes / g / (hw.hbm_bw * eff.hbm),
                        eff.sync_overhead_s)
    if t == "broadcast":
        # one pipelined broadcast tree to every engine GPU, fed by trainer rank 0's NIC
        fill = min(BUCKET_BYTES, nbytes) / cross * max(0, receivers.bit_length() - 1)
        return SyncCost(nbytes, gather, nbytes / cross + fill, eff.sync_overhead_s)
    if t == "slices":  # point to point from rank 0: its link carries every replica's whole model
        reps = max(1, replicas(p, cluster))
        return SyncCost(nbytes, gather, nbytes * reps / cross, eff.sync_overhead_s)
    if t == "disk":
        storage = cluster.storage_bw_gbs * 1e9
        nodes = max(1, -(-(replicas(p, cluster) * g) // cluster.gpus_per_node))
        return SyncCost(nbytes, gather, nbytes / storage + nbytes * nodes / storage, eff.sync_overhead_s)
    # shard, delta: no gather; each engine GPU gets its slice, the trainer GPUs feed in parallel, replicas relay
    b = expected_bytes(m.params_b * 1e9 * m.dtype_bytes, n_train, g, t, p.delta_fraction)
    senders = b.per_trainer_rank / cross  # each trainer GPU sends its share once (the first replica)
    fill = min(BUCKET_BYTES, b.per_engine_rank) / cross * max(0, replicas(p, cluster) - 1).bit_length()
    return SyncCost(nbytes, b.gathered, max(b.per_engine_rank / cross, senders) + fill, eff.sync_overhead_s)
