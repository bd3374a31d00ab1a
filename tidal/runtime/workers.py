"""The role classes that run as Ray actors (placement.mode=ray), and the driver's proxy to
an engine actor.

`EngineWorker` is one disaggregated engine replica (a trainer rank, `TrainerWorker`, is in
trainer_group.py; both receive weights as `SyncReceiver`s). They are plain classes:
`placement.py` wraps them with `ray.remote`, and the trainer rank is also what local mode
builds in the driver, so the two modes run the same code. `RemoteEngine` makes an engine actor look like an Engine to
the router. `RewardWorker` runs reward functions; `RewardActors` is how the reward scorer
starts and replaces those actors.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tidal.config import RewardConfig, TidalConfig
from tidal.engines.base import EngineBase
from tidal.engines.factory import build_engine
from tidal.envs.base import optional
from tidal.monitor import trace
from tidal.rewards.pool_process import ProcessPool
from tidal.runtime.bootstrap import PeerRole
from tidal.runtime.handles import RoleDied
from tidal.runtime.tasks import build_task
from tidal.types import GenerationRequest, GenerationResult
from tidal.weightsync import BroadcastGroup, DiskSync, receive_into
from tidal.weightsync.sliced import receive_into_engine

log = logging.getLogger("tidal")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def set_threads(num_cpus: float) -> None:
    """An actor uses the cores it reserved, not every core of the node: on a shared node
    torch's default (one thread per core in each process) oversubscribes."""
    torch.set_num_threads(max(1, round(num_cpus)))


def make_engine(cfg: TidalConfig, kind: str, model_dir: str | Path, pad_token_id: int, log_dir: str | Path | None):
    return build_engine(kind, cfg.engine, model_dir, dtype=cfg.engine_dtype(), device=cfg.model.resolved_device(),
                        pad_token_id=pad_token_id, seed=cfg.run.seed, log_dir=log_dir)


class SyncReceiver(PeerRole):
    """The receiving end of weight sync, for whatever holds an engine (and a peer's source or new
    replica in a bootstrap: PeerRole)."""

    engine = None
    _group = None
    _shard = None  # weight_sync=shard: this side of the transfer plan

    def sync_join(self, host: str, port: int, rank: int, world_size: int, name: str, backend: str,
                  timeout_s: float) -> None:

        if self._group is not None:
            self._group.close()
        self._group = BroadcastGroup.join(host, port, rank, world_size, backend=backend, timeout_s=timeout_s, name=name)

    def sync_recv(self) -> dict:
        return receive_into(self.engine, self._group)

    def slices_join(self, host: str, port: int, rank_offset: int, world_size: int, name: str, backend: str,
                    timeout_s: float, role: str) -> None:
        """Join the slice group (placement.weight_sync=slices) as ranks rank_offset.. of this
        replica: a tensor-parallel vLLM engine's workers join themselves, one per rank
        (vllm_transfer.py); any other engine joins here as one rank."""
        self._role = role
        if hasattr(self.engine, "join_weight_group"):
            self.engine.join_weight_group(host, port, world_size, rank_offset, name, timeout_s, role, backend)
            return
        self.sync_join(host, port, rank_offset, world_size, name, backend, timeout_s)

    def slices_recv(self) -> dict:
        if hasattr(self.engine, "receive_slices"):
            return self.engine.receive_slices()
        out = receive_into_engine(self.engine, self._group, self._role)
        return {k: out[k] for k in ("version", "bytes", "checksum_ok")}

    def shard_join(self, host: str, port: int, rank: int, world_size: int, name: str, backend: str, timeout_s: float,
                   engine_tp: int = 1, role: str = "", **_) -> None:
        """weight_sync=shard: join the group of the trainer ranks and the engine ranks; the transfer
        plan arrives from trainer rank 0. `engine_tp` > 1 (vLLM): the engine's workers join
        themselves, as ranks `rank`.. (tidal/engines/vllm_transfer.py), each receiving its slices."""
        from tidal.weightsync import BroadcastGroup
        from tidal.weightsync.shard import ShardReceiver, share_plan

        if self._group is not None:
            self._group.close()
            self._group = None
        if engine_tp > 1:
            self._shard = None
            self.engine.join_weight_group(host, port, world_size, rank, name, timeout_s, role, backend, shard=True)
            return
        self._group = BroadcastGroup.join(host, port, rank, world_size, backend=backend, timeout_s=timeout_s, name=name)
        self._shard = ShardReceiver(self._group, share_plan(self._group, None))

    def shard_recv(self) -> dict:
        if self._shard is not None:
            return self._shard.recv(self.engine)
        out = self.engine.receive_slices()  # each TP rank received its own pieces: the busiest rank's bytes
        reports = out["reports"]
        return {"version": out["version"], "bytes": max(r["bytes"] for r in reports),
                "raw_bytes": max(r["raw_bytes"] for r in reports),
                "mismatched": sorted({n for r in reports for n in r["mismatched"]}), "bytes_total": out["bytes"]}

    def load_weights_file(self, path: str) -> int:
        return DiskSync(Path(path).parent).load_into(self.engine, path)["version"]

    def update_weights(self, version: int, tensors) -> int:
        self.engine.update_weights(version, tensors)
        return self.engine.version

    def node(self) -> str:
        """The Ray node this role runs on ("" outside Ray)."""
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""

    def engine_version(self) -> int:
        return self.engine.version

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return await self.engine.generate(requests)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()


