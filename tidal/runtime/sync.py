"""Weight sync as the controller sees it: `push()` brings every live engine replica to the
trainer's current version, whichever transport moves the bytes (tidal.weightsync).

in_driver (placement.mode=local): the Trainer's tensors go straight into the engines.
remote (placement.mode=ray): every trainer rank gathers the full weights (a collective
under FSDP2); then, by `placement.weight_sync` (resolved in `choose_transport`, the one place;
each transport a class with one `deliver` in TRANSPORTS),
  inprocess  each colocated rank loads them into its own engine;
  broadcast  rank 0 broadcasts them in buckets over a group of rank 0 and the engine
             actors, created for the purpose and re-formed when a replica is replaced;
  shard      no gather: every trainer rank sends its own shards' pieces to the engine actors
             by a transfer plan (tidal/weightsync/plan.py), made when the group forms; with
             placement.weight_sync_delta, only the compressed XOR against what each engine holds;
  slices     rank 0 sends each rank of a tensor-parallel engine only its slices;
  disk       rank 0 writes safetensors to a shared directory and every engine loads it.
Each engine answers with the version it now holds; the router's view is set from that.

A dead engine replica (the router marked it down) is replaced before the push when
`placement.restart_engines` is on: a new actor is started in the same bundle, receives
the current weights with the others, and only then takes requests again. With
`placement.engine_bootstrap=peer` the rollout replaces it sooner (`restore()`, before each
step's rollout): the new actor takes the version its live peers serve from one of them
(tidal/weightsync/peer.py), the trainer not involved, and takes requests at once; where no
peer can serve (none keeps a readable copy, docs/weightsync.md), it waits for the next push.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

from tidal.runtime.bootstrap import bootstrap_replica
from tidal.runtime.handles import Handle, RoleError, gather
from tidal.runtime.workers import RemoteEngine
from tidal.trainer.threads import on_own_thread
from tidal.weightsync import InProcessSync

log = logging.getLogger("tidal")


class WeightPusher:
    def __init__(self, push_fn, describe: str):
        self._push = push_fn
        self.describe = describe
        self.restarts = 0  # engine replicas replaced so far
        self.events: list[str] = []  # what happened to replicas, newest last
        self.restart_events: list[dict] = []  # replacements not yet in RUN/events.jsonl (health.role_restarts)

    @classmethod
    def in_driver(cls, trainer, engine) -> WeightPusher:
        sync = InProcessSync([engine], verify=True)  # the engine (or router) must then report the version

        def push(step: int | None) -> dict[str, float]:
            # On a thread that ends with it, as the trainer's calls (tidal/trainer/threads.py): copying the
            # weights into the engine is a parallel op whose OpenMP team must not stay on the loop's thread.
            out = on_own_thread(lambda: sync.push(trainer.version, trainer.named_weights()))
            return {"time/weight_sync_s": out["seconds"], "weight_sync/bytes": out["bytes"]}

        return cls(push, "in process")

    @classmethod
    def remote(cls, cfg, trainer, router, handles: list[Handle], transport: str, sync_dir: Path,
               respawn=None) -> WeightPusher:
        pusher = cls(None, transport)
        pusher._state = _RemoteSync(cfg, trainer, router, handles, TRANSPORTS[transport](), sync_dir, respawn, pusher)
        pusher._push = pusher._state.push
        return pusher

    @property
    def engine_handles(self) -> list[Handle]:
        return self._state.handles if hasattr(self, "_state") else []

    def push(self, step: int | None = None) -> dict[str, float]:
        return self._push(step)

    def restore(self, step: int | None = None) -> dict[str, float]:
        """placement.engine_bootstrap=peer: replace the replicas marked down now, each taking the
        weights from a live peer (`_RemoteSync.restore`); nothing otherwise."""
        state = getattr(self, "_state", None)
        return state.restore(step) if state is not None else {}

    def prepare(self) -> None:
        if hasattr(self, "_state"):
            self._state.prepare()


def choose_transport(weight_sync: str, colocated: bool, engine_tp: int = 1, engine_kind: str = "torch",
                     lora: bool = False) -> str:
    """The one place a transport is chosen (placement.weight_sync): `auto` moves weights in
    process where each trainer rank hosts its engine; otherwise it sends each rank of a
    tensor-parallel engine only its slices: by the shard transport, straight from the trainer
    ranks that own them, into vLLM's workers (no gather; measured 0.4x the time of `slices` in
    BENCHMARKS.md, Weight sync into a tensor-parallel engine), else (SGLang, or LoRA, whose merged
    weights exist only gathered) from trainer rank 0 by `slices`; and broadcasts to one-rank
    engines (each of which holds the whole model anyway)."""
    if weight_sync == "auto":
        if colocated:
            return "inprocess"
        if engine_tp > 1:
            return "shard" if engine_kind == "vllm" and not lora else "slices"
        return "broadcast"
    return weight_sync


class _InProcess:
    """Colocated: each trainer rank loads the gathered weights into its own engine."""

    def deliver(self, sync: _RemoteSync, targets: list[int], step: int | None) -> dict[int, int]:
        out = gather([h.submit("push_weights", "inprocess") for h in sync.trainer.ranks], step=step,
                     timeout_s=sync.timeout_s)
        self.metrics = {"weight_sync/bytes": max(float(o.get("bytes", 0.0)) for o in out)}  # each engine's copy
        return {i: out[i]["version"] for i in targets}


class _Broadcast:
    """Rank 0 broadcasts in buckets over a group of itself and the engine actors, formed
    again whenever the set of live engines changed (a replica replaced)."""

    def __init__(self):
        self.epoch = 0
        self.members: list[Handle] | None = None

    def deliver(self, sync: _RemoteSync, targets: list[int], step: int | None) -> dict[int, int]:
        self._ensure_group(sync, [sync.handles[i] for i in targets])
        ranks = sync.trainer.ranks
        subs = [h.submit("push_weights", "broadcast", sync.options) for h in ranks]
        subs += [sync.handles[i].submit("sync_recv") for i in targets]
        out = gather(subs, step=step, timeout_s=sync.timeout_s)
        self.metrics = {"weight_sync/bytes": float(out[0].get("bytes", 0.0))}  # rank 0's payload, to every engine
        return {i: o["version"] for i, o in zip(targets, out[len(ranks):])}

    def _ensure_group(self, sync: _RemoteSync, live: list[Handle]) -> None:
        if self.members is not None and [id(h) for h in live] == [id(h) for h in self.members]:
            return
        self.epoch += 1
        rank0 = sync.trainer.ranks[0]
        addr, port = rank0.call("where", timeout_s=sync.timeout_s)
        world, name = 1 + len(live), f"tidal-weights-{self.epoch}"
        args = {"backend": sync.backend(), "timeout_s": sync.cfg.placement.collective_timeout_s}
        gather([rank0.submit("sync_join", addr, port, 0, world, name, **args)]
               + [h.submit("sync_join", addr, port, r, world, name, **args) for r, h in enumerate(live, start=1)],
               timeout_s=sync.timeout_s)
        self.members = live


class _Slices:
    """Rank 0 sends each engine rank only its slices (tidal/weightsync/sliced.py) over a group
    of itself and every rank of every live replica (engine.tensor_parallel ranks each, which
    join themselves), formed again whenever the set of live engines changed."""

    def __init__(self):
        self.epoch = 0
        self.members: list[Handle] | None = None
        self.metrics: dict[str, float] = {}

    def deliver(self, sync: _RemoteSync, targets: list[int], step: int | None) -> dict[int, int]:
        live = [sync.handles[i] for i in targets]
        self._ensure_group(sync, live, [sync.router.names[i] for i in targets])
        options = {**sync.options, "step": step, "replicas": [sync.router.names[i] for i in targets],
                   "served": sync.cfg.engine.kind in ("vllm", "sglang")}
        ranks = sync.trainer.ranks
        subs = [h.submit("push_weights", "slices", options) for h in ranks]
        subs += [h.submit("slices_recv") for h in live]
        out = gather(subs, step=step, timeout_s=sync.timeout_s)
        per_rank = out[0].get("bytes_per_rank") or [0.0]  # what each engine rank received
        self.metrics = {"weight_sync/bytes": max(per_rank), "weight_sync/bytes_total": float(sum(per_rank))}
        return {i: o["version"] for i, o in zip(targets, out[len(ranks):])}

    def _ensure_group(self, sync: _RemoteSync, live: list[Handle], names: list[str]) -> None:
        if self.members is not None and [id(h) for h in live] == [id(h) for h in self.members]:
            return
        self.epoch += 1
        tp = sync.cfg.engine.tensor_parallel
        rank0 = sync.trainer.ranks[0]
        addr, port = rank0.call("where", timeout_s=sync.timeout_s)
        world, name = 1 + tp * len(live), f"tidal-slices-{self.epoch}"
        backend, timeout = sync.backend(), sync.cfg.placement.collective_timeout_s
        gather([rank0.submit("sync_join", addr, port, 0, world, name, backend, timeout)]
               + [h.submit("slices_join", addr, port, 1 + tp * k, world, name, backend, timeout, names[k])
                  for k, h in enumerate(live)], timeout_s=sync.timeout_s)
        self.members = live


class _Shard:
    """Every trainer rank sends its own shards' pieces straight to the engine actors, by a
    transfer plan made when the group (all trainer ranks and the live engines) forms, again
    whenever the set of live engines changed; a new group starts every engine on a full sync."""

    def __init__(self):
        self.epoch = 0
        self.members: list[Handle] | None = None
        self.metrics: dict[str, float] = {}

    def deliver(self, sync: _RemoteSync, targets: list[int], step: int | None) -> dict[int, int]:
        self._ensure_group(sync, [sync.handles[i] for i in targets])
        ranks = sync.trainer.ranks
        subs = [h.submit("push_weights", "shard", sync.options) for h in ranks]
        subs += [sync.handles[i].submit("shard_recv") for i in targets]
        out = gather(subs, step=step, timeout_s=sync.timeout_s)
        engines = out[len(ranks):]
        self.metrics = {"weight_sync/bytes": max(e["bytes"] for e in engines),
                        "weight_sync/full_bytes": max(e["raw_bytes"] for e in engines),
                        "weight_sync/repaired": float(sum(bool(e["mismatched"]) for e in engines))}
        return {i: o["version"] for i, o in zip(targets, engines)}

    def prepare(self, sync: _RemoteSync) -> None:
        self._ensure_group(sync, [h for h, up in zip(sync.handles, sync.router.up) if up])

    def _ensure_group(self, sync: _RemoteSync, live: list[Handle]) -> None:
        if self.members is not None and [id(h) for h in live] == [id(h) for h in self.members]:
            return
        self.epoch += 1
        ranks = sync.trainer.ranks
        addr, port = ranks[0].call("where", timeout_s=sync.timeout_s)
        tp = per_rank_tp(sync.cfg)  # engine ranks per replica in the plan: each vLLM TP worker is one
        world, name, n = len(ranks) + tp * len(live), f"tidal-shard-{self.epoch}", len(ranks)
        args = {"backend": sync.backend(), "timeout_s": sync.cfg.placement.collective_timeout_s,
                "engine_ranks": tp * len(live), "bucket_mb": sync.cfg.placement.weight_sync_bucket_mb, "engine_tp": tp}
        index = {id(h): i for i, h in enumerate(sync.handles)}
        names = [sync.router.names[index[id(h)]] for h in live]
        out = gather([h.submit("shard_join", addr, port, r, world, name, **args) for r, h in enumerate(ranks)]
                     + [h.submit("shard_join", addr, port, n + tp * k, world, name, **args, role=names[k])
                        for k, h in enumerate(live)], timeout_s=sync.timeout_s)
        log.info("%s", out[0])  # the transfer plan: bytes per engine rank, buckets, senders
        self.members = live


def per_rank_tp(cfg) -> int:
    """The shard transport's engine ranks per replica: a tensor-parallel vLLM engine's workers
    each join the group and receive only their slices (tidal/engines/vllm_transfer.py); other
    engines join as one rank holding whole tensors (SGLang at TP > 1 then loads them its own way)."""
    return cfg.engine.tensor_parallel if cfg.engine.kind == "vllm" and cfg.engine.tensor_parallel > 1 else 1


class _Disk:
    """Rank 0 writes safetensors to a shared directory; every engine loads the file."""

    def deliver(self, sync: _RemoteSync, targets: list[int], step: int | None) -> dict[int, int]:
        out = gather([h.submit("push_weights", "disk", sync.options) for h in sync.trainer.ranks], step=step,
                     timeout_s=sync.timeout_s)
        got = gather([sync.handles[i].submit("load_weights_file", out[0]["path"]) for i in targets], step=step,
                     timeout_s=sync.timeout_s)
        self.metrics = {"weight_sync/bytes": float(out[0].get("bytes", 0.0))}  # the file every engine reads
        return dict(zip(targets, got))


TRANSPORTS = {"inprocess": _InProcess, "broadcast": _Broadcast, "shard": _Shard, "slices": _Slices, "disk": _Disk}


class _RemoteSync:
    def __init__(self, cfg, trainer, router, handles, transport, sync_dir, respawn, owner: WeightPusher):
        self.cfg, self.trainer, self.router = cfg, trainer, router
        self.handles, self.transport, self.sync_dir = handles, transport, Path(sync_dir)
        self.respawn, self.owner = respawn, owner
        pl = cfg.placement
        self.options = {"bucket_mb": pl.weight_sync_bucket_mb, "checksum": pl.weight_sync_checksum,
                        "dir": str(self.sync_dir)}
        self.timeout_s = pl.call_timeout_s
        self._lock = threading.Lock()  # push and restore: one at a time (restore runs on the rollout's thread)
        self._fresh: set[int] = set()  # replicas replaced by restore() that still wait for weights

    def _replace_dead(self, step: int | None, source: str = "") -> list[int]:
        """Start a new actor for every replica the router marked down; return their indices.
        `source`: where it takes its weights (the log's words); the trainer's version by default."""
        replaced = []
        if self.respawn is None:
            return replaced
        for i, up in enumerate(self.router.up):
            if up or i in self._fresh:
                continue
            why = self.router.down_reason[i]
            old = self.handles[i]
            old.kill()
            self.handles[i] = self.respawn(i)
            gone = self.router.replicas[i]
            self.router.replace(i, RemoteEngine(self.handles[i], gone.name, timeout_s=gone.timeout_s, version=-1))
            self.owner.restarts += 1
            msg = (f"step {step}: {self.router.names[i]} was down ({why}); replaced by a new actor "
                   f"that receives {source or f'weights v{self.trainer.version}'} before it takes requests")
            log.warning(msg)
            self.owner.events.append(msg)
            self.owner.restart_events.append({"role": self.router.names[i], "restart": self.owner.restarts,
                                              "message": msg})
            replaced.append(i)
        return replaced

    def backend(self) -> str:
        b = self.cfg.placement.backend
        if b != "auto":
            return b
        return "nccl" if self.cfg.model.resolved_device().startswith("cuda") else "gloo"

    def _check_alive(self, step: int | None) -> None:
        """Mark down every engine actor that died since its last answer (e.g. after it returned
        its requests): a dead member would stall the broadcast until the collective timeout."""
        if self.respawn is None:  # colocated: the engines are the trainer ranks
            return
        live = [i for i, up in enumerate(self.router.up) if up]
        calls = {i: self.handles[i].submit("engine_version") for i in live}
        deadline = time.monotonic() + min(self.timeout_s, 60.0)
        for i, pending in calls.items():  # one by one: a dead engine must not hide the others' answers
            try:
                gather([pending], step=step, timeout_s=max(deadline - time.monotonic(), 0.1))
            except RoleError as e:
                if e.kind == "died":
                    self.router.mark_down(i, f"found dead before the weight sync of step {step}: {e}")
                elif e.kind == "timeout":
                    self.router.mark_down(i, f"did not answer a liveness check before the weight sync of step {step}")
                else:
                    raise

    def _blame(self, e: RoleError, targets: list[int]) -> list[int]:
        """The engine replicas a failed delivery names: the role that failed, or those a
        trainer's error names (the sender's WeightSyncError names the receiver it waited on)."""
        text = f"{e.role}: {e}"
        return [i for i in targets if re.search(rf"\b{re.escape(self.router.names[i])}\b", text)]

    def _deliver(self, targets: list[int], step: int | None) -> dict[int, int]:
        """Deliver; when it fails naming engine replicas (a sync that hung or broke), those are
        marked down, replaced (placement.restart_engines) and the sync runs again, once."""
        try:
            return self.transport.deliver(self, targets, step)
        except RoleError as e:
            blamed = self._blame(e, targets)
            if self.respawn is None or not blamed:
                raise
            for i in blamed:
                self.router.mark_down(i, f"the weight sync of step {step} failed: {e}")
            log.warning("step %s: the weight sync failed (%s); replacing %s and syncing again", step, e,
                        ", ".join(self.router.names[i] for i in blamed))
            self._pending_up.update({i: True for i in self._replace_dead(step)})
            if hasattr(self.transport, "members"):
                self.transport.members = None  # a group that timed out is broken: form a new one
            return self.transport.deliver(self, targets, step)

    def push(self, step: int | None) -> dict[str, float]:
        with self._lock:
            return self._push(step)

    def _push(self, step: int | None) -> dict[str, float]:
        t0 = time.perf_counter()
        self._check_alive(step)
        self._pending_up = {i: True for i in [*self._replace_dead(step), *self._fresh]}
        self._fresh.clear()
        targets = [i for i, up in enumerate(self.router.up) if up or self._pending_up.get(i)]
        versions = self._deliver(targets, step)
        want = self.trainer.version
        for i, v in versions.items():
            if v != want:
                raise RuntimeError(f"weight sync at step {step}: {self.router.names[i]} reports version {v} after "
                                   f"receiving v{want}")
            self.router.replicas[i].set_version(v)
            if not self.router.up[i]:
                self.router.mark_up(i)
                log.warning("step %s: %s is back with weights v%d", step, self.router.names[i], v)
        return {"time/weight_sync_s": time.perf_counter() - t0, "engines/restarted": float(len(self._pending_up)),
                **getattr(self.transport, "metrics", {})}

    def restore(self, step: int | None) -> dict[str, float]:
        """placement.engine_bootstrap=peer: replace every replica the router marked down and bring
        it to the version its live peers serve, from one of them (tidal/weightsync/peer.py), the
        trainer not involved; it takes requests at once. One a peer cannot serve waits for the
        next push (the trainer); one whose transfer failed is replaced again there. Skipped while
        a push runs (that push replaces them)."""
        if (self.cfg.placement.engine_bootstrap != "peer" or self.respawn is None or all(self.router.up)
                or not self._lock.acquire(blocking=False)):
            return {}
        try:
            t0 = time.perf_counter()
            live = [i for i, up in enumerate(self.router.up) if up]
            new = self._replace_dead(step, "the weights of a live peer (or, failing that, of the next sync)")
            self._fresh.update(new)
            done = [i for i in new if bootstrap_replica(self, i, live, per_rank_tp(self.cfg), step)]
            return {"engines/bootstrapped_from_peer": float(len(done)),
                    "time/engine_bootstrap_s": time.perf_counter() - t0} if new else {}
        finally:
            self._lock.release()

    def prepare(self) -> None:
        """Form the transport's group now (the shard transport's plan is logged at start)."""
        if hasattr(self.transport, "prepare"):
            self.transport.prepare(self)
