"""The reward scorers: user reward code runs where a hung call can be killed.

`build_scorer(specs, cfg, ray_handles=...)` gives one of:

- `ProcessScorer` (reward.isolation=process, the default): `reward.workers` worker processes
  (`python -m tidal.rewards.worker`, each its own process group) that import the rewards once
  at start; the scorer fails at start, naming the key, when one cannot be imported.
- `RayScorer` (the same, placement.reward_workers Ray actors in ray mode).
- `InlineScorer` (reward.isolation=inline): the same adapters in the caller's event loop, for
  breakpoints. Async rewards are bounded by asyncio timeouts; a synchronous reward that hangs
  there hangs the rollout (nothing can stop a Python thread from outside).

How the pools work. `score(inputs)` turns each reward into calls: one per input for the
per-sample forms (tidal, veRL), one per group for TRL's batched form. Calls go to the
least-loaded worker; each worker serves up to `reward.max_concurrency` async calls at once
and runs synchronous ones one at a time, in order. Every call in flight has a deadline
`reward.timeout_s + GRACE_S`, counted from when it starts (a synchronous call starts when the
one before it on its worker answers; the worker's lane is first-in first-out). A worker that
reports a hung call, or misses a deadline, is killed (SIGKILL to its process group, so a
subprocess the reward started dies with it; `ray.kill` for an actor) and replaced; the call
that hung ends `timeout`; the other calls it held are sent again. A call lost while it ran
(its worker died, or was killed for another call) is retried once; lost a second time it
ends `reward_error`. A worker that dies on its own (a segfault, `os._exit`) is replaced the
same way. Nothing waits forever: a replacement that cannot start fails the calls waiting
for it, and `close()` stops every worker.

The two backends: worker processes in tidal/rewards/pool_process.py, Ray actors in
tidal/rewards/pool_ray.py; both build on `_PoolScorer` here.

IPC is batched: the calls of one `score` sent to one worker travel in one message (inputs
once, whatever the number of rewards), and the answers that finish together come back in one.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from typing import Any

from tidal.rewards.contract import RewardInput, RewardOutcome
from tidal.rewards.forms import Failed, LoadedReward, Result, combine, default_keys, reward_meta, spec_data, timed_out

log = logging.getLogger("tidal.rewards")

GRACE_S = 0.5  # the driver's deadline past reward.timeout_s: the worker's own answer normally comes first
START_TIMEOUT_S = 120.0  # a worker imports the rewards (torch, math-verify, a model) before it is ready
SYNC_DEPTH = 32  # synchronous calls queued on one process worker: amortizes IPC, keeps load balanced
RAY_ACTOR_CONCURRENCY = 64  # placement's max_concurrency of a reward actor
MAX_ZOMBIES = 64  # exited orphans a worker may hold before it is recycled (tidal/rewards/limits.py, zombies)
MAX_UNEXPLAINED = 3  # crashes a call may wait through with no call charged, before it ends reward_error


class RewardLoadError(ValueError):
    """A reward could not be loaded in a worker; the message names the key and what failed."""


def build_scorer(specs: list, cfg, *, ray_handles=None, keys: list[str] | None = None):
    """The scorer for `specs` (RewardSpec, in order) under `cfg` (RewardConfig). `ray_handles`:
    the `RewardActors` of placement (Roles.reward_handles in ray mode); None or empty: local
    worker processes. `keys` names each spec's config key in errors (default: `task.reward` for
    one spec, `task.rewards[i].fn` for several; see `spec_keys`). Blocks until the workers are
    ready; raises RewardLoadError (a ValueError) naming the key when a reward cannot be loaded."""
    keys = keys or default_keys(len(specs))
    data = [spec_data(s, k) for s, k in zip(specs, keys)]
    if cfg.isolation == "inline":
        return InlineScorer(data, cfg)
    if ray_handles:
        return RayScorer(data, cfg, ray_handles)
    return ProcessScorer(data, cfg)


def spec_keys(task_cfg) -> list[str]:
    """The config key of each of `task_cfg.reward_specs(...)`: `task.rewards[i].fn`, or `task.reward`."""
    if task_cfg.rewards:
        return [f"task.rewards[{i}].fn" for i in range(len(task_cfg.rewards))]
    return ["task.reward"]


def _calls_of(rewards: list[LoadedReward], inputs: list[RewardInput]) -> list[tuple[int, list[int]]]:
    """(reward index, positions of its inputs) per call: a group for TRL's form, else one input."""
    out = []
    for si, r in enumerate(rewards):
        if r.form == "trl":
            out.append((si, list(range(len(inputs)))))
        else:
            out.extend((si, [j]) for j in range(len(inputs)))
    return out


