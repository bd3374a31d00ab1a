"""Weight sync by bucketed torch.distributed broadcast, from trainer rank 0 to engine workers.

The group is made for the purpose, on its own TCPStore, and is never the default process
group: the trainer ranks already use that one for FSDP, and the engines are not part of it.
Rank 0 is the sender (trainer rank 0, also the store's master); ranks 1..N are engine
workers. The controller passes each side only a small record (host, port, rank, world
size); both sides call `BroadcastGroup.join` concurrently.

One sync is, all broadcast from rank 0: the header length (one int64), the header (JSON
`SyncHeader` as uint8), then each bucket as one flat buffer sent as its bytes (uint8, so
any dtype goes over any backend bit for bit). Every collective carries the group's
timeout; one that expires raises WeightSyncError naming the group, the rank and the
version, and leaves the group broken (close it and join a new one).

gloo runs on CPU tensors; nccl on the current CUDA device (set it before `join`). NCCL
collectives are asynchronous: a timeout is seen by NCCL's watchdog, which by default
aborts the process rather than raising here (docs/weightsync.md).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from tidal.weightsync.base import (
    SyncHeader,
    WeightSyncError,
    checksum,
    make_header,
    needs_copy,
    pack,
    torch_dtype,
    unpack,
)

DEFAULT_BUCKET_BYTES = 128 << 20
log = logging.getLogger("tidal")


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to `host` (127.0.0.1 when `host` is loopback).
    No packet is sent: a UDP socket only picks the interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class BroadcastGroup:
    """A process group of one sender (rank 0) and `world_size - 1` receivers."""

    def __init__(self, pg, store, rank: int, world_size: int, backend: str, timeout_s: float, name: str,
                 device: torch.device, reuse_buffers: bool):
        self.pg, self.store = pg, store
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout_s = timeout_s  # bounds every collective; may be changed between syncs
        self.name, self.device, self.reuse_buffers = name, device, reuse_buffers
        self.last_version: int | None = None  # last version sent or received
        self.broken: str | None = None  # why the group cannot be used any more
        self._staging: torch.Tensor | None = None  # sender: one bucket's worth of bytes, reused
        self._received: list[torch.Tensor] = []  # receiver with reuse_buffers: one buffer per bucket

    def staging(self, nbytes: int) -> torch.Tensor:
        """The sender's staging buffer (uint8), grown to at least `nbytes`."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._staging

    def receive_buffers(self, buckets) -> list[torch.Tensor]:
        """One flat buffer per bucket of a sync. With `reuse_buffers`, those of the last sync
        are reused where dtype and size match (the same model gives the same plan), so the
        tensors `recv_weights` returned last time are overwritten."""
        old = self._received if self.reuse_buffers else []
        bufs = []
        for i, b in enumerate(buckets):
            dtype = torch_dtype(b.dtype)
            same = i < len(old) and old[i].dtype == dtype and old[i].numel() == b.numel
            bufs.append(old[i] if same else torch.empty(b.numel, dtype=dtype, device=self.device))
        if self.reuse_buffers:
            self._received = bufs
        return bufs

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
             timeout_s: float = 300.0, name: str = "weightsync", local_host: str | None = None,
             reuse_buffers: bool | None = None) -> BroadcastGroup:
        """Join (rank 0: create) the group. Returns once all `world_size` ranks have joined;
        raises WeightSyncError when they have not within `timeout_s`.

        `host:port`: where rank 0 runs the group's TCPStore (rank 0 binds it there).
        `local_host`: the address this rank's gloo connections use; by default the local
        address on the route to `host`. `timeout_s` bounds the join and every collective.
        `reuse_buffers` (default: on for gloo, off for nccl): a receiver keeps its receive
        buffers between syncs, so what `recv_weights` returned is valid until the next
        `recv_weights` on the group (engines copy the tensors in `update_weights`). It saves
        page-faulting fresh host memory on every sync (the CUDA caching allocator already
        reuses device memory) at the cost of holding one copy of the weights between syncs."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not 0 <= rank < world_size or world_size < 2:
            raise ValueError(f"rank {rank} of world size {world_size}: need 0 <= rank < world_size, world_size >= 2")
        timeout = timedelta(seconds=timeout_s)
        where = f"weight-sync group {name!r} rank {rank}/{world_size} at {host}:{port}"
        try:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                  wait_for_workers=False)
            prefixed = dist.PrefixStore(f"tidal/weightsync/{name}", store)
            if backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host or local_address(host, port))]
                pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
                device = torch.device("cpu")
            else:
                if not torch.cuda.is_available():
                    raise WeightSyncError(f"{where}: backend 'nccl' needs a CUDA device")
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                device = torch.device("cuda", torch.cuda.current_device())
                pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        except WeightSyncError:
            raise
        except Exception as e:  # the store and gloo raise DistStoreError, DistNetworkError, RuntimeError
            raise WeightSyncError(f"{where}: could not join (all {world_size} ranks, within {timeout_s:g} s): "
                                  f"{type(e).__name__}: {e}") from e
        reuse = backend == "gloo" if reuse_buffers is None else reuse_buffers
        return cls(pg, store, rank, world_size, backend, timeout_s, name, device, reuse)

    def broadcast(self, t: torch.Tensor, what: str) -> None:
        """Broadcast `t` in place from rank 0, within the group's timeout. `what` names the
        transfer in the error ("the header of v3")."""
        if self.broken:
            raise WeightSyncError(f"weight-sync group {self.name!r} rank {self.rank} is broken ({self.broken}): "
                                  "close it and join a new one")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        try:
            self.pg.broadcast([t], opts).wait(opts.timeout)
        except Exception as e:  # gloo reports timeouts and lost peers as RuntimeError
            timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
            self.broken = f"{'timed out' if timed_out else 'failed'} on {what}"
            raise WeightSyncError(
                f"weight-sync group {self.name!r} rank {self.rank}/{self.world_size}: broadcast of {what} "
                + (f"timed out after {self.timeout_s:g} s" if timed_out else "failed")
                + f" ({type(e).__name__}: {e})") from e

    def barrier(self) -> None:
        """All ranks meet (benchmarks use it to start timings together)."""
        self.broadcast(torch.zeros(1, device=self.device), "a barrier")

    def close(self) -> None:
        """Release the group's connections; rank 0 also stops the store. Safe to call twice."""
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception as e:  # noqa: BLE001 - best effort: a peer may be gone already
                log.debug("weight-sync group %r rank %d: shutdown raised %r", self.name, self.rank, e)
        self.pg = self.store = self._staging = None
        self._received = []
        self.broken = self.broken or "closed"