class EngineWorker(SyncReceiver):
    """One disaggregated engine replica."""

    def __init__(self, cfg: TidalConfig, kind: str, model_dir: str, pad_token_id: int, log_dir: str | None = None,
                 num_cpus: float = 0.0):
        if num_cpus:
            set_threads(num_cpus)
        self.engine = make_engine(cfg, kind, model_dir, pad_token_id, log_dir)

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> tuple[str, int]:
        ip = node_ip()
        return ip, free_port(ip)


class RemoteEngine(EngineBase):
    """An engine actor (or a colocated trainer rank's engine) as an Engine for the router.
    `version` is what the last weight sync delivered; the driver never asks the actor."""

    def __init__(self, handle, name: str, timeout_s: float = 600.0, version: int = 0):
        self.handle, self.name, self.timeout_s = handle, name, timeout_s
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return await self.handle.acall("generate", requests, timeout_s=self.timeout_s)

    def update_weights(self, version: int, tensors) -> None:
        self._version = self.handle.call("update_weights", version, dict(tensors), timeout_s=self.timeout_s)

    def pause(self) -> None:
        self.handle.call("pause", timeout_s=self.timeout_s)

    def resume(self) -> None:
        self.handle.call("resume", timeout_s=self.timeout_s)


class RewardWorker:
    """A reward actor (placement.reward_workers). Its rewards run in a worker process of its
    own (tidal/rewards/pool_process.py, one process, with every limit of the local pool):
    a reward that crashes, leaks, forks or prints does so there, and this actor replaces the
    process in a fraction of a second, its other calls sent again, where Ray restarting the
    actor took seconds a crash. What the process printed, and the pool's own messages, travel
    back with the answers into the driver's train.log. A reward that cannot be imported fails
    the actor's start, naming its key. The driver's `RayScorer` kills an actor that stops
    answering altogether and starts another in its place."""

    def __init__(self, specs: list[dict], timeout_s: float, num_cpus: float = 0.0, reward_cfg: dict | None = None):
        import traceback


        if num_cpus:
            set_threads(num_cpus)
        self.lines = _LogLines()
        self.pool, self.failed = None, None
        cfg = RewardConfig(**{**(reward_cfg or {}), "timeout_s": timeout_s})
        try:
            self.pool = ProcessPool(specs, cfg, n_workers=1)
        except Exception as e:  # noqa: BLE001 - answered by `ready` in our words, not as Ray's actor-death error
            self.failed = {"failed": str(e) if isinstance(e, ValueError) else f"{type(e).__name__}({e})",
                           "traceback": traceback.format_exc()}

    def ready(self) -> dict:
        """{"pid", "kinds"}, or {"failed": why, "traceback"} when a reward could not be loaded."""
        return self.failed or {"pid": os.getpid(), "kinds": self.pool.kinds}

    async def run_batch(self, msg: dict):
        """Calls {"inputs", "calls": [(id, spec, [input index], lane)]}, answered as a stream of
        bunches {"results": [(id, results, hung)], "log": [(logger, level, message)]} in the
        order they finish (sync calls run in the order given)."""
        inputs = msg["inputs"]
        futures = self.pool.submit([(c[1], [inputs[i] for i in c[2]]) for c in msg["calls"]],
                                   asyncio.get_running_loop())  # its own pool picks the lanes
        ids = {f: c[0] for f, c in zip(futures, msg["calls"])}
        while ids:
            done, _ = await asyncio.wait(ids, return_when=asyncio.FIRST_COMPLETED)
            yield {"results": [(ids.pop(f), f.result(), False) for f in done], "log": self.lines.take()}

    def pid(self) -> int:
        return os.getpid()

    def worker_pids(self) -> list[int]:
        """The reward worker processes of this actor."""
        return self.pool.pids()


