"""A router over engine replicas, itself an Engine: the rest of tidal sees one engine.

Dispatch is least-loaded (requests in flight, counting this call's own assignments),
except that the turns of one episode are sticky: requests with the same `session_id` go
to the replica that served the session before, whose prefix cache holds the
conversation (vLLM and SGLang reuse it; the cost of a miss is a re-prefill, not an
error). Back-pressure: a replica never has more than `max_inflight` requests in flight;
callers wait for room. A replica that raises or times out is marked down and skipped,
and the requests it held are re-sent to the others, so every request is answered
exactly once (with tidal's counter-based sampling noise the re-sent request even
produces the same tokens). `mark_up` brings a restarted replica back.

Callers may sit on different event loops at once (the rollout's, and the gateway's server
thread): the router's state is guarded by a thread lock and waiting for room wakes each
waiter on its own loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

from tidal.engines.base import EngineBase
from tidal.types import GenerationRequest, GenerationResult

log = logging.getLogger("tidal")


class RouterError(RuntimeError):
    """No replica can take the requests."""


class Router(EngineBase):
    def __init__(self, replicas: Sequence, names: Sequence[str] | None = None, max_inflight: int = 512,
                 timeout_s: float = 600.0, max_sessions: int = 1_000_000):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        self.names = list(names) if names else [f"replica{i}" for i in range(len(replicas))]
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self.up = [True] * len(replicas)
        self.down_reason: list[str] = [""] * len(replicas)
        self.inflight = [0] * len(replicas)
        self.served = [0] * len(replicas)  # requests answered, per replica
        self.resent = 0  # requests re-sent after a replica failed
        self.sessions: OrderedDict[str, int] = OrderedDict()  # session → replica, least recently used first
        self.max_sessions = max_sessions
        self._lock = threading.Lock()  # guards inflight, sessions and the waiters
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    # -- the Engine protocol -----------------------------------------------------------------
    @property
    def version(self) -> int:
        """The oldest weight version any live replica holds."""
        return min(r.version for r, up in zip(self.replicas, self.up) if up) if any(self.up) else -1

    def pause(self) -> None:
        for r in self.replicas:
            r.pause()

    def resume(self) -> None:
        for r in self.replicas:
            r.resume()

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        for i, r in enumerate(self.replicas):
            if not self.up[i]:
                continue
            try:
                r.update_weights(version, tensors)
            except Exception as e:  # noqa: BLE001 - a stale replica must not serve: take it out
                self.mark_down(i, f"update_weights v{version} raised {type(e).__name__}({e})")
        if not any(self.up):
            raise RouterError(f"weight update v{version}: every replica is down ({self._down_summary()})")

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("router: request ids of one call must be unique")
        results: dict[str, GenerationResult] = {}
        pending = list(requests)
        while pending:
            plan = self._assign(pending)
            outcomes = await asyncio.gather(*(self._send(i, reqs) for i, reqs in plan.items()), return_exceptions=True)
            pending = []
            for (i, reqs), out in zip(plan.items(), outcomes):
                if isinstance(out, BaseException):
                    if not isinstance(out, Exception):
                        raise out  # cancellation and the like are not a replica failure
                    self.mark_down(i, f"generate raised {type(out).__name__}({out})")
                    for r in reqs:
                        self.sessions.pop(r.session_id or r.request_id, None)
                    self.resent += len(reqs)
                    log.warning("router: re-sending %d requests of %s to the other replicas", len(reqs), self.names[i])
                    pending += reqs
                else:
                    for r, res in zip(reqs, out):
                        results[r.request_id] = res
                    self.served[i] += len(reqs)
        return [results[i] for i in ids]

    # -- replicas ----------------------------------------------------------------------------
    def mark_down(self, i: int, reason: str) -> None:
        if self.up[i]:
            log.warning("router: %s marked down: %s", self.names[i], reason)
        self.up[i], self.down_reason[i] = False, reason
        self._wake_all()  # requests waiting for this replica's room learn that it is gone

    def replace(self, i: int, replica) -> None:
        """Put `replica` in slot `i` (a restarted one). It stays down until `mark_up` (it has
        no weights yet), and the sessions that were sticky to the old one are forgotten (its
        prefix cache went with it)."""
        with self._lock:
            if not 0 <= i < len(self.replicas):
                raise IndexError(f"router: no replica {i} (replicas 0..{len(self.replicas) - 1})")
            self.replicas[i] = replica
            self.up[i] = False
            self.down_reason[i] = self.down_reason[i] or "replaced"
            for session in [s for s, j in self.sessions.items() if j == i]:
                del self.sessions[session]

    def mark_up(self, i: int) -> None:
        """A restarted replica (holding current weights) takes requests again."""
        self.up[i], self.down_reason[i] = True, ""

    def _down_summary(self) -> str:
        return "; ".join(f"{n}: {why}" for n, why, up in zip(self.names, self.down_reason, self.up) if not up)

    # -- dispatch ----------------------------------------------------------------------------
    def _assign(self, requests: list[GenerationRequest]) -> dict[int, list[GenerationRequest]]:
        with self._lock:
            return self._assign_locked(requests)

    def _assign_locked(self, requests: list[GenerationRequest]) -> dict[int, list[GenerationRequest]]:
        live = [i for i, up in enumerate(self.up) if up]
        if not live:
            raise RouterError(f"every replica is down ({self._down_summary()})")
        load = {i: self.inflight[i] for i in live}
        plan: dict[int, list[GenerationRequest]] = {}
        for r in requests:
            key = r.session_id or r.request_id
            i = self.sessions.get(key)
            if i is None or not self.up[i]:
                i = min(live, key=lambda j: (load[j], j))  # least loaded; ties to the lowest index
            self.sessions[key] = i
            self.sessions.move_to_end(key)
            load[i] += 1
            plan.setdefault(i, []).append(r)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        return plan

    def _wake_all(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_settle, fut)
            except RuntimeError:  # that loop is closed: its waiter is gone with it
                pass

    async def _take_room(self, i: int, need: int) -> None:
        """Wait until replica i has room for `need` more requests, then count them in."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if not self.up[i]:
                    raise RouterError(f"{self.names[i]} went down while requests waited for it")
                if self.inflight[i] + need <= self.max_inflight:
                    self.inflight[i] += need
                    return
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            await fut

    def _give_room(self, i: int, n: int) -> None:
        with self._lock:
            self.inflight[i] -= n
        self._wake_all()

    async def _send(self, i: int, reqs: list[GenerationRequest]) -> list[GenerationResult]:
        """Send in chunks that fit the replica's room, waiting for room (back-pressure)."""
        out: list[GenerationResult] = []
        for start in range(0, len(reqs), self.max_inflight):
            chunk = reqs[start : start + self.max_inflight]
            await self._take_room(i, len(chunk))
            try:
                res = await asyncio.wait_for(self.replicas[i].generate(chunk), self.timeout_s)
            except TimeoutError:
                raise RouterError(f"{self.names[i]} did not answer {len(chunk)} requests within {self.timeout_s:g} s") from None
            finally:
                self._give_room(i, len(chunk))
            if len(res) != len(chunk):
                raise RouterError(f"{self.names[i]} returned {len(res)} results for {len(chunk)} requests")
            out += res
        return out


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