def send_weights(group: BroadcastGroup, version: int, tensors: Mapping[str, torch.Tensor],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, with_checksum: bool = False) -> dict[str, float]:
    """Broadcast version `version` of `tensors` to every receiver of `group` (call on rank 0,
    while every receiver calls `recv_weights`). Returns `seconds` (the whole send, checksum
    included), `checksum_seconds`, `bytes` (payload), `buckets`."""
    if group.rank != 0:
        raise WeightSyncError(f"send_weights on rank {group.rank} of group {group.name!r}: only rank 0 sends")
    t0 = time.perf_counter()
    digest = checksum(tensors) if with_checksum else None
    t_sum = time.perf_counter() - t0
    header = make_header(version, tensors, bucket_bytes, digest)
    raw = header.to_bytes()
    group.broadcast(torch.tensor([len(raw)], dtype=torch.int64, device=group.device), f"the header length of v{version}")
    group.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(group.device), f"the header of v{version}")
    staging = group.staging(max((b.nbytes for b in header.buckets if needs_copy(b, tensors, group.device)), default=0))
    for i, bucket in enumerate(header.buckets):
        flat = pack(bucket, tensors, group.device, staging)
        group.broadcast(flat.view(torch.uint8), f"bucket {i + 1}/{len(header.buckets)} of v{version}")
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    group.last_version = version
    return {"version": float(version), "seconds": time.perf_counter() - t0, "checksum_seconds": t_sum,
            "bytes": float(header.nbytes), "buckets": float(len(header.buckets))}


def recv_weights(group: BroadcastGroup, after_receive: Callable[[dict[str, torch.Tensor]], None] | None = None
                 ) -> tuple[int, dict[str, torch.Tensor], SyncHeader]:
    """Receive one sync (call on ranks 1..N while rank 0 calls `send_weights`). Returns the
    version, the tensors (views into the received buckets, on the group's device, in the
    sender's order; with the group's `reuse_buffers`, valid until the next `recv_weights`)
    and the header. When the header carries a checksum, the checksum of what
    arrived must equal it, else WeightSyncError. `after_receive` sees the tensors before the
    check (tests use it to corrupt a byte)."""
    if group.rank == 0:
        raise WeightSyncError(f"recv_weights on rank 0 of group {group.name!r}: rank 0 is the sender")
    waiting = f"the header of the next version (last received: v{group.last_version})"
    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast(length, waiting + " [length]")
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(raw, waiting)
    header = SyncHeader.from_bytes(raw.cpu().numpy().tobytes())
    version = header.version
    metas = {m.name: m for m in header.metas}
    tensors: dict[str, torch.Tensor] = {}
    for i, (bucket, flat) in enumerate(zip(header.buckets, group.receive_buffers(header.buckets))):
        group.broadcast(flat.view(torch.uint8), f"bucket {i + 1}/{len(header.buckets)} of v{version}")
        tensors.update(unpack(bucket, flat, metas))
    tensors = {m.name: tensors[m.name] for m in header.metas}
    if after_receive is not None:
        after_receive(tensors)
    if header.checksum is not None:
        got = checksum(tensors)
        if got != header.checksum:
            raise WeightSyncError(f"weight sync v{version} on group {group.name!r} rank {group.rank}: the checksum of "
                                  f"what arrived ({got}) differs from the sender's ({header.checksum})")
    group.last_version = version
    return version, tensors, header


def receive_into(engine, group: BroadcastGroup,
                 after_receive: Callable[[dict[str, torch.Tensor]], None] | None = None) -> dict:
    """Receive one sync and install it: `engine.update_weights(version, tensors)`, after which
    the engine must report `version`. Returns `version`, `seconds` (receive and update),
    `bytes`, `checksum_ok` (True when a checksum was checked, None when none was sent)."""
    t0 = time.perf_counter()
    version, tensors, header = recv_weights(group, after_receive)
    try:
        engine.update_weights(version, tensors)
    except Exception as e:
        raise WeightSyncError(f"weight sync v{version} on group {group.name!r} rank {group.rank}: the engine's "
                              f"update_weights raised {type(e).__name__}: {e}") from e
    if engine.version != version:
        raise WeightSyncError(f"weight sync v{version} on group {group.name!r} rank {group.rank}: the engine "
                              f"reports version {engine.version} after the update")
    return {"version": version, "seconds": time.perf_counter() - t0, "bytes": header.nbytes,
            "checksum_ok": True if header.checksum is not None else None}