class _LogLines(logging.Handler):
    """The `tidal.rewards` messages of this actor (its worker's output among them), kept for
    the next answer to carry to the driver; at most MAX, the oldest dropped and counted."""

    MAX = 4096

    def __init__(self):
        super().__init__(logging.INFO)
        self._lines: collections.deque = collections.deque()
        self._dropped = 0
        self._lock_lines = threading.Lock()
        log = logging.getLogger("tidal.rewards")
        log.setLevel(logging.INFO)
        log.propagate = False  # not on the actor's stderr (Ray would print it on the driver's console)
        log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock_lines:
            if len(self._lines) >= self.MAX:
                self._lines.popleft()
                self._dropped += 1
            self._lines.append((record.name, record.levelno, record.getMessage()))

    def take(self) -> list:
        with self._lock_lines:
            out, self._lines = list(self._lines), collections.deque()
            if self._dropped:
                out.append(("tidal.rewards", logging.WARNING, f"{self._dropped} reward log lines were dropped"))
                self._dropped = 0
            return out


@dataclass
class RewardActors:
    """The reward-worker slots of a Ray run, as `build_scorer(..., ray_handles=...)` takes them:
    `spawn(i, specs, timeout_s)` starts the RewardWorker actor of slot i in its placement-group
    bundle (the scorer calls it at start and to replace an actor it killed or lost)."""

    count: int
    start_actor: Callable[[int, list, float], Any]
    live: dict[int, Any] = field(default_factory=dict)  # slot -> the actor now in it

    def spawn(self, i: int, specs: list, timeout_s: float):
        self.live[i] = self.start_actor(i, specs, timeout_s)
        return self.live[i]

    def kill_all(self) -> None:
        import ray

        for a in self.live.values():
            with contextlib.suppress(Exception):  # already gone
                ray.kill(a, no_restart=True)


class EnvWorker:
    """Hosts environments (`placement.env_workers`): an episode's environment is built here
    at `reset` and lives here until the rollout closes it, so environment work (tools,
    sandboxes, per-turn rewards) leaves the driver. The task is built from the config in the
    worker; the task's reward functions still score in the driver's reward pool."""

    def __init__(self, cfg: TidalConfig, num_cpus: float = 0.0):
        if num_cpus:
            set_threads(num_cpus)
        self.task = build_task(cfg.task)
        self.envs: dict[str, object] = {}
        if cfg.run.trace and not trace.enabled():
            trace.enable("env worker")

    async def reset(self, key: str, row: dict, seed: int) -> dict:
        env = self.task.make_env(row, seed)
        self.envs[key] = env
        async with trace.async_span("env.reset", key):
            messages = await env.reset()
        return {"messages": messages, "tools": optional(env, "tools") or None, "sampling": optional(env, "sampling")}

    async def step(self, key: str, action):
        async with trace.async_span("env.step", key):
            return await self.envs[key].step(action)

    def drain_trace(self) -> list[dict]:
        """This process's spans since the last call (`run.trace`)."""
        return trace.drain()

    async def run_agent(self, key: str, row: dict, seed: int, base_url: str, api_key: str):
        """An agent environment's whole episode, here: the agent calls the driver's gateway."""
        env = self.task.make_env(row, seed)
        self.envs[key] = env
        return await env.run_agent(base_url, api_key)

    async def close(self, key: str) -> None:
        env = self.envs.pop(key, None)
        close = optional(env, "close") if env is not None else None
        if close is not None:
            await close()

    def live(self) -> int:
        return len(self.envs)

    def pid(self) -> int:
        return os.getpid()


