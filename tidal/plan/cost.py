"""The cost model: seconds of a decode iteration, a prefill, a training step and a role switch, from the
model's size, the parallel degrees and the accelerator's peaks times the stated efficiencies. Pure
functions (numpy arrays in, arrays out) so that the simulator evaluates every replica of a step at once.

The choice is a roofline: a decode iteration costs the larger of reading its bytes (the weights it
touches and every active sequence's KV cache) and its matmul FLOPs, plus the tensor/expert-parallel
collectives of each layer and a fixed overhead; prefill and training are FLOP-bound (6·N per trained
token, 2·N per prefilled one, plus the attention term), with data-parallel communication partly hidden
under compute. Legend: b = sequences decoding at once, kv = tokens of KV cache they read, g = GPUs of a
replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tidal.plan.hardware import NETWORKS, Accelerator
from tidal.plan.spec import ClusterSpec, Efficiency, ModelSpec, PlacementSpec


def node_link_bw(hw: Accelerator, cluster: ClusterSpec) -> float:
    """Bytes/s per GPU per direction between nodes."""
    per_gpu = NETWORKS.get(cluster.network)
    return hw.nic_bw if per_gpu is None else per_gpu * 8 / cluster.gpus_per_node


def group_bw(hw: Accelerator, cluster: ClusterSpec, group_span_gpus: int) -> float:
    """The per-GPU bandwidth of a collective over `group_span_gpus` consecutive GPUs: NVLink inside a node,
    the network once the group crosses nodes (a ring is as fast as its slowest link)."""
    return hw.nvlink_bw if group_span_gpus <= cluster.gpus_per_node else node_link_bw(hw, cluster)


def expert_split(m: ModelSpec) -> tuple[float, float]:
    """(shared parameters, parameters of one routed expert summed over layers), from total/active and E, k."""
    if not m.experts:
        return m.params_b * 1e9, 0.0
    per_expert = (m.params_b - m.active_b) * 1e9 / (m.experts - m.top_k)
    return m.active_b * 1e9 - m.top_k * per_expert, per_expert


def decode_iter_s(b: np.ndarray, kv: np.ndarray, m: ModelSpec, hw: Accelerator, eff: Efficiency, tp: int,
                  ep: int) -> np.ndarray:
    """Seconds of one decode iteration of a replica with b sequences reading kv cached tokens (arrays)."""
    g = tp * ep
    b = np.asarray(b, dtype=float)
    shared, per_expert = expert_split(m)
    if m.experts:  # a batch touches 1-(1-k/E)^b of the experts: a small batch reads few of them
        touched = m.experts * (1.0 - (1.0 - m.top_k / m.experts) ** b)
        weight_bytes = (shared + touched * per_expert) * m.dtype_bytes
    else:
        weight_bytes = np.full_like(b, shared * m.dtype_bytes)
    mem = (weight_bytes + np.asarray(kv, float) * m.kv_bytes_per_token) / (g * hw.hbm_bw * eff.hbm)
    flops = 2.0 * m.active_b * 1e9 * b + 4.0 * m.layers * m.kv_heads * m.head_dim * np.asarray(kv, float)
    compute = flops / (g * hw.bf16_flops * eff.mfu_decode)
    comm = np.zeros_like(b)
    if tp > 1:  # two all-reduces of b x hidden per layer, latency-bound at small batch
        comm = comm + m.layers * 2 * (2 * hw.link_latency_s + b * m.hidden * 2 * 2 * (tp - 1) / tp
                                      / (hw.nvlink_bw * eff.link))
    if ep > 1 and m.experts:  # dispatch and combine of each token's top-k hidden states
        comm = comm + m.layers * 2 * (hw.link_latency_s + b * m.top_k * m.hidden * 2 * (ep - 1) / ep
                                      / (hw.nvlink_bw * eff.link))
    return np.maximum(mem, compute) + comm + eff.decode_overhead_s


def prefill_s(tokens: np.ndarray, m: ModelSpec, hw: Accelerator, eff: Efficiency, g: int) -> np.ndarray:
    """Seconds to prefill `tokens` new tokens on a replica of g GPUs (FLOP-bound)."""
    return 2.0 * m.active_b * 1e9 * np.asarray(tokens, float) / (g * hw.bf16_flops * eff.mfu_prefill)


@dataclass
class TrainCost:
    compute_s: float
    dp_comm_s: float  # exposed (not hidden under compute)
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float
    optimizer_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.dp_comm_s + self.tp_comm_s + self.cp_comm_s + self.ep_comm_s
                + self.optimizer_s + self.overhead_s)


def train_step_cost(tokens: float, mean_ctx: float, m: ModelSpec, hw: Accelerator, eff: Efficiency,
                    cluster: ClusterSpec, n_gpus: int, tp: int, cp: int, ep: int, updates: int = 1) -> TrainCost:
    """One training step on `tokens` tokens (prompts and responses) over n_gpus = dp x tp x cp GPUs.

    FLOPs: 6·N_active per token plus causal attention 6·layers·heads·head_dim·ctx per token; the
    data-parallel group all-gathers the parameters twice (forward, backward) and reduce-scatters the
    gradients once per optimizer update (FSDP), 1 - comm_overlap of it exposed. The mesh is tidal's
    (docs/parallel.md): tp's two all-reduces of the hidden states per layer forward and two backward (no
    sequence parallelism), cp as Ulysses all-to-alls, ep's dispatch and combine all-to-alls forward and
    backward (ep borrowed from the data ranks; tidal's does not combine with tp or cp, a spec may, to model
    other trainers)."""
    dp = max(1, n_gpus // (tp * cp))
    P = m.params_b * 1e9
    attn = 6.0 * m.layers * m.kv_heads * m.head_dim * 4 * mean_ctx / 2  # q heads ~ 4x kv heads (GQA)
    compute = tokens * (6.0 * m.active_b * 1e9 + attn) / (n_gpus * hw.bf16_flops * eff.mfu_train)
    shard_bytes = P * 2 / (tp * ep)  # bf16 parameters one data-parallel group gathers
    dp_bw = group_bw(hw, cluster, n_gpus) * eff.link
    dp_comm = updates * 3 * shard_bytes * (dp - 1) / dp / dp_bw * (1 - eff.comm_overlap) if dp > 1 else 0.0
    local_tokens = tokens / (dp * cp)
    tp_comm = (m.layers * 4 * 2 * (tp - 1) / tp * local_tokens * m.hidden * 2 / (hw.nvlink_bw * eff.link)
               if tp > 1 else 0.0)
    # Ulysses (tidal/trainer/parallel/context.py): per layer four all-to-alls forward (q, k, v with the kv
    # heads repeated to the query heads, the output) and four backward, each of a rank's positions x its
    # tp share of the hidden size, (cp - 1)/cp of it leaving the rank
    cp_comm = (m.layers * 8 * (cp - 1) / cp * local_tokens * m.hidden / tp * 2
               / (group_bw(hw, cluster, tp * cp) * eff.link) if cp > 1 else 0.0)
    ep_comm = (m.layers * 4 * (ep - 1) / ep * local_tokens * m.top_k * m.hidden * 2
               / (group_bw(hw, cluster, tp * cp * ep) * eff.link) if ep > 1 and m.experts else 0.0)
    optimizer = updates * P * eff.train_bytes_per_param * 2 / n_gpus / (hw.hbm_bw * eff.hbm)
    return TrainCost(compute, dp_comm, tp_comm, cp_comm, ep_comm, optimizer, eff.train_overhead_s)


def trainer_memory_per_gpu(m: ModelSpec, eff: Efficiency, n_gpus: int, tp: int) -> float:
    """Bytes: fully sharded training state plus one micro-batch's checkpointed activations."""
    state = m.params_b * 1e9 * eff.train_bytes_per_param / n_gpus
    act = eff.micro_batch_tokens * m.hidden * 2 * (2 * m.layers + 34) / tp
    return state + act


