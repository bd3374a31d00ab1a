"""Weight sync, as bytes and seconds: how much one sync moves and how long it takes over the cluster's
links, per transport. One small module on purpose: shard-to-shard and delta sync (weightsync-scale) add
or refine a transport here, and the simulator and the planner pick it up by name.

Transports (every time is one sync; `engine pause` is what the engines stop generating for it):
- broadcast: tidal's today (`tidal/weightsync/broadcast.py`): the trainer ranks gather the full weights,
  rank 0 broadcasts them to every engine GPU. A pipelined broadcast runs at the rate of its slowest
  link, whatever the number of receivers; the trainer-side gather is an all-gather.
- shard: each trainer GPU sends only the slices an engine GPU needs; every engine GPU receives its
  1/g of the bytes, and replicas relay to each other (a pipelined chain, as checkpoint-engine does).
- delta: the changed bytes only, `placement.delta_density` of the weights, each changed value sent with a 4-byte
  index (so 3x its 2 bytes), over the broadcast path.
- disk: written once to shared storage, read by every node.
- inprocess: colocated; each GPU gathers its engine's slice from the trainer shards over NVLink and copies it.
Each adds `sync_overhead_s` (pausing the engines, reloading, control messages).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.plan.cost import group_bw, node_link_bw, replicas
from tidal.plan.hardware import Accelerator
from tidal.plan.spec import ClusterSpec, Efficiency, ModelSpec, PlacementSpec

TRANSPORTS = ("broadcast", "shard", "delta", "disk", "inprocess")
BUCKET_BYTES = 256e6  # placement.weight_sync_bucket_mb's default: a pipelined broadcast's unit


def sync_bytes(m: ModelSpec, transport: str, delta_density: float = 0.03) -> float:
    """Bytes one sync carries from the trainer (before fan-out)."""
    full = m.params_b * 1e9 * m.dtype_bytes
    return full * delta_density * 3 if transport == "delta" else full


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
    delta_density = p.delta_density
    if t not in TRANSPORTS:
        raise ValueError(f"placement.sync: unknown transport `{t}` (known: {', '.join(TRANSPORTS)})")
    nbytes = sync_bytes(m, t, delta_density)
    n_train = p.trainer_gpus
    g = p.engine_gpus_per_replica
    receivers = replicas(p, cluster) * g
    # NVLink when the trainer and every engine GPU sit in one node, else the network
    cross = (hw.nvlink_bw if n_train + receivers <= cluster.gpus_per_node else node_link_bw(hw, cluster)) * eff.link
    # gather the full tensors on the trainer's side: an all-gather of the shards (broadcast, delta, disk)
    gather = nbytes * (n_train - 1) / n_train / (group_bw(hw, cluster, n_train) * eff.link) if n_train > 1 else 0.0
    if t == "inprocess":  # each GPU gathers only its engine's slice from its node's peers, then copies it
        return SyncCost(nbytes, nbytes / g / (hw.nvlink_bw * eff.link), nbytes / g / (hw.hbm_bw * eff.hbm),
                        eff.sync_overhead_s)
    if t in ("broadcast", "delta"):
        # one pipelined broadcast tree to every engine GPU, fed by trainer rank 0's NIC
        fill = min(BUCKET_BYTES, nbytes) / cross * max(0, receivers.bit_length() - 1)
        return SyncCost(nbytes, gather, nbytes / cross + fill, eff.sync_overhead_s)
    if t == "disk":
        storage = cluster.storage_bw_gbs * 1e9
        nodes = max(1, -(-(replicas(p, cluster) * g) // cluster.gpus_per_node))
        return SyncCost(nbytes, gather, nbytes / storage + nbytes * nodes / storage, eff.sync_overhead_s)
    # shard: no gather; each engine GPU pulls its slice, the trainer GPUs feed in parallel, replicas relay
    per_engine_gpu = nbytes / g
    senders = nbytes / n_train / cross  # each trainer GPU sends its shard once (the first replica)
    fill = min(BUCKET_BYTES, nbytes) / g / cross * max(0, replicas(p, cluster) - 1).bit_length()
    return SyncCost(nbytes, 0.0, max(per_engine_gpu / cross, senders) + fill, eff.sync_overhead_s)
