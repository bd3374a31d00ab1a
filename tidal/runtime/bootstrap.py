"""Peer bootstrap in a run (placement.engine_bootstrap=peer): the engine actor's side
(`PeerRole`, mixed into every actor that holds an engine) and the driver's (`bootstrap_replica`,
called by tidal/runtime/sync.py's `restore` for each replica it replaced).

A restarted replica takes the version its live peers serve from one of them, through
tidal/weightsync/peer.py (the shard transport with the peer's ranks as the senders), so the
trainer is not involved and the replica takes requests before the next weight sync. The driver
first asks the peer what it can serve (`peer_version`: cheap, and a refusal costs no transfer
and no timeout): a vLLM-CPU replica keeps a readable copy only when fed by the shard transport
(docs/weightsync.md says why). Where none can serve, the replica waits for the next push.
"""

from __future__ import annotations

import contextlib
import logging
import time

from tidal.runtime.handles import RoleError, gather

log = logging.getLogger("tidal")


class PeerRole:
    """The peer-bootstrap calls of an engine actor (`self.engine`, and `self._shard`/`self._group`
    of the shard transport's receiving side: tidal/runtime/workers.py's SyncReceiver)."""

    engine = None
    _group = None
    _shard = None

    def peer_version(self, engine_tp: int = 1) -> dict:
        """What this replica could serve a peer: {"version": v}, or {"unavailable": why}."""
        from tidal.weightsync.peer import NO_READABLE_COPY, PeerUnavailable

        v = self.engine.version
        if engine_tp > 1:
            have = self.engine.peer_version()
            return {"version": v} if have == v else {"unavailable": f"its workers keep no copy of v{v} "
                                                                    f"({NO_READABLE_COPY})"}
        if self._shard is not None and self._shard.version == v:
            return {"version": v}
        try:
            with self.engine.peer_weights() as (version, _):
                return {"version": version}
        except PeerUnavailable as e:
            return {"unavailable": str(e)}

    def peer_serve(self, host: str, port: int, world_size: int, name: str, backend: str, timeout_s: float,
                   bucket_mb: float, engine_tp: int = 1, role: str = "") -> dict:
        """Serve this replica's weights to a new replica (tidal/weightsync/peer.py) as the group's
        source rank(s) 0..engine_tp-1; the new replica has the same layout. From the shard
        transport's copy (`_shard`, at the engine's version), a vLLM TP replica's workers, or the
        engine's own readable weights (the torch engine); else PeerUnavailable."""
        from tidal.weightsync import BroadcastGroup
        from tidal.weightsync.peer import peer_plan, replica_boxes, serve_peer, whole_params

        bucket = int(bucket_mb * (1 << 20))
        if engine_tp > 1:  # each vLLM worker sends its own slices
            reps = self.engine.serve_peer(host, port, world_size, name, timeout_s, engine_tp, bucket, role, backend)
            return {"version": self.engine.version, "bytes": float(sum(r["bytes"] for r in reps))}
        if self._shard is not None and self._shard.version == self.engine.version:
            held = contextlib.nullcontext((self._shard.version, self._shard.held))
        else:
            held = self.engine.peer_weights()
        with held as (version, named):
            params = whole_params(named)
            plan = peer_plan(params, replica_boxes(params, 1), replica_boxes(params, 1), bucket)
            group = BroadcastGroup.join(host, port, 0, world_size, backend=backend, timeout_s=timeout_s, name=name)
            try:
                return serve_peer(group, version, named, plan)
            finally:
                group.close()

    def peer_take(self, host: str, port: int, rank: int, world_size: int, name: str, backend: str, timeout_s: float,
                  engine_tp: int = 1, role: str = "") -> dict:
        """Take the weights from a live replica (`peer_serve` there) as group ranks `rank`..; the
        copy kept afterwards lets this replica serve the next one. Returns `version`, `bytes`."""
        from tidal.weightsync import BroadcastGroup
        from tidal.weightsync.peer import take_from_peer

        if self._group is not None:
            self._group.close()
            self._group = None
        if engine_tp > 1:
            self.engine.join_weight_group(host, port, world_size, rank, name, timeout_s, role, backend, shard=True)
            out = self.engine.receive_slices(timeout_s)
            return {"version": out["version"], "bytes": float(out["bytes"])}
        self._group = BroadcastGroup.join(host, port, rank, world_size, backend=backend, timeout_s=timeout_s, name=name)
        self._shard, out = take_from_peer(self._group, self.engine)
        return {"version": out["version"], "bytes": out["bytes"]}


def bootstrap_replica(sync, i: int, live: list[int], tp: int, step: int | None) -> bool:
    """Replica i of `sync` (a _RemoteSync; i a new actor) takes the weights of a live peer at
    the version the live replicas serve; `tp`: engine ranks per replica in a peer group. True
    when it did (then it is marked up); False when no peer could serve (it waits for the next
    push) or the transfer failed (then it is marked down again, to be replaced at the push)."""
    want = max((sync.router.replicas[j].version for j in live), default=-1)
    name = sync.router.names[i]
    reasons = []
    for j in [j for j in live if sync.router.replicas[j].version == want]:
        peer = sync.handles[j]
        try:
            can = peer.call("peer_version", tp, timeout_s=sync.timeout_s)
        except RoleError as e:
            reasons.append(f"{sync.router.names[j]}: {e}")
            continue
        if can.get("version") != want:
            reasons.append(f"{sync.router.names[j]}: {can.get('unavailable') or can}")
            continue
        addr, port = peer.call("where", timeout_s=sync.timeout_s)  # the group's store: on the peer's node
        group, pl = f"tidal-peer-{i}-{time.monotonic_ns()}", sync.cfg.placement
        try:
            _, got = gather([peer.submit("peer_serve", addr, port, 2 * tp, group, sync.backend(),
                                         pl.collective_timeout_s, pl.weight_sync_bucket_mb, tp, sync.router.names[j]),
                             sync.handles[i].submit("peer_take", addr, port, tp, 2 * tp, group, sync.backend(),
                                                    pl.collective_timeout_s, tp, name)],
                            step=step, timeout_s=sync.timeout_s)
        except RoleError as e:  # half loaded, maybe: replaced again at the next push, fed by the trainer
            sync._fresh.discard(i)
            sync.router.mark_down(i, f"its bootstrap from {sync.router.names[j]} failed: {e}")
            log.warning("step %s: %s could not take the weights from %s (%s); the next weight sync replaces "
                        "it again", step, name, sync.router.names[j], e)
            return False
        if got["version"] != want:
            raise RuntimeError(f"{name} reports v{got['version']} after taking v{want} from {sync.router.names[j]}")
        sync.router.replicas[i].set_version(want)
        sync.router.mark_up(i)
        sync._fresh.discard(i)
        msg = (f"step {step}: {name} took weights v{want} from its peer {sync.router.names[j]} "
               f"({got['bytes'] / 1e6:.1f} MB, checksummed per piece) and takes requests again")
        log.warning(msg)
        sync.owner.events.append(msg)
        return True
    log.warning("step %s: no live peer can give %s weights v%s (%s); it waits for the next weight sync",
                step, name, want, "; ".join(reasons) or "no live replica")
    return False