def _outcomes(rewards: list[LoadedReward], inputs: list[RewardInput], calls, answers) -> list[RewardOutcome]:
    per_input: list[list[Result | None]] = [[None] * len(rewards) for _ in inputs]
    for (si, rows), results in zip(calls, answers):
        for j, res in zip(rows, results):
            per_input[j][si] = res
    return [combine(rewards, inp, res) for inp, res in zip(inputs, per_input)]  # type: ignore[arg-type]


# -- inline ------------------------------------------------------------------------------------
class InlineScorer:
    """Rewards in the caller's event loop (reward.isolation=inline)."""

    def __init__(self, specs: list[dict[str, Any]], cfg):
        from tidal.rewards.worker import RewardHost

        self.host = RewardHost(specs, cfg.timeout_s, sync_in_thread=False)
        self.rewards = self.host.rewards
        self.per_group = any(r.form == "trl" for r in self.rewards)

    async def score(self, inputs: list[RewardInput]) -> list[RewardOutcome]:
        if not inputs:
            return []
        calls = _calls_of(self.rewards, inputs)
        runs = [self.host.run(si, [inputs[j] for j in rows]) for si, rows in calls]
        answers = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
        return _outcomes(self.rewards, inputs, calls, [a for a, _ in answers])

    async def close(self) -> None:
        await self.host.close()


# -- the pools ---------------------------------------------------------------------------------
class _Call:
    __slots__ = ("deadline", "finished", "future", "id", "inputs", "is_async", "loop", "lost", "slot", "solo", "spec",
                 "unexplained")

    def __init__(self, call_id: int, spec: int, inputs: list[RewardInput], is_async: bool, loop, future):
        self.id, self.spec, self.inputs, self.is_async = call_id, spec, inputs, is_async
        self.loop, self.future = loop, future
        self.lost = 0  # times its worker was lost while it ran (Ray actors)
        self.unexplained = 0  # crashes of its worker, while it waited there, that no call running was charged with
        self.solo = False  # suspected of a crash with others: it runs again alone, which tells
        self.slot: _Slot | None = None  # the worker it is in flight on
        self.deadline: float | None = None
        self.finished = False  # answered (or its caller went away)


class _Slot:
    """One worker (process or actor) and the calls in flight on it."""

    def __init__(self, index: int, generation: int):
        self.index, self.generation = index, generation
        self.ready = False
        self.dead = False
        self.pid: int | None = None
        self.inflight: dict[int, _Call] = {}
        self.lane: deque[_Call] = deque()  # synchronous calls, in the order the worker runs them
        self.n_async = 0
        self.transport: Any = None
        self.calls = 0  # answered
        self.rss = 0  # bytes, as the worker last reported
        self.zombies = 0  # exited orphans it holds, as it last reported (tidal/rewards/limits.py)
        self.retiring = False  # recycled: takes no new call, ends once its calls are answered
        self.reserved: int | None = None  # kept free for this solo call: takes no other
        self.solo: int | None = None  # the solo call in flight on it: it takes no other

    def __repr__(self) -> str:
        return f"reward worker {self.index}" + (f" (pid {self.pid})" if self.pid else "")