def engine_kv_capacity_tokens(m: ModelSpec, hw: Accelerator, eff: Efficiency, g: int) -> float:
    """Tokens of KV cache one replica of g GPUs holds after its weights (negative: the weights do not fit)."""
    free = g * hw.hbm_bytes * eff.kv_mem_frac - m.params_b * 1e9 * m.dtype_bytes
    return free / m.kv_bytes_per_token


def switch_s(m: ModelSpec, hw: Accelerator, eff: Efficiency, p: PlacementSpec, n_gpus: int) -> float:
    """Colocated sleep/wake, once per step: the trainer's state and the engine's weights each leave and
    return to HBM over PCIe (full duplex: one pass of each)."""
    train_bytes = m.params_b * 1e9 * eff.train_bytes_per_param / n_gpus
    engine_bytes = m.params_b * 1e9 * m.dtype_bytes / p.engine_gpus_per_replica
    return (train_bytes + engine_bytes) / (hw.pcie_bw * eff.link)


def checkpoint_s(m: ModelSpec, cluster: ClusterSpec) -> float:
    """Seconds to write the trainer's weights and optimizer state (16 bytes/param) to shared storage."""
    return m.params_b * 1e9 * 16 / (cluster.storage_bw_gbs * 1e9)


def replicas(p: PlacementSpec, cluster: ClusterSpec) -> int:
    gpus = p.trainer_gpus if p.colocate else p.engine_gpus
    return max(0, gpus // p.engine_gpus_per_replica)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else math.inf
