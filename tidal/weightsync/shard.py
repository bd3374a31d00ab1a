"""Shard-to-shard weight sync: every trainer rank sends the pieces of its own shards that each
engine rank holds, point to point, by a `TransferPlan` (tidal/weightsync/plan.py) made once
per group. No process gathers the model; a trainer rank stages at most one bucket.

The group is one `BroadcastGroup` (its own TCPStore and gloo/NCCL group, never the trainer's
default one) of T trainer ranks (group ranks 0..T-1, trainer rank = group rank) and E engine
ranks (group ranks T..T+E-1). Trainer rank 0 broadcasts the plan's JSON once (`share_plan`),
then for each sync, in rounds:

1. rank 0 broadcasts the round's header: version, whether pieces carry checksums, and per
   engine rank what it gets (`delta.SKIP`, `FULL` or `DELTA`, chosen by `delta.choose_modes`);
   a header of all SKIP ends the sync;
2. every message of the plan whose engine is not skipped goes from its trainer rank to its
   engine rank, in the plan's order (bucket by bucket; that order on both sides makes the
   blocking sends and receives free of deadlock): a small int64 meta (payload length, one
   checksum per piece) then the payload: the pieces' bytes (FULL) or `delta.encode`'s
   compressed XOR against the previous version (DELTA);
3. each engine rank that received checks the pieces' checksums and tells rank 0 (ok, count of
   mismatches); an engine with a mismatch gets a FULL round at once (its next header), and a
   mismatch in a FULL round ends the sync with WeightSyncError on every rank.

Every send and receive carries the group's timeout and names the role, the engine rank, the
bucket and the version when it expires (`WeightSyncError`, the group then broken).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from datetime import timedelta

import torch

from tidal.weightsync.base import WeightSyncError, tensor_bytes, torch_dtype
from tidal.weightsync.broadcast import BroadcastGroup
from tidal.weightsync.delta import FULL, SKIP, DeltaConfig, choose_modes, decode_into, digest, encode
from tidal.weightsync.plan import Message, TransferPlan, full_box, local_piece, relative

TAG = 0x7AD1  # the group's point-to-point messages (gloo matches them by peer and tag, in order)
ABORT = -1  # a header version that ends the sync with an error on every rank
CODEC_IDS = {"zstd": 0, "lz4": 1}
HEAD = 4  # a header's fixed fields: version, round, checksums on, codec; then one mode per engine rank


def _p2p(group: BroadcastGroup, t: torch.Tensor, peer: int, send: bool, what: str) -> None:
    if group.broken:
        raise WeightSyncError(f"weight-sync group {group.name!r} rank {group.rank} is broken ({group.broken}): "
                              "close it and join a new one")
    timeout = timedelta(seconds=group.timeout_s)
    try:
        work = group.pg.send([t], peer, TAG) if send else group.pg.recv([t], peer, TAG)
        work.wait(timeout)
    except Exception as e:  # gloo reports timeouts and lost peers as RuntimeError
        timed_out = "timeout" in str(e).lower() or "timed out" in str(e).lower()
        group.broken = f"{'timed out' if timed_out else 'failed'} on {what}"
        raise WeightSyncError(f"weight-sync group {group.name!r} rank {group.rank}/{group.world_size}: {what} "
                              + (f"timed out after {group.timeout_s:g} s" if timed_out else "failed")
                              + f" ({type(e).__name__}: {e})") from e


def share_plan(group: BroadcastGroup, plan: TransferPlan | None) -> TransferPlan:
    """Rank 0 passes its plan; every rank returns it (broadcast as JSON, once per group)."""
    raw = plan.to_json().encode() if group.rank == 0 else b""
    length = torch.tensor([len(raw)], dtype=torch.int64, device=group.device)
    group.broadcast(length, "the transfer plan's length")
    buf = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if group.rank == 0
           else torch.empty(int(length.item()), dtype=torch.uint8)).to(group.device)
    group.broadcast(buf, "the transfer plan")
    return plan if group.rank == 0 else TransferPlan.from_json(buf.cpu().numpy().tobytes().decode())


def _header(group: BroadcastGroup, values: list[int] | None, n_engines: int, what: str) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64) if values is not None else torch.zeros(HEAD + n_engines, dtype=torch.int64)
    group.broadcast(t.to(group.device), what)
    return [int(x) for x in t.cpu().tolist()]


def _bucket_name(plan: TransferPlan, m: Message, version: int) -> str:
    return f"bucket {m.bucket + 1}/{plan.buckets_of(m.dst)} for engine rank {m.dst} of v{version}"


def _as_tensor(data: bytes) -> torch.Tensor:
    """The payload's bytes as a uint8 tensor without a copy (read only: it is only sent)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # torch warns that `bytes` are not writable; nothing writes them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