class _PoolScorer:
    """Dispatch, deadlines, kills and retries, over a transport (processes or Ray actors)."""

    sync_depth = SYNC_DEPTH
    # True: sync calls go to a worker only while its lane is empty (those of one dispatch
    # travel together), for a transport that keeps order only within one message.
    lane_exclusive = False
    # The worker tells which synchronous call was running when it crashed (process workers
    # share that with the driver); without it, every call that may have run is a suspect.
    exact_crashes = True
    grace_s = GRACE_S

    def __init__(self, specs: list[dict[str, Any]], cfg, n_workers: int, max_async: int):
        self.specs = specs
        self.rewards = reward_meta(specs)  # names and weights; the code itself is imported in the workers
        self.per_group = any(r.form == "trl" for r in self.rewards)
        self.timeout_s = float(cfg.timeout_s)
        self.max_async = max_async
        self.kinds: list[bool] | None = None  # per reward: async (from the first worker that started)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._heap: list = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._pending: deque[_Call] = deque()
        self._wake: list[tuple[Any, Any, Any]] = []  # (loop, future, value) to set once the lock is let go
        self._closed = False
        self._dispatch_soon = False
        self._broken = ""  # why no worker is left
        self._generation = itertools.count()
        self.slots: list[_Slot] = []
        self.served: list[int] = [0] * n_workers  # calls answered, per worker slot
        self.restarts = 0
        self.recycled = 0  # workers retired after reward.worker_max_calls calls or reward.worker_max_rss_mb
        self.crashes = 0  # calls charged with the crash of their worker
        self.max_calls = int(getattr(cfg, "worker_max_calls", 0) or 0)
        self.max_rss = int(getattr(cfg, "worker_max_rss_mb", 0) or 0) << 20
        self._retiring: list[_Slot] = []
        self._starting = True  # a worker that fails now fails build_scorer
        self._timer = threading.Thread(target=self._run_timer, name="tidal-reward-deadlines", daemon=True)
        self._timer.start()
        with self._lock:
            for i in range(n_workers):
                self.slots.append(self._new_slot(i))
            deadline = time.monotonic() + START_TIMEOUT_S
            while not all(s.ready or s.dead for s in self.slots) and not self._broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._broken = f"the reward workers did not start within {START_TIMEOUT_S:g} s"
                    break
                self._cond.wait(left)
            self._starting = False
            broken = self._broken
        if broken:
            self.shutdown()
            raise RewardLoadError(broken)

    # -- transport (subclasses) -----------------------------------------------------------
    def _start(self, slot: _Slot) -> None:
        raise NotImplementedError

    def _send(self, slot: _Slot, calls: list[_Call]) -> None:
        raise NotImplementedError

    def _kill(self, slot: _Slot) -> None:
        raise NotImplementedError

    def _stop(self, slots: list[_Slot]) -> None:
        raise NotImplementedError

    # -- the caller's side ------------------------------------------------------------------
    async def score(self, inputs: list[RewardInput]) -> list[RewardOutcome]:
        if not inputs:
            return []
        loop = asyncio.get_running_loop()
        plan = _calls_of(self.rewards, inputs)
        kinds = self.kinds or [False] * len(self.rewards)
        calls = [_Call(next(self._ids), si, [inputs[j] for j in rows], kinds[si], loop, loop.create_future())
                 for si, rows in plan]
        with self._lock:
            self._pending.extend(calls)
            soon, self._dispatch_soon = not self._dispatch_soon, True
        if soon:  # the calls of every `score` started in this turn of the loop leave together
            loop.call_soon(self._dispatch_now)
        try:
            answers = [await calls[0].future] if len(calls) == 1 else await asyncio.gather(*(c.future for c in calls))
        except asyncio.CancelledError:
            with self._lock:
                for c in calls:
                    c.finished = True  # in flight it stays on its worker's books until it answers or its deadline
            raise
        return _outcomes(self.rewards, inputs, plan, answers)

    def submit(self, calls: list[tuple[int, list[RewardInput]]], loop) -> list[asyncio.Future]:
        """Calls (reward index, inputs) as they are, without combining: a future per call for
        its list of Results, set in `loop` (a Ray reward actor serves the driver's calls so)."""
        kinds = self.kinds or [False] * len(self.rewards)
        cs = [_Call(next(self._ids), spec, inputs, kinds[spec], loop, loop.create_future()) for spec, inputs in calls]
        with self._lock:
            self._pending.extend(cs)
            self._dispatch()
            self._flush_wakes()
        return [c.future for c in cs]

    def _dispatch_now(self) -> None:
        with self._lock:
            self._dispatch_soon = False
            self._dispatch()
            self._flush_wakes()

    def pids(self) -> list[int]:
        """Process ids of the live workers, by slot."""
        with self._lock:
            return [s.pid for s in self.slots if s.ready and not s.dead and s.pid is not None]

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and end every waiting call."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            slots = list(self.slots) + self._retiring
            for c in list(self._pending) + [c for s in slots for c in s.inflight.values()]:
                self._finish(c, _unscored("the reward scorer was closed", len(c.inputs)))
            self._pending.clear()
            self._broken = "the reward scorer was closed"
            for s in slots:
                s.dead = True
            self._cond.notify_all()
            self._flush_wakes()
        self._stop(slots)

    # -- bookkeeping (every method below runs with the lock held) ----------------------------
    def _new_slot(self, index: int) -> _Slot:
        slot = _Slot(index, next(self._generation))
        self._push(time.monotonic() + START_TIMEOUT_S, "start", slot)
        self._start(slot)
        return slot

    def _push(self, when: float, kind: str, obj: Any) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), kind, obj))
        self._cond.notify_all()

    def _finish(self, c: _Call, results: list[Result]) -> None:
        c.slot, c.deadline = None, None
        if not c.finished:
            c.finished = True
            self._wake.append((c.loop, c.future, results))

    def _flush_wakes(self) -> None:
        by_loop: dict[Any, list] = {}
        for loop, fut, value in self._wake:
            by_loop.setdefault(loop, []).append((fut, value))
        self._wake.clear()
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: its caller is gone
                loop.call_soon_threadsafe(_set_results, items)

    def _pick(self, is_async: bool, open_lanes: set[int] | None) -> _Slot | None:
        best = None
        for s in self.slots:
            if not s.ready or s.dead or s.retiring or s.reserved is not None or s.solo is not None:
                continue
            if is_async and s.n_async >= self.max_async:
                continue
            if not is_async and len(s.lane) >= self.sync_depth:
                continue
            if not is_async and open_lanes is not None and s.generation not in open_lanes:
                continue
            if best is None or len(s.inflight) < len(best.inflight):
                best = s
        return best

    def _dispatch(self) -> None:
        if self._broken:
            while self._pending:
                c = self._pending.popleft()
                self._finish(c, _unscored(self._broken, len(c.inputs)))
            return
        now = time.monotonic()
        sends: dict[int, tuple[_Slot, list[_Call]]] = {}
        waiting: deque[_Call] = deque()
        open_lanes = {s.generation for s in self.slots if not s.lane} if self.lane_exclusive else None
        while self._pending:
            c = self._pending.popleft()
            if c.finished:
                continue
            slot = self._solo_slot(c) if c.solo else self._pick(c.is_async, open_lanes)
            if slot is None:
                waiting.append(c)
                continue
            slot.inflight[c.id] = c
            c.slot = slot
            if c.is_async:
                slot.n_async += 1
                self._set_deadline(c, now)
            else:
                slot.lane.append(c)
                if len(slot.lane) == 1:  # it starts now; the others start as the one before answers
                    self._set_deadline(c, now)
            sends.setdefault(slot.generation, (slot, []))[1].append(c)
        self._pending = waiting
        for slot, calls in sends.values():
            self._send(slot, calls)

    def _solo_slot(self, c: _Call) -> _Slot | None:
        """A worker with nothing in flight for a call that must run alone; when none is free,
        the least-loaded one is kept for it (it takes nothing more until it is free)."""
        usable = [s for s in self.slots if s.ready and not s.dead and not s.retiring and s.solo is None
                  and s.reserved in (None, c.id)]
        for s in sorted(usable, key=lambda s: s.reserved != c.id):
            if not s.inflight:
                for other in self.slots:
                    if other.reserved == c.id:
                        other.reserved = None
                s.solo = c.id
                return s
        if usable and not any(s.reserved == c.id for s in self.slots):
            min(usable, key=lambda s: len(s.inflight)).reserved = c.id
        return None

    def _set_deadline(self, c: _Call, start: float) -> None:
        c.deadline = start + self.timeout_s + self.grace_s
        self._push(c.deadline, "call", c)

    def _on_ready(self, slot: _Slot, info: dict) -> None:
        if slot.dead:
            return
        slot.ready, slot.pid = True, info.get("pid")
        if self.kinds is None:
            self.kinds = list(info["kinds"])
        self._cond.notify_all()
        self._dispatch()

    def _on_start_failed(self, slot: _Slot, why: str, traceback: str = "") -> None:
        if slot.dead or slot.ready:
            return
        slot.dead = True
        self._kill(slot)
        if traceback and not self._broken:
            log.warning("reward worker %d failed to load the rewards: %s\n%s", slot.index, why, traceback.rstrip())
        if self._starting:  # build_scorer raises it
            self._broken = self._broken or why
        else:
            log.error("reward worker %d could not be restarted: %s", slot.index, why)
            if not any(not s.dead for s in self.slots):
                self._broken = f"no reward worker is left (the last restart failed: {why})"
        self._cond.notify_all()
        self._dispatch()

    def _on_results(self, slot: _Slot, batch: list, rss: int | None = None) -> None:
        if slot.dead:
            return  # it was killed: these calls were sent again already
        now = time.monotonic()
        hung = False
        if rss is not None:
            slot.rss = rss
        for call_id, results, was_hung in batch:
            c = slot.inflight.pop(call_id, None)
            if c is None:
                continue
            slot.calls += 1
            if slot.solo == c.id:
                slot.solo = None
            if c.is_async:
                slot.n_async -= 1
            else:
                head = bool(slot.lane) and slot.lane[0] is c
                with contextlib.suppress(ValueError):
                    slot.lane.remove(c)
                if head and slot.lane:
                    self._set_deadline(slot.lane[0], now)
            self.served[slot.index] += 1
            hung = hung or was_hung
            self._finish(c, results)
        if hung:  # the worker's sync lane is stuck in user code: only a kill frees it
            self._lose(slot, "its reward worker was killed (another call on it timed out)")
        else:
            self._maybe_retire(slot)
        self._dispatch()

    def _maybe_retire(self, slot: _Slot) -> None:
        """Recycle a worker past reward.worker_max_calls calls or reward.worker_max_rss_mb: a
        replacement starts now, and the old one ends once its calls are answered."""
        if not slot.retiring and not self._closed and (
                (self.max_calls and slot.calls >= self.max_calls) or (self.max_rss and slot.rss > self.max_rss)
                or slot.zombies > MAX_ZOMBIES):
            slot.retiring = True
            self.recycled += 1
            log.info("%s is recycled after %d calls at %.0f MB resident holding %d exited orphans "
                     "(reward.worker_max_calls=%d, reward.worker_max_rss_mb=%d, at most %d orphans)", slot, slot.calls,
                     slot.rss / 2**20, slot.zombies, self.max_calls, self.max_rss >> 20, MAX_ZOMBIES)
            self._retiring.append(slot)
            if self.slots[slot.index] is slot:
                self.slots[slot.index] = self._new_slot(slot.index)
        if slot.retiring and not slot.inflight and not slot.dead:
            slot.dead = True
            self._retiring.remove(slot)
            self._retire(slot)

    def _retire(self, slot: _Slot) -> None:
        """End a recycled worker that has nothing in flight (politely; the transport's own way)."""
        self._kill(slot)

    def _expire(self, c: _Call) -> None:
        """A call past its deadline: it ends `timeout`, its worker is killed and replaced."""
        slot = c.slot
        assert slot is not None
        slot.inflight.pop(c.id, None)
        if c.is_async:
            slot.n_async -= 1
        else:
            with contextlib.suppress(ValueError):
                slot.lane.remove(c)
        self._finish(c, timed_out(self.timeout_s, len(c.inputs), hint=f"{slot} did not answer by its deadline "
                                  f"and was killed"))
        self._lose(slot, "its reward worker was killed (another call on it timed out)")

    def _lose(self, slot: _Slot, why: str, suspects: set[int] | None = None) -> None:
        """`slot` is gone (killed, or crashed when `suspects` is given: the calls that were
        running then) and a replacement starts. A crash with one suspect is that call's: it
        ends `reward_error` naming the crash. Several suspects each run again alone (a solo
        call), which tells. Every other call is sent again as it was: a call never pays for
        another's crash or hang. (A call that waited on crashed workers MAX_UNEXPLAINED times
        with no suspect ends `reward_error`: nothing loops forever.)"""
        if slot.dead:
            return
        slot.dead = True
        self._kill(slot)
        crashed = suspects is not None
        suspects = set() if suspects is None else suspects & set(slot.inflight)
        culprit = next(iter(suspects)) if len(suspects) == 1 else None
        again = []
        for c in sorted(slot.inflight.values(), key=lambda c: c.id):
            c.slot, c.deadline = None, None
            if c.finished:
                continue
            if c.id == culprit:
                self.crashes += 1
                self._finish(c, _unscored(f"{why} while running it: the crash was this call's", len(c.inputs)))
                continue
            if c.id in suspects:
                c.solo = True
            elif crashed and not suspects:
                c.unexplained += 1
                if c.unexplained >= MAX_UNEXPLAINED:
                    self._finish(c, _unscored(f"{why}; its workers crashed {c.unexplained} times while it waited, "
                                              "with no call running", len(c.inputs)))
                    continue
            again.append(c)
        slot.inflight.clear()
        slot.lane.clear()
        slot.n_async = 0
        self._pending.extendleft(reversed(again))
        if slot in self._retiring:
            self._retiring.remove(slot)
        elif not self._closed and self.slots[slot.index] is slot:
            self.restarts += 1
            self.slots[slot.index] = self._new_slot(slot.index)
        self._dispatch()

    def _on_exit(self, slot: _Slot, why: str, running: int | None = None) -> None:
        """A worker process ended by itself (or was killed from outside). `running`: the
        synchronous call it was running, where the worker tells (`exact_crashes`)."""
        if slot.dead:
            return
        if not slot.ready:
            self._on_start_failed(slot, f"the worker exited before it was ready ({why})")
            return
        suspects = {c.id for c in slot.inflight.values() if c.is_async}
        if self.exact_crashes:
            if running is not None:
                suspects.add(running)
        else:  # any synchronous call sent may have started: each runs again alone
            suspects |= {c.id for c in slot.lane}
        self._lose(slot, f"its reward worker died ({why})", suspects)

    def _run_timer(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    when, _, kind, obj = heapq.heappop(self._heap)
                    if kind == "call":
                        if obj.slot is not None and obj.deadline == when and not obj.slot.dead:
                            self._expire(obj)
                    elif not obj.ready and not obj.dead:
                        self._on_start_failed(obj, f"it did not start within {START_TIMEOUT_S:g} s")
                self._flush_wakes()
                self._cond.wait(self._heap[0][0] - now if self._heap else None)


def _wire(calls: list[_Call]) -> dict:
    """One message of calls: each input once, whatever the number of rewards that score it."""
    inputs: list[RewardInput] = []
    index: dict[int, int] = {}
    wire = []
    for c in calls:
        rows = []
        for inp in c.inputs:
            if id(inp) not in index:
                index[id(inp)] = len(inputs)
                inputs.append(inp)
            rows.append(index[id(inp)])
        wire.append((c.id, c.spec, rows))
    return {"inputs": inputs, "calls": wire}


def _unscored(why: str, n: int) -> list[Result]:
    return [Failed("reward_error", "could not be scored", hint=why)] * n


def _set_results(items) -> None:
    for fut, value in items:
        if not fut.done():
            fut.set_result(value)


# -- what build_scorer returns -----------------------------------------------------------------
class _Scorer:
    """The pool behind a handle that nothing inside the pool refers to: a scorer that is
    dropped without `close()` (a run that ends without closing) still stops its workers once
    it is collected, or at interpreter exit."""

    def __init__(self, pool: _PoolScorer):
        self._pool = pool
        self._finalizer = weakref.finalize(self, pool.shutdown)
        self.rewards, self.per_group = pool.rewards, pool.per_group

    async def score(self, inputs: list[RewardInput]) -> list[RewardOutcome]:
        return await self._pool.score(inputs)

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        self._finalizer()  # runs pool.shutdown once

    def pids(self) -> list[int]:
        """Process ids of the live workers, by slot."""
        return self._pool.pids()

    @property
    def served(self) -> list[int]:
        """Calls answered, per worker slot."""
        return self._pool.served

    @property
    def restarts(self) -> int:
        """Workers replaced so far (killed for a hung call, or died)."""
        return self._pool.restarts

    @property
    def recycled(self) -> int:
        """Workers retired after reward.worker_max_calls calls or past reward.worker_max_rss_mb."""
        return self._pool.recycled

    @property
    def crashes(self) -> int:
        """Calls charged with the crash of their worker (each ended `reward_error`)."""
        return self._pool.crashes


class ProcessScorer(_Scorer):
    """Rewards in `reward.workers` worker processes on this machine."""

    def __init__(self, specs: list[dict[str, Any]], cfg):
        from tidal.rewards.pool_process import ProcessPool  # it builds on this module

        super().__init__(ProcessPool(specs, cfg))


class RayScorer(_Scorer):
    """Rewards in Ray reward actors (placement.reward_workers), started through `actors`."""

    def __init__(self, specs: list[dict[str, Any]], cfg, actors):
        from tidal.rewards.pool_ray import RayPool  # it builds on this module

        super().__init__(RayPool(specs, cfg, actors))
