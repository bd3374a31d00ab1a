"""The machinery of the reward worker pools (tidal/rewards/pool.py says how they work): a call
(`Call`), a worker slot (`Slot`), and `PoolScorer`, the scheduler that sends calls to the
least-loaded worker, watches every deadline on one thread and replaces a worker that hangs or
dies. Its two backends subclass it: worker processes (tidal/rewards/pool_process.py) and Ray
actors (tidal/rewards/pool_ray.py); tidal/rewards/pool.py builds the one a run asks for.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from typing import Any

from tidal.rewards.contract import RewardInput, RewardOutcome
from tidal.rewards.forms import Failed, LoadedReward, OncePerStep, Result, combine, reward_meta, timed_out

log = logging.getLogger("tidal.rewards")

GRACE_S = 0.5  # the driver's deadline past reward.timeout_s: the worker's own answer normally comes first
START_TIMEOUT_S = 120.0  # a worker imports the rewards (torch, math-verify, a model) before it is ready
SYNC_DEPTH = 32  # synchronous calls queued on one process worker: amortizes IPC, keeps load balanced
# Synchronous calls held by one sync lane of a worker: the one running and those queued behind
# it, so that the next starts without waiting for the driver (a lane of 2 took twice the time
# of the single lane of 32 before it on 256 trivial calls, in round trips; 4 took half:
# BENCHMARKS.md, "Rewards"). A hang strands the calls behind it until it is seen at
# reward.timeout_s; they are sent elsewhere then, so one of them that hangs too ends by
# 2 x reward.timeout_s.
LANE_DEPTH = 4
RAY_ACTOR_CONCURRENCY = 64  # placement's max_concurrency of a reward actor
MAX_ZOMBIES = 64  # exited orphans a worker may hold before it is recycled (tidal/rewards/limits.py, zombies)
MAX_UNEXPLAINED = 3  # crashes a call may wait through with no call charged, before it ends reward_error


class RewardLoadError(ValueError):
    """A reward could not be loaded in a worker; the message names the key and what failed."""


def calls_of(rewards: list[LoadedReward], inputs: list[RewardInput]) -> list[tuple[int, list[int]]]:
    """(reward index, positions of its inputs) per call: a group for TRL's form, else one input."""
    out = []
    for si, r in enumerate(rewards):
        if r.form == "trl":
            out.append((si, list(range(len(inputs)))))
        else:
            out.extend((si, [j]) for j in range(len(inputs)))
    return out


def outcomes(rewards: list[LoadedReward], inputs: list[RewardInput], calls, answers,
             logged: OncePerStep | None = None) -> list[RewardOutcome]:
    """Each input's outcome from the answers of `calls` (as `calls_of` planned them): its
    rewards' results combined into one reward and its parts (failures logged through `logged`)."""
    per_input: list[list[Result | None]] = [[None] * len(rewards) for _ in inputs]
    for (si, rows), results in zip(calls, answers):
        for j, res in zip(rows, results):
            per_input[j][si] = res
    return [combine(rewards, inp, res, logged) for inp, res in zip(inputs, per_input)]  # type: ignore[arg-type]


# -- the pools ---------------------------------------------------------------------------------
class Call:
    __slots__ = ("deadline", "finished", "future", "id", "inputs", "is_async", "lane", "loop", "lost", "slot", "solo",
                 "spec", "unexplained")

    def __init__(self, call_id: int, spec: int, inputs: list[RewardInput], is_async: bool, loop, future):
        self.id, self.spec, self.inputs, self.is_async = call_id, spec, inputs, is_async
        self.loop, self.future = loop, future
        self.lost = 0  # times its worker was lost while it ran (Ray actors)
        self.unexplained = 0  # crashes of its worker, while it waited there, that no call running was charged with
        self.solo = False  # suspected of a crash with others: it runs again alone, which tells
        self.slot: Slot | None = None  # the worker it is in flight on
        self.lane: int | None = None  # its sync lane there (synchronous calls)
        self.deadline: float | None = None
        self.finished = False  # answered (or its caller went away)