class ShardSender:
    """A trainer rank's side. `named`: the policy's parameters as it holds them (DTensor shards
    or plain tensors), by the plan's names."""

    def __init__(self, group: BroadcastGroup, plan: TransferPlan, delta: DeltaConfig | None = None,
                 verify: bool = False):
        if group.rank >= plan.trainer_ranks:
            raise WeightSyncError(f"ShardSender on group rank {group.rank}: trainer ranks are 0..{plan.trainer_ranks - 1}")
        self.group, self.plan, self.verify = group, plan, verify
        self.delta = delta if delta is not None and delta.enabled else None
        self.rank = group.rank
        self.mine = [m for m in plan.messages if m.src == self.rank]
        self.own = {n: dict(p.owners).get(self.rank) for n, p in plan.params.items()}
        self.held: list[int | None] = [None] * plan.engine_ranks  # rank 0: the version each engine rank holds
        self.last_full: list[int | None] = [None] * plan.engine_ranks
        self.base: dict[str, torch.Tensor] = {}  # delta: this rank's shards at base_version
        self.base_version: int | None = None
        self._staging = torch.empty(plan.peak_staging_bytes(self.rank), dtype=torch.uint8, device=group.device)
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def send(self, version: int, named: Mapping[str, torch.Tensor]) -> dict:
        """One sync of `version` (every trainer rank calls it while every engine rank calls
        `ShardReceiver.recv`). Returns `seconds`, `bytes` (what this rank sent), `raw_bytes` (what
        those pieces weigh in full), `rounds`, and on rank 0 `modes` (first round) and `repaired`."""
        t0 = time.perf_counter()
        E, checks = self.plan.engine_ranks, bool(self.delta) or self.verify
        sent = raw = rounds = 0
        force: list[int] = []
        first_modes: list[int] = []
        while True:
            values = None
            if self.rank == 0:
                if rounds == 0:
                    modes = choose_modes(version, self.held, self.base_version, self.last_full, self.delta)
                else:
                    modes = [FULL if d in force else SKIP for d in range(E)]
                codec = CODEC_IDS[self.delta.codec] if self.delta else 0
                values = [version, rounds, int(checks or rounds > 0), codec, *modes]
                if rounds > 1 and force:  # a FULL round failed its checksums: nothing more to try
                    values[0] = ABORT
            head = _header(self.group, values, E, f"the header of round {rounds} of v{version}")
            if head[0] == ABORT:
                raise WeightSyncError(f"weight sync v{version}: engine ranks {force or '(see rank 0)'} failed the "
                                      "checksum of a full sync: what arrived is not what was sent")
            modes, check = head[HEAD:], bool(head[2])
            if all(m == SKIP for m in modes):
                break
            first_modes = first_modes or modes
            cache: dict = {}
            for m in self.mine:
                if modes[m.dst] != SKIP:
                    sent += self._send_message(m, modes[m.dst], version, named, check, cache)
                    raw += m.nbytes
            if self.rank == 0:
                force = self._statuses(version, modes)
            rounds += 1
        if self.delta:
            self._keep_base(named)
        self.base_version = version
        return {"version": version, "seconds": time.perf_counter() - t0, "bytes": float(sent), "raw_bytes": float(raw),
                "rounds": rounds, "modes": first_modes, "repaired": rounds > 1}

    def _statuses(self, version: int, modes: list[int]) -> list[int]:
        """Rank 0: each engine rank's answer; returns those whose checksums failed."""
        bad = []
        for d, mode in enumerate(modes):
            if mode == SKIP:
                continue
            status = torch.zeros(2, dtype=torch.int64, device=self.group.device)
            _p2p(self.group, status, self.plan.trainer_ranks + d, False, f"the status of engine rank {d} for v{version}")
            ok = bool(status[0])
            self.held[d] = version if ok else None
            if ok and mode == FULL:
                self.last_full[d] = version
            if not ok:
                bad.append(d)
        return bad

    def _keep_base(self, named: Mapping[str, torch.Tensor]) -> None:
        from torch.distributed.tensor import DTensor

        for name in {p.name for m in self.mine for p in m.pieces}:
            t = named[name]
            local = (t.to_local() if isinstance(t, DTensor) else t).detach()
            if name in self.base and self.base[name].shape == local.shape:
                self.base[name].copy_(local)
            else:
                self.base[name] = local.clone()

    def _send_message(self, m: Message, mode: int, version: int, named, check: bool, cache: dict) -> int:
        views = [local_piece(named[p.name], self.own[p.name], p.box) for p in m.pieces]
        where = _bucket_name(self.plan, m, version)
        if mode == FULL:
            payload = self._pack([v.to(self.group.device) for v in views])
            digests, at = [], 0
            for p in m.pieces:
                digests.append(digest(payload[at:at + p.nbytes]) if check else 0)
                at += p.nbytes
        else:
            key = tuple((p.name, p.box) for p in m.pieces)  # engines holding the same slice get the same bytes
            if cache.get("bucket") != m.bucket:  # only the current bucket's payloads are kept: memory stays bounded
                cache.clear()
                cache["bucket"] = m.bucket
            if key not in cache:
                new = [tensor_bytes(v) for v in views]
                old = [tensor_bytes(local_piece(self.base[p.name], self.own[p.name], p.box)) for p in m.pieces]
                if self._scratch.numel() < m.nbytes:
                    self._scratch = torch.empty(m.nbytes, dtype=torch.uint8)
                sizes = [torch_dtype(self.plan.params[p.name].dtype).itemsize for p in m.pieces]
                data = encode(new, old, sizes, self.delta.codec, self.delta.level, self._scratch)
                cache[key] = (_as_tensor(data), [digest(n) for n in new])
            payload, digests = cache[key]
        dst = self.plan.trainer_ranks + m.dst
        meta = torch.tensor([payload.numel(), *digests], dtype=torch.int64, device=self.group.device)
        _p2p(self.group, meta, dst, True, f"trainer rank {self.rank}: send of the meta of {where}")
        if payload.numel():
            _p2p(self.group, payload.to(self.group.device), dst, True, f"trainer rank {self.rank}: send of {where}")
        return payload.numel()

    def _pack(self, views: list[torch.Tensor]) -> torch.Tensor:
        """The pieces' bytes back to back: a view when one contiguous piece, else in the staging buffer."""
        if len(views) == 1 and views[0].is_contiguous():
            return views[0].reshape(-1).view(torch.uint8)
        at = 0
        for v in views:
            k = v.numel() * v.element_size()
            self._staging[at:at + k].view(v.dtype).view(v.shape).copy_(v)
            at += k
        return self._staging[:at]


