"""The trainer: its ranks (`TrainerWorker`) and the ranks seen as one (`TrainerGroup`).

Both, like the `Trainer` itself, answer the calls of tidal/trainer/protocol.py. The group
adds `update`, the policy update of a step: epochs × mini-batches of forward_backward and
optim_step. A trainer in this process (placement.mode=local) computes on a thread that ends
with each call (tidal/trainer/threads.py: its OpenMP team must not outlive the call and
throttle the engine's decode), so the loop that calls it can run on the main thread.

A batch is split by tokens (balanced) across the data-parallel positions of the trainer's
mesh (train.parallel: the ranks of one tensor-parallel group get the same shard), each rank
runs the call on its shard with the global loss denominators, and rank 0's answer (the trainer returns
global metrics on every rank) comes back. With one rank the batch goes whole, exactly as
in a single process. Per-position results (`logprobs`, `values`) are put back in batch
order. Every call is bounded by `timeout_s` and fails with the role, call and step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tidal.config import TidalConfig
from tidal.models import load_tokenizer, resolve_model_dir
from tidal.monitor import trace
from tidal.net import is_loopback
from tidal.runtime.handles import Handle, gather
from tidal.runtime.workers import SyncReceiver, free_port, make_engine, node_ip, set_threads
from tidal.trainer.distributed import balanced_shards as split
from tidal.trainer.distributed import init_distributed
from tidal.trainer.threads import on_own_thread
from tidal.trainer.trainer import TrainBatch, Trainer
from tidal.weightsync import DiskSync, send_weights
from tidal.weightsync.sliced import replica_targets, send_slices


def balanced_shards(lengths: list[int], n: int) -> list[list[int]]:
    """n shards of sequence indices with balanced token counts (longest first to the
    lightest shard); indices sorted inside a shard."""

    return split(lengths, n)


def make_trainer(cfg: TidalConfig, model_dir: str | Path, pad_token_id: int):
    return Trainer(str(model_dir), cfg.train, cfg.algorithm, dtype=cfg.model.dtype,
                   temperature=cfg.rollout.temperature, pad_token_id=pad_token_id,
                   device=cfg.model.resolved_device(), norm_len=cfg.loss_norm_len)


class TrainerWorker(SyncReceiver):
    """One trainer rank. `setup` joins the ranks' torch.distributed group (when there are
    several) and loads the model; the other calls mirror the Trainer's. Calls marked
    collective must be made on every rank at once (the TrainerGroup does)."""

    def __init__(self, cfg: TidalConfig, model_dir: str, pad_token_id: int, rank: int = 0, world_size: int = 1,
                 engine_kind: str | None = None, log_dir: str | None = None, num_cpus: float = 0.0):
        if num_cpus:
            set_threads(num_cpus)
        self.cfg, self.model_dir, self.pad_token_id = cfg, model_dir, pad_token_id
        self.rank, self.world_size = rank, world_size
        self.engine_kind, self.log_dir = engine_kind, log_dir
        self.trainer = None
        self.store = None  # placement.mode=launcher: the store the launcher's ranks met on (tidal/runtime/launcher.py)
        self.host: str | None = None  # placement.mode=launcher: the rendezvous host (where weight-sync groups meet)
        if cfg.run.trace and not trace.enabled():  # in its own process (Ray); in the driver it is on already
            trace.enable(f"trainer rank {rank}")
        # Colocated and synchronous: the engine sleeps while this rank trains (memory back
        # to the trainer) and wakes with the new weights. With k > 0 it keeps generating.
        self._release_engine = engine_kind is not None and cfg.rollout.max_staleness == 0
        self.engine_sleeps = 0
        self._asleep = False

    def _training(self) -> None:
        if self._release_engine and self.engine.can_sleep and not self._asleep:
            self.engine.sleep()
            self._asleep = True
            self.engine_sleeps += 1

    def _wake(self) -> None:
        if self._asleep:
            self.engine.wake_up()
            self._asleep = False

    def where(self) -> tuple[str, int]:
        """(node address, a free port there): where the ranks' rendezvous listens (under a
        launcher, its rendezvous host: tidal/runtime/launcher.py sets `host`)."""
        ip = self.host or node_ip()
        return ip, free_port(ip)

    def setup(self, master_addr: str | None = None, master_port: int | None = None) -> int:
        torch.manual_seed(self.cfg.run.seed)
        if self.world_size > 1:
            if is_loopback(master_addr):  # gloo would otherwise pick the interface of the host name
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

            init_distributed(self.rank, self.world_size, master_addr, master_port, backend=self.cfg.placement.backend
                             if self.cfg.placement.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo"),
                             timeout_s=self.cfg.placement.collective_timeout_s, store=self.store)
        self.trainer = make_trainer(self.cfg, self.model_dir, self.pad_token_id)
        if self.engine_kind is not None:  # colocated: this rank's engine replica
            self.engine = make_engine(self.cfg, self.engine_kind, self.model_dir, self.pad_token_id, self.log_dir)
        return os.getpid()

    # -- the Trainer's calls (each a collective when world_size > 1) --------------------------
    def forward_backward(self, batch, kl_coef: float | None = None, totals=None) -> dict[str, float]:
        self._training()
        with trace.span("forward_backward", cat="train", rank=self.rank, sequences=len(batch)):
            return self.trainer.forward_backward(batch, kl_coef=kl_coef, totals=totals)

    def optim_step(self) -> dict[str, float]:
        with trace.span("optim_step", cat="train", rank=self.rank):
            return self.trainer.optim_step()

    def logprobs(self, batch) -> list[list[float]]:
        self._training()
        with trace.span("logprobs", cat="train", rank=self.rank, sequences=len(batch)):
            return self.trainer.logprobs(batch)

    def logprobs_routed(self, batch) -> list:
        self._training()
        with trace.span("logprobs", cat="train", rank=self.rank, sequences=len(batch)):
            return self.trainer.logprobs_routed(batch)

    def ref_logprobs(self, batch) -> list[list[float]]:
        self._training()
        with trace.span("ref_logprobs", cat="train", rank=self.rank, sequences=len(batch)):
            return self.trainer.ref_logprobs(batch)

    def drain_trace(self) -> list[dict]:
        """This process's spans since the last call (`run.trace`)."""
        return trace.drain()

    def values(self, batch) -> list[list[float]]:
        self._training()
        return self.trainer.values(batch)

    def version(self) -> int:
        return self.trainer.version

    def save(self, path: str, with_tokenizer: bool = True) -> None:
        tokenizer = None
        if with_tokenizer and self.rank == 0:
            tokenizer = load_tokenizer(self.model_dir)
        self.trainer.save(path, tokenizer=tokenizer)

    def load(self, path: str) -> int:
        self.trainer.load(path)
        return self.trainer.version

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.trainer.named_weights()

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective: every rank gathers the full weights; rank 0 returns them (to the engines
        in its own process, placement.mode=launcher), the others nothing."""
        named = self.trainer.named_weights()
        return named if self.rank == 0 else None

    def shards(self) -> dict[str, torch.Tensor]:
        """The policy's parameters as this rank holds them (DTensor shards under a mesh)."""
        from tidal.trainer import distributed as dp

        dp.reshard(self.trainer.model)
        return {n: p.detach() for n, p in self.trainer.model.named_parameters()}

    def shard_join(self, host: str, port: int, rank: int, world_size: int, name: str, backend: str, timeout_s: float,
                   engine_ranks: int = 1, bucket_mb: float = 256.0, engine_tp: int = 1) -> str:
        """Collective over the trainer ranks (weight_sync=shard): join the group of every trainer
        rank and `engine_ranks` engine ranks, and agree the transfer plan: every rank's shard
        boxes are exchanged, rank 0 builds the plan and sends it to the engine ranks. `engine_tp`
        > 1: the engine ranks are the TP ranks of engine_ranks / engine_tp replicas, each holding
        its slices (plan.tp_engine_boxes); else each holds whole tensors. Returns the plan's
        summary (tidal/weightsync/plan.py)."""
        from tidal.weightsync import BroadcastGroup
        from tidal.weightsync.plan import build_plan, full_slices, gather_layout, tp_engine_boxes
        from tidal.weightsync.shard import ShardSender, share_plan

        if self._group is not None:
            self._group.close()
        self._group = BroadcastGroup.join(host, port, rank, world_size, backend=backend, timeout_s=timeout_s, name=name)
        layout = gather_layout(self.shards())
        plan = None
        if self.rank == 0:
            if engine_tp > 1:
                hf_config = json.loads((resolve_model_dir(self.model_dir) / "config.json").read_text())
                boxes = tp_engine_boxes(hf_config, {n: p.shape for n, p in layout.items()}, engine_tp,
                                        engine_ranks // engine_tp)
            else:
                boxes = full_slices(layout, engine_ranks)
            plan = build_plan(layout, boxes, int(bucket_mb * 2**20), self.world_size)
        plan = share_plan(self._group, plan)
        pl = self.cfg.placement
        self._shard = ShardSender(self._group, plan, delta=pl.weight_sync_delta, verify=pl.weight_sync_checksum)
        return plan.summary()

    def push_weights(self, transport: str, options: dict | None = None) -> dict:
        """Collective: every rank gathers the full weights; then rank 0 sends them
        ("broadcast" over the sync group, "disk" into a directory) or each rank loads them
        into its own colocated engine ("inprocess"). "shard": no gather, every rank sends its
        own shards' pieces by the transfer plan (`shard_join`)."""
        options = options or {}
        version = self.trainer.version
        if transport == "shard":  # no gather: each rank sends its own pieces
            return {"version": version, **self._shard.send(version, self.shards())}
        named = self.trainer.named_weights()
        if transport == "inprocess":
            if self.engine is None:
                raise RuntimeError(f"trainer rank {self.rank} holds no engine: weight_sync=inprocess needs placement.colocate")
            self.engine.update_weights(version, named)
            self._wake()
            return {"version": version, "bytes": float(sum(t.numel() * t.element_size() for t in named.values()))}
        if self.rank != 0:
            return {"version": version}
        if transport == "broadcast":
            out = send_weights(self._group, version, named, bucket_bytes=int(options.get("bucket_mb", 256) * 2**20),
                               with_checksum=bool(options.get("checksum", False)))
            return {"version": version, **out}
        if transport == "slices":  # each engine rank gets only its slices (tidal/weightsync/sliced.py)
            hf_config = json.loads((resolve_model_dir(self.model_dir) / "config.json").read_text())
            tensors, targets, roles = replica_targets(hf_config, named, self.cfg.engine.tensor_parallel,
                                                      options["replicas"], options.get("served", False))
            out = send_slices(self._group, version, tensors, targets, step=options.get("step"), roles=roles,
                              bucket_bytes=int(options.get("bucket_mb", 256) * 2**20),
                              with_checksum=bool(options.get("checksum", False)))
            return {"version": version, **out}
        if transport == "disk":
            path = DiskSync(options["dir"]).write(version, named, with_checksum=bool(options.get("checksum", False)))
            return {"version": version, "path": str(path),
                    "bytes": float(sum(t.numel() * t.element_size() for t in named.values()))}
        raise ValueError(f"unknown weight transport {transport!r}")

    def pid(self) -> int:
        return os.getpid()

    def sleeps(self) -> int:
        return self.engine_sleeps


def mini_batch_indices(n: int, k: int) -> list[list[int]]:
    """k mini-batches of consecutive sequence indices, the last one shorter when k does not divide n."""
    size = -(-n // k)
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


class TrainerGroup:
    def __init__(self, ranks: list[Handle], timeout_s: float = 600.0, dp_index: list[int] | None = None,
                 routing_replay: str = "none"):
        self.ranks = ranks
        self.routing_replay = routing_replay  # train.moe.routing_replay: R2 records the anchor pass's routing
        # each rank's data-parallel position (tidal.trainer.parallel.ParallelDims.dp_index); default: its own
        self.dp_index = list(range(len(ranks))) if dp_index is None else dp_index
        self.timeout_s = timeout_s
        self.step: int | None = None  # the controller's step, for error messages
        self._version = 0

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def local(self):
        """The Trainer itself when it lives in this process (placement.mode=local)."""
        return None if self.ranks[0].remote else self.ranks[0].target.trainer

    @property
    def version(self) -> int:
        return self._version

    def _here(self, fn):
        """fn() on a thread of its own when the trainer computes in this process (module docstring)."""
        return fn() if self.ranks[0].remote else on_own_thread(fn)

    def _all(self, call: str, *args, **kwargs) -> list:
        return self._here(lambda: gather([h.submit(call, *args, **kwargs) for h in self.ranks], step=self.step,
                                         timeout_s=self.timeout_s))

    def _sharded(self, call: str, batch: TrainBatch, **kwargs) -> tuple[list[list[int]], list]:
        """(the sequence indices each rank got, each rank's answer)."""
        if self.world_size == 1:
            return [list(range(len(batch)))], [self._here(lambda: self.ranks[0].call(
                call, batch, step=self.step, timeout_s=self.timeout_s, **kwargs))]
        shards = balanced_shards([len(t) for t in batch.tokens], max(self.dp_index) + 1)
        subs = [h.submit(call, batch.select(shards[d]), **kwargs) for h, d in zip(self.ranks, self.dp_index)]
        parts = gather(subs, step=self.step, timeout_s=self.timeout_s)
        first = {d: r for r, d in reversed(list(enumerate(self.dp_index)))}  # one answer per shard
        return shards, [parts[first[d]] for d in range(len(shards))]

    def _per_position(self, call: str, batch: TrainBatch) -> list[list[float]]:
        shards, parts = self._sharded(call, batch)
        out: list[list[float]] = [[] for _ in range(len(batch))]
        for idx, values in zip(shards, parts):
            for i, v in zip(idx, values):
                out[i] = v
        return out

    # -- the step's update ------------------------------------------------------------------------
    def update(self, batch: TrainBatch, *, epochs: int = 1, mini_batches: int = 1,
               kl_coef: float | None = None) -> list[dict[str, float]]:
        """`epochs` passes over `mini_batches` mini-batches of `batch`, forward_backward and
        optim_step each; the metrics of each update. With several updates the policy before the
        first is the PPO anchor (`old_logprobs`, unless the batch has it already)."""
        def run() -> list[dict[str, float]]:
            minis = mini_batch_indices(len(batch), mini_batches)
            if epochs * len(minis) > 1 and self.routing_replay == "R2":  # the anchor's routing, replayed in the updates
                routed = self._per_position("logprobs_routed", batch)
                batch.old_logprobs = batch.old_logprobs or [lp for lp, _ in routed]
                batch.trainer_routing = [r for _, r in routed]
            elif epochs * len(minis) > 1 and batch.old_logprobs is None:
                batch.old_logprobs = self.logprobs(batch)
            out = []
            for _ in range(epochs):
                for idx in minis:
                    m = self.forward_backward(batch.select(idx), kl_coef=kl_coef)
                    out.append({**m, **self.optim_step()})
            return out

        return self._here(run)

    # -- the Trainer's surface (tidal/trainer/protocol.py) --------------------------------------
    def forward_backward(self, batch: TrainBatch, kl_coef: float | None = None) -> dict[str, float]:
        totals = batch.totals() if self.world_size > 1 else None
        return self._sharded("forward_backward", batch, kl_coef=kl_coef, totals=totals)[1][0]  # global metrics

    def optim_step(self) -> dict[str, float]:
        out = self._all("optim_step")[0]
        self._version += 1
        return out

    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return self._per_position("logprobs", batch)

    def ref_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return self._per_position("ref_logprobs", batch)

    def values(self, batch: TrainBatch) -> list[list[float]]:
        return self._per_position("values", batch)

    def save(self, path: str) -> None:
        self._all("save", str(path))

    def load(self, path: str) -> None:
        self._version = self._all("load", str(path))[0]

    def named_weights(self):
        """Full weights, in this process: local mode only (ray mode pushes them rank to engine)."""
        if self.local is None:
            raise RuntimeError("named_weights: the trainer runs in Ray actors; weights move through tidal.weightsync")
        return self._here(self.local.named_weights)