class Slot:
    """One worker (process or actor) and the calls in flight on it."""

    def __init__(self, index: int, generation: int, lanes: int = 1):
        self.index, self.generation = index, generation
        self.ready = False
        self.dead = False
        self.pid: int | None = None
        self.inflight: dict[int, Call] = {}
        # Per sync lane, its synchronous calls in the order the worker runs them (the head runs).
        self.lanes: list[deque[Call]] = [deque() for _ in range(lanes)]
        self.n_async = 0
        self.transport: Any = None
        self.calls = 0  # answered
        self.rss = 0  # bytes, as the worker last reported
        self.zombies = 0  # exited orphans it holds, as it last reported (tidal/rewards/limits.py)
        self.retiring = False  # recycled: takes no new call, ends once its calls are answered
        self.reserved: int | None = None  # kept free for this solo call: takes no other
        self.solo: int | None = None  # the solo call in flight on it: it takes no other
        self.hung = False  # a sync lane is stuck in user code: killed once its other calls are answered
        self.stuck: set[int] = set()  # its sync lanes stuck in user code (they take no call)

    @property
    def queued(self) -> int:
        """Synchronous calls on it, running or waiting."""
        return sum(len(q) for q in self.lanes)

    def free_lane(self) -> int:
        """The lane, not stuck, with the fewest calls."""
        return min((i for i in range(len(self.lanes)) if i not in self.stuck), key=lambda i: len(self.lanes[i]))

    def __repr__(self) -> str:
        return f"reward worker {self.index}" + (f" (pid {self.pid})" if self.pid else "")