class ShardReceiver:
    """An engine rank's side: holds its slices (the bytes a delta applies to) between syncs."""

    def __init__(self, group: BroadcastGroup, plan: TransferPlan):
        self.group, self.plan = group, plan
        self.dst = group.rank - plan.trainer_ranks
        if not 0 <= self.dst < plan.engine_ranks:
            raise WeightSyncError(f"ShardReceiver on group rank {group.rank}: engine ranks are group ranks "
                                  f"{plan.trainer_ranks}..{plan.trainer_ranks + plan.engine_ranks - 1}")
        self.boxes = plan.engine_boxes[self.dst]
        self.mine = [m for m in plan.messages if m.dst == self.dst]
        self.held = {n: torch.empty([e - s for s, e in b], dtype=torch_dtype(plan.params[n].dtype))
                     for n, b in self.boxes.items()}  # the engine's slices, by name, reused sync after sync
        self.version: int | None = None
        self._inbox = torch.empty(max((m.nbytes for m in self.mine), default=0), dtype=torch.uint8)

    @property
    def whole(self) -> bool:
        """Whether this engine rank holds every tensor whole (then `update_weights` installs them)."""
        return all(b == full_box(self.plan.params[n].shape) for n, b in self.boxes.items())

    def recv(self, engine=None) -> dict:
        """One sync (while every trainer rank calls `ShardSender.send`); installs into `engine` when
        given (`update_weights(version, slices)` for whole tensors). Returns `version`, `seconds`,
        `bytes` (received), `raw_bytes`, `mode` (of the first round), `mismatched` (names whose
        checksum failed, repaired by a full round), `checked` (whether the pieces carried checksums)."""
        t0 = time.perf_counter()
        E = self.plan.engine_ranks
        got = raw = rounds = 0
        mode0, mismatched, installed, check = SKIP, [], False, False
        while True:
            head = _header(self.group, None, E, f"the header of round {rounds} of the next version "
                                                f"(last received: v{self.version})")
            version, modes, check = head[0], head[HEAD:], bool(head[2])
            codec = next(c for c, i in CODEC_IDS.items() if i == head[3])
            if version == ABORT:
                raise WeightSyncError(f"weight sync on group {self.group.name!r}: a full round failed its checksums")
            if all(m == SKIP for m in modes):
                break
            mode = modes[self.dst]
            mode0 = mode0 or mode
            if mode != SKIP:
                bad = []
                for m in self.mine:
                    n, bad_names = self._recv_message(m, mode, version, check, codec)
                    got, raw, bad = got + n, raw + m.nbytes, bad + bad_names
                mismatched += bad
                status = torch.tensor([int(not bad), len(bad)], dtype=torch.int64, device=self.group.device)
                _p2p(self.group, status, 0, True, f"engine rank {self.dst}: send of its status for v{version}")
                installed = not bad
            rounds += 1
        if installed:
            self.version = version
            if engine is not None:
                self._install(engine, version)
        return {"version": self.version, "seconds": time.perf_counter() - t0, "bytes": float(got),
                "raw_bytes": float(raw), "mode": mode0, "mismatched": sorted(set(mismatched)), "checked": check}

    def _recv_message(self, m: Message, mode: int, version: int, check: bool, codec: str) -> tuple[int, list[str]]:
        where = _bucket_name(self.plan, m, version)
        src = m.src
        meta = torch.zeros(1 + len(m.pieces), dtype=torch.int64, device=self.group.device)
        _p2p(self.group, meta, src, False, f"engine rank {self.dst}: receive of the meta of {where} from trainer rank {src}")
        meta = meta.cpu().tolist()
        length = int(meta[0])
        if mode == FULL and length != m.nbytes:
            raise WeightSyncError(f"engine rank {self.dst}: {where} from trainer rank {src} is {length} bytes, the "
                                  f"plan says {m.nbytes}")
        if self._inbox.numel() < length:  # a delta that compressed badly may pass the raw size
            self._inbox = torch.empty(length, dtype=torch.uint8)
        payload = self._inbox[:length]
        if length:
            buf = payload.to(self.group.device)
            _p2p(self.group, buf, src, False, f"engine rank {self.dst}: receive of {where} from trainer rank {src}")
            payload = buf.cpu()
        dests = [self.held[p.name][relative(p.box, self.boxes[p.name])] for p in m.pieces]
        if mode == FULL:
            at = 0
            for v, p in zip(dests, m.pieces):
                v.copy_(payload[at:at + p.nbytes].view(v.dtype).view(v.shape))
                at += p.nbytes
        else:
            # XOR in place where the engine's box of the piece is contiguous (a row block), else on a copy
            flat = [v.view(-1).view(torch.uint8) if v.is_contiguous() else tensor_bytes(v).clone() for v in dests]
            decode_into(payload.numpy().data, flat, [v.element_size() for v in dests], codec)
            for v, f in zip(dests, flat):
                if not v.is_contiguous():
                    v.copy_(f.view(v.dtype).view(v.shape))
        bad = []
        if check:
            for v, p, want in zip(dests, m.pieces, meta[1:]):
                if digest(tensor_bytes(v)) != want:
                    bad.append(p.name)
        return length, bad

    def _install(self, engine, version: int) -> None:
        if not self.whole and not hasattr(engine, "update_weight_slices"):
            raise WeightSyncError(f"weight sync v{version}: engine rank {self.dst} holds slices of the weights, and "
                                  f"{type(engine).__name__} has no update_weight_slices(version, tensors, boxes) to "
                                  "install them")
        try:
            if self.whole:
                engine.update_weights(version, self.held)
            else:
                engine.update_weight_slices(version, self.held, self.boxes)
        except Exception as e:
            raise WeightSyncError(f"weight sync v{version}: engine rank {self.dst}'s update raised "
                                  f"{type(e).__name__}: {e}") from e
        if engine.version != version:
            raise WeightSyncError(f"weight sync v{version}: engine rank {self.dst} reports version {engine.version} "
                                  "after the update")