class RemoteEnvs:
    """`make_env` for environments hosted by env workers: each episode's environment is
    placed on the worker with the fewest live episodes and stays there (its state lives
    there). Errors come back as the environment's own exceptions (a RewardError stays one).

    A worker that dies is replaced (`respawn(i)` starts a new actor in its slot), up to
    `max_restarts` times in a run, each logged. A worker that hangs (SIGSTOP, a deadlock) is
    found by a ping: a call pending `ping_s` makes the pool ping its worker (one ping per worker
    at a time), and a worker that does not answer within `ping_s` is killed, so the calls
    waiting on it see it die and it is replaced the same way. Episodes whose environment lived on it end
    `env_error` (their state is gone); a call that starts an episode (`reset`, `run_agent`) is
    retried on the replacement, since nothing had happened yet."""

    STARTS = ("reset", "run_agent")  # calls that may be retried on a replacement

    def __init__(self, handles: list, name: str, timeout_s: float = 600.0, agent: str | None = None,
                 respawn: Callable[[int], Any] | None = None, max_restarts: int = 3, ping_s: float = 30.0):
        self.handles, self.name, self.timeout_s, self.ping_s = handles, name, timeout_s, ping_s
        self._pinging: dict[int, asyncio.Future] = {}
        self.agent = agent  # task.agent: the task's environment is an agent (RemoteEnv.run_agent)
        self.live = [0] * len(handles)
        self.served = [0] * len(handles)  # episodes started, per worker
        self.respawn, self.max_restarts, self.restarts = respawn, max_restarts, 0
        self.restart_events: list[dict] = []  # replacements not yet in RUN/events.jsonl (health.role_restarts)
        self._replacing: dict[int, asyncio.Future] = {}
        self._ids = iter(range(1 << 62))

    def make_env(self, row: dict, seed: int = 0) -> RemoteEnv:
        return RemoteEnv(self, row, seed)

    async def call(self, i: int, method: str, *args):
        handle = self.handles[i]
        try:
            return await self._watched(i, handle, handle.acall(method, *args, timeout_s=self.timeout_s))
        except RoleDied:
            if not await self._replace(i, handle) or method not in self.STARTS:
                raise
        return await self.handles[i].acall(method, *args, timeout_s=self.timeout_s)

    async def _watched(self, i: int, handle, call):
        """Await `call` on worker i, pinging the worker whenever the call has been pending for
        `ping_s`; a worker that does not answer its ping is killed (the call then fails as
        RoleDied)."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.ping_s)
                if done:
                    return task.result()
                if not await self._answers(i, handle):
                    # the call ends with RayActorError → RoleDied, or its own timeout
                    return await asyncio.wait_for(asyncio.shield(task), self.ping_s * 3)
        finally:
            if not task.done():
                task.cancel()

    async def _answers(self, i: int, handle) -> bool:
        """Whether worker i answers a ping within ping_s; one that does not is killed, once."""
        if i in self._pinging:
            return bool(await asyncio.shield(self._pinging[i]))
        fut = asyncio.get_running_loop().create_future()
        self._pinging[i] = fut
        try:
            await handle.acall("pid", timeout_s=self.ping_s)
            fut.set_result(True)
        except Exception as e:  # noqa: BLE001 - no answer, for whatever reason, is the finding
            log.warning("env worker %d did not answer a ping within %g s (%s: %s): killed as hung; it is replaced "
                        "as a dead one is", i, self.ping_s, type(e).__name__, e)
            with contextlib.suppress(Exception):
                handle.kill()
            fut.set_result(False)
        finally:
            del self._pinging[i]
        return fut.result()

    async def _replace(self, i: int, dead) -> bool:
        """Replace the dead worker of slot i (once, however many calls saw it die); True when
        slot i holds a live replacement."""
        if self.handles[i] is not dead:
            return True  # replaced already
        if i in self._replacing:
            return bool(await asyncio.shield(self._replacing[i]))
        if self.respawn is None or self.restarts >= self.max_restarts:
            log.error("env worker %d died and is not replaced (run.max_restarts=%d, %d used)", i, self.max_restarts,
                      self.restarts)
            return False
        self.restarts += 1
        fut = asyncio.get_running_loop().create_future()
        self._replacing[i] = fut
        try:
            self.handles[i] = await asyncio.to_thread(self.respawn, i)
            with contextlib.suppress(Exception):
                dead.kill()
            msg = (f"env worker {i} died; replaced (restart {self.restarts} of run.max_restarts={self.max_restarts}); "
                   "the episodes it hosted ended env_error")
            log.warning("%s", msg)
            self.restart_events.append({"role": f"env worker {i}", "restart": self.restarts,
                                        "max_restarts": self.max_restarts, "message": msg})
            fut.set_result(True)
        except Exception as e:  # noqa: BLE001 - a failed replacement is logged; the calls see the death
            log.error("replacing env worker %d failed: %s(%s)", i, type(e).__name__, e)
            fut.set_result(False)
        finally:
            del self._replacing[i]
        return fut.result()


class RemoteEnv:
    """One episode's environment on an env worker, behind the Env protocol."""

    def __init__(self, pool: RemoteEnvs, row: dict, seed: int):
        self.pool, self.row, self.seed, self.name = pool, row, seed, pool.name
        self.key = f"env-{next(pool._ids)}"
        self.worker: int | None = None
        self.tools, self.sampling = None, None
        self.agent = bool(pool.agent)
        self.agent_path = pool.agent or pool.name

    def _place(self) -> int:
        i = min(range(len(self.pool.handles)), key=lambda j: (self.pool.live[j], j))
        self.worker = i
        self.pool.live[i] += 1
        self.pool.served[i] += 1
        return i

    async def run_agent(self, base_url: str, api_key: str):
        """The agent runs on the env worker (its calls reach the gateway over HTTP)."""
        return await self.pool.call(self._place(), "run_agent", self.key, self.row, self.seed, base_url, api_key)

    async def reset(self):
        i = self._place()
        opened = await self.pool.call(i, "reset", self.key, self.row, self.seed)
        self.tools, self.sampling = opened["tools"], opened["sampling"]
        return opened["messages"]

    async def step(self, action):
        return await self.pool.call(self.worker, "step", self.key, action)

    async def close(self) -> None:
        """Always called by the rollout (also after an error or a timeout): the worker closes
        and forgets the environment."""
        if self.worker is None:
            return
        i, self.worker = self.worker, None
        self.pool.live[i] -= 1
        await self.pool.call(i, "close", self.key)