class PoolScorer:
    """Dispatch, deadlines, kills and retries, over a transport (processes or Ray actors)."""

    sync_depth = SYNC_DEPTH
    # True: sync calls go to a worker only while its lane is empty (those of one dispatch
    # travel together), for a transport that keeps order only within one message.
    lane_exclusive = False
    # The worker tells which synchronous call was running when it crashed (process workers
    # share that with the driver); without it, every call that may have run is a suspect.
    exact_crashes = True
    grace_s = GRACE_S
    lane_depth = LANE_DEPTH

    def __init__(self, specs: list[dict[str, Any]], cfg, n_workers: int, max_async: int):
        self.specs = specs
        self.rewards = reward_meta(specs)  # names and weights; the code itself is imported in the workers
        self.logged = OncePerStep()  # a failure's traceback: once per distinct error and step
        self.per_group = any(r.form == "trl" for r in self.rewards)
        self.timeout_s = float(cfg.timeout_s)
        self.max_async = max_async
        self.n_lanes = self.lanes_of(cfg)
        self.kinds: list[bool] | None = None  # per reward: async (from the first worker that started)
        self.lock = threading.Lock()
        self._cond = threading.Condition(self.lock)
        self._heap: list = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._pending: deque[Call] = deque()
        self._wake: list[tuple[Any, Any, Any]] = []  # (loop, future, value) to set once the lock is let go
        self._closed = False
        self._dispatch_soon = False
        self._broken = ""  # why no worker is left
        self._generation = itertools.count()
        self.slots: list[Slot] = []
        self.served: list[int] = [0] * n_workers  # calls answered, per worker slot
        self.restarts = 0
        self.recycled = 0  # workers retired after reward.worker_max_calls calls or reward.worker_max_rss_mb
        self.crashes = 0  # calls charged with the crash of their worker
        self.max_calls = int(getattr(cfg, "worker_max_calls", 0) or 0)
        self.max_rss = int(getattr(cfg, "worker_max_rss_mb", 0) or 0) << 20
        self._retiring: list[Slot] = []
        self._starting = True  # a worker that fails now fails build_scorer
        self._timer = threading.Thread(target=self._run_timer, name="tidal-reward-deadlines", daemon=True)
        self._timer.start()
        with self.lock:
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

    def lanes_of(self, cfg) -> int:
        """Sync lanes per worker: synchronous calls that run at once in one worker."""
        return max(1, int(getattr(cfg, "sync_concurrency", 1) or 1))

    # -- transport (subclasses) -----------------------------------------------------------
    def start_worker(self, slot: Slot) -> None:
        raise NotImplementedError

    def send_calls(self, slot: Slot, calls: list[Call]) -> None:
        raise NotImplementedError

    def kill_worker(self, slot: Slot) -> None:
        raise NotImplementedError

    def stop_workers(self, slots: list[Slot]) -> None:
        raise NotImplementedError

    # -- the caller's side ------------------------------------------------------------------
    async def score(self, inputs: list[RewardInput]) -> list[RewardOutcome]:
        if not inputs:
            return []
        loop = asyncio.get_running_loop()
        plan = calls_of(self.rewards, inputs)
        kinds = self.kinds or [False] * len(self.rewards)
        calls = [Call(next(self._ids), si, [inputs[j] for j in rows], kinds[si], loop, loop.create_future())
                 for si, rows in plan]
        with self.lock:
            self._pending.extend(calls)
            soon, self._dispatch_soon = not self._dispatch_soon, True
        if soon:  # the calls of every `score` started in this turn of the loop leave together
            loop.call_soon(self._dispatch_now)
        try:
            answers = [await calls[0].future] if len(calls) == 1 else await asyncio.gather(*(c.future for c in calls))
        except asyncio.CancelledError:
            with self.lock:
                for c in calls:
                    c.finished = True  # in flight it stays on its worker's books until it answers or its deadline
            raise
        return outcomes(self.rewards, inputs, plan, answers, self.logged)

    def submit(self, calls: list[tuple[int, list[RewardInput]]], loop) -> list[asyncio.Future]:
        """Calls (reward index, inputs) as they are, without combining: a future per call for
        its list of Results, set in `loop` (a Ray reward actor serves the driver's calls so)."""
        kinds = self.kinds or [False] * len(self.rewards)
        cs = [Call(next(self._ids), spec, inputs, kinds[spec], loop, loop.create_future()) for spec, inputs in calls]
        with self.lock:
            self._pending.extend(cs)
            self._dispatch()
            self.flush_wakes()
        return [c.future for c in cs]

    def _dispatch_now(self) -> None:
        with self.lock:
            self._dispatch_soon = False
            self._dispatch()
            self.flush_wakes()

    def pids(self) -> list[int]:
        """Process ids of the live workers, by slot."""
        with self.lock:
            return [s.pid for s in self.slots if s.ready and not s.dead and s.pid is not None]

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and end every waiting call."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            slots = list(self.slots) + self._retiring
            for c in list(self._pending) + [c for s in slots for c in s.inflight.values()]:
                self._finish(c, unscored("the reward scorer was closed", len(c.inputs)))
            self._pending.clear()
            self._broken = "the reward scorer was closed"
            for s in slots:
                s.dead = True
            self._cond.notify_all()
            self.flush_wakes()
        self.stop_workers(slots)

    # -- bookkeeping (every method below runs with the lock held) ----------------------------
    def _new_slot(self, index: int) -> Slot:
        slot = Slot(index, next(self._generation), self.n_lanes)
        self._push(time.monotonic() + START_TIMEOUT_S, "start", slot)
        self.start_worker(slot)
        return slot

    def _push(self, when: float, kind: str, obj: Any) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), kind, obj))
        self._cond.notify_all()

    def _finish(self, c: Call, results: list[Result]) -> None:
        c.slot, c.deadline = None, None
        if not c.finished:
            c.finished = True
            self._wake.append((c.loop, c.future, results))

    def flush_wakes(self) -> None:
        by_loop: dict[Any, list] = {}
        for loop, fut, value in self._wake:
            by_loop.setdefault(loop, []).append((fut, value))
        self._wake.clear()
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: its caller is gone
                loop.call_soon_threadsafe(set_results, items)

    def _serving(self) -> list[Slot]:
        """The workers that take new calls: the current ones, and a hung one whose replacement
        is not ready yet (its other lanes serve meanwhile: no gap while the new one starts)."""
        waiting = [r for r in self._retiring if r.hung and not r.dead and not self.slots[r.index].ready]
        return self.slots + waiting if waiting else self.slots

    def _pick(self, is_async: bool, open_lanes: set[int] | None) -> Slot | None:
        best = None
        for s in self._serving():
            if not s.ready or s.dead or (s.retiring and not s.hung) or s.reserved is not None or s.solo is not None:
                continue
            if is_async and s.n_async >= self.max_async:
                continue
            live = len(s.lanes) - len(s.stuck)
            if not is_async and (not live or s.queued >= min(self.sync_depth, self.lane_depth * live)):
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
                self._finish(c, unscored(self._broken, len(c.inputs)))
            return
        now = time.monotonic()
        sends: dict[int, tuple[Slot, list[Call]]] = {}
        waiting: deque[Call] = deque()
        open_lanes = {s.generation for s in self.slots if not s.queued} if self.lane_exclusive else None
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
                c.lane = slot.free_lane()
                lane = slot.lanes[c.lane]
                lane.append(c)
                if len(lane) == 1:  # it starts now; the others start as the one before answers
                    self._set_deadline(c, now)
            sends.setdefault(slot.generation, (slot, []))[1].append(c)
        self._pending = waiting
        for slot, calls in sends.values():
            self.send_calls(slot, calls)

    def _solo_slot(self, c: Call) -> Slot | None:
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

    def _set_deadline(self, c: Call, start: float) -> None:
        c.deadline = start + self.timeout_s + self.grace_s
        self._push(c.deadline, "call", c)

    def on_ready(self, slot: Slot, info: dict) -> None:
        if slot.dead:
            return
        slot.ready, slot.pid = True, info.get("pid")
        if self.kinds is None:
            self.kinds = list(info["kinds"])
        self._cond.notify_all()
        for old in [r for r in self._retiring if r.hung and r.index == slot.index]:
            self._maybe_retire(old)  # it served while this one started: it ends once idle
        self._dispatch()

    def on_start_failed(self, slot: Slot, why: str, traceback: str = "") -> None:
        if slot.dead or slot.ready:
            return
        slot.dead = True
        self.kill_worker(slot)
        if traceback and not self._broken:
            log.warning("reward worker %d failed to load the rewards: %s\n%s", slot.index, why, traceback.rstrip())
        if self._starting:  # build_scorer raises it
            self._broken = self._broken or why
        else:
            log.error("reward worker %d could not be restarted: %s", slot.index, why)
            if not any(not s.dead for s in self.slots):
                self._broken = f"no reward worker is left (the last restart failed: {why})"
        for old in [r for r in self._retiring if r.hung and r.index == slot.index]:
            self._maybe_retire(old)  # no replacement comes: it ends once idle
        self._cond.notify_all()
        self._dispatch()

    def on_results(self, slot: Slot, batch: list, rss: int | None = None) -> None:
        if slot.dead:
            return  # it was killed: these calls were sent again already
        now = time.monotonic()
        stuck: set[int] = set()
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
                lane = slot.lanes[c.lane or 0]
                head = bool(lane) and lane[0] is c
                with contextlib.suppress(ValueError):
                    lane.remove(c)
                if head and lane:
                    self._set_deadline(lane[0], now)
                if was_hung:
                    stuck.add(c.lane or 0)
            self.served[slot.index] += 1
            self._finish(c, results)
        for lane in stuck:  # that lane is stuck in user code: only a kill frees it
            self._stuck(slot, lane)
        if stuck:
            self._dispatch()  # what it stranded, at once: to the others, or its own free lanes meanwhile
        self._maybe_retire(slot)
        self._dispatch()

    def _stuck(self, slot: Slot, lane: int) -> None:
        """A sync lane of `slot` hung (its call answered `timeout`): the calls queued behind it
        never start there and go to another worker now; a replacement starts now; until it is
        ready, the worker's other lanes go on taking calls, and then it takes none, finishes
        what it runs and is killed. So hangs on one worker time out together, a hang strands no
        other call, and the pool keeps serving while the replacement starts."""
        again = [c for c in slot.lanes[lane] if not c.finished]
        for c in slot.lanes[lane]:
            slot.inflight.pop(c.id, None)
            c.slot, c.deadline, c.lane = None, None, None
            if slot.solo == c.id:
                slot.solo = None
        slot.lanes[lane].clear()
        self._pending.extendleft(reversed(again))
        slot.hung = True
        slot.stuck.add(lane)
        if not slot.retiring and not self._closed:
            slot.retiring = True
            self.restarts += 1
            self._retiring.append(slot)
            if self.slots[slot.index] is slot:
                self.slots[slot.index] = self._new_slot(slot.index)

    def _maybe_retire(self, slot: Slot) -> None:
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
        if slot.hung and not self._closed and slot in self._retiring and not (
                self.slots[slot.index].ready or self.slots[slot.index].dead):
            return  # it serves until its replacement is ready (or cannot start)
        if slot.retiring and not slot.inflight and not slot.dead:
            slot.dead = True
            self._retiring.remove(slot)
            if slot.hung:  # a thread of it is stuck in user code: asked politely, it would still hold it
                self.kill_worker(slot)
            else:
                self._retire(slot)

    def _retire(self, slot: Slot) -> None:
        """End a recycled worker that has nothing in flight (politely; the transport's own way)."""
        self.kill_worker(slot)

    def _expire(self, c: Call) -> None:
        """A call past its deadline: it ends `timeout`, its worker is killed and replaced."""
        slot = c.slot
        assert slot is not None
        if not c.is_async:
            running = {q[0].id for q in slot.lanes if q and q[0].deadline is not None}
            if running - {c.id}:
                # Several sync lanes were running and none answered: the one holding the whole
                # worker (the GIL) cannot be told from those it froze. Each runs again alone.
                self._lose(slot, "its reward worker stopped answering while it ran", running | {c.id}, hung=True)
                return
        slot.inflight.pop(c.id, None)
        if c.is_async:
            slot.n_async -= 1
        else:
            with contextlib.suppress(ValueError):
                slot.lanes[c.lane or 0].remove(c)
        self._finish(c, timed_out(self.timeout_s, len(c.inputs), hint=f"{slot} did not answer by its deadline "
                                  f"and was killed"))
        self._lose(slot, "its reward worker was killed (another call on it timed out)")

    def _lose(self, slot: Slot, why: str, suspects: set[int] | None = None, hung: bool = False) -> None:
        """`slot` is gone (killed, or crashed when `suspects` is given: the calls that were
        running then) and a replacement starts. A crash with one suspect is that call's: it
        ends `reward_error` naming the crash. Several suspects each run again alone (a solo
        call), which tells. Every other call is sent again as it was: a call never pays for
        another's crash or hang. (A call that waited on crashed workers MAX_UNEXPLAINED times
        with no suspect ends `reward_error`: nothing loops forever.) `hung`: the suspects hung
        rather than crashed (several sync lanes ran when the worker stopped answering): each
        runs again alone, and none is charged here.)"""
        if slot.dead:
            return
        slot.dead = True
        self.kill_worker(slot)
        crashed = suspects is not None and not hung
        suspects = set() if suspects is None else suspects & set(slot.inflight)
        culprit = next(iter(suspects)) if len(suspects) == 1 and not hung else None
        again = []
        for c in sorted(slot.inflight.values(), key=lambda c: c.id):
            c.slot, c.deadline, c.lane = None, None, None
            if c.finished:
                continue
            if c.id == culprit:
                self.crashes += 1
                self._finish(c, unscored(f"{why} while running it: the crash was this call's", len(c.inputs)))
                continue
            if c.id in suspects:
                c.solo = True
            elif crashed and not suspects:
                c.unexplained += 1
                if c.unexplained >= MAX_UNEXPLAINED:
                    self._finish(c, unscored(f"{why}; its workers crashed {c.unexplained} times while it waited, "
                                              "with no call running", len(c.inputs)))
                    continue
            again.append(c)
        slot.inflight.clear()
        for q in slot.lanes:
            q.clear()
        slot.n_async = 0
        self._pending.extendleft(reversed(again))
        if slot in self._retiring:
            self._retiring.remove(slot)
        elif not self._closed and self.slots[slot.index] is slot:
            self.restarts += 1
            self.slots[slot.index] = self._new_slot(slot.index)
        self._dispatch()

    def on_exit(self, slot: Slot, why: str, running: set[int] | None = None) -> None:
        """A worker process ended by itself (or was killed from outside). `running`: the
        synchronous calls its lanes were running, where the worker tells (`exact_crashes`)."""
        if slot.dead:
            return
        if not slot.ready:
            self.on_start_failed(slot, f"the worker exited before it was ready ({why})")
            return
        suspects = {c.id for c in slot.inflight.values() if c.is_async}
        if self.exact_crashes:
            suspects |= running or set()
        else:  # any synchronous call sent may have started: each runs again alone
            suspects |= {c.id for q in slot.lanes for c in q}
        self._lose(slot, f"its reward worker died ({why})", suspects)

    def _run_timer(self) -> None:
        with self.lock:
            while not self._closed:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    when, _, kind, obj = heapq.heappop(self._heap)
                    if kind == "call":
                        if obj.slot is not None and obj.deadline == when and not obj.slot.dead:
                            self._expire(obj)
                    elif not obj.ready and not obj.dead:
                        self.on_start_failed(obj, f"it did not start within {START_TIMEOUT_S:g} s")
                self.flush_wakes()
                self._cond.wait(self._heap[0][0] - now if self._heap else None)


def wire(calls: list[Call]) -> dict:
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
        wire.append((c.id, c.spec, rows, c.lane or 0))
    return {"inputs": inputs, "calls": wire}


def unscored(why: str, n: int) -> list[Result]:
    return [Failed("reward_error", "could not be scored", hint=why)] * n


def set_results(items) -> None:
    for fut, value in items:
        if not fut.done():
            fut.set_result(value)
