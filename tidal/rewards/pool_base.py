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
from tidal.rewards.forms import Failed, LoadedReward, Result, combine, reward_meta, timed_out

log = logging.getLogger("tidal.rewards")

GRACE_S = 0.5  # the driver's deadline past reward.timeout_s: the worker's own answer normally comes first
START_TIMEOUT_S = 120.0  # a worker imports the rewards (torch, math-verify, a model) before it is ready
SYNC_DEPTH = 32  # synchronous calls queued on one process worker: amortizes IPC, keeps load balanced
RAY_ACTOR_CONCURRENCY = 64  # placement's max_concurrency of a reward actor


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


def outcomes(rewards: list[LoadedReward], inputs: list[RewardInput], calls, answers) -> list[RewardOutcome]:
    """Each input's outcome from the answers of `calls` (as `calls_of` planned them): its
    rewards' results combined into one reward and its parts."""
    per_input: list[list[Result | None]] = [[None] * len(rewards) for _ in inputs]
    for (si, rows), results in zip(calls, answers):
        for j, res in zip(rows, results):
            per_input[j][si] = res
    return [combine(rewards, inp, res) for inp, res in zip(inputs, per_input)]  # type: ignore[arg-type]


# -- the pools ---------------------------------------------------------------------------------
class Call:
    """One reward call: a reward (`spec`, its index) over its inputs, awaited by `future`."""

    __slots__ = ("deadline", "finished", "future", "id", "inputs", "is_async", "loop", "lost", "slot", "spec")

    def __init__(self, call_id: int, spec: int, inputs: list[RewardInput], is_async: bool, loop, future):
        self.id, self.spec, self.inputs, self.is_async = call_id, spec, inputs, is_async
        self.loop, self.future = loop, future
        self.lost = 0  # times its worker was lost while it ran
        self.slot: Slot | None = None  # the worker it is in flight on
        self.deadline: float | None = None
        self.finished = False  # answered (or its caller went away)


class Slot:
    """One worker (process or actor) and the calls in flight on it."""

    def __init__(self, index: int, generation: int):
        self.index, self.generation = index, generation
        self.ready = False
        self.dead = False
        self.pid: int | None = None
        self.inflight: dict[int, Call] = {}
        self.lane: deque[Call] = deque()  # synchronous calls, in the order the worker runs them
        self.n_async = 0
        self.transport: Any = None

    def __repr__(self) -> str:
        return f"reward worker {self.index}" + (f" (pid {self.pid})" if self.pid else "")


class PoolScorer:
    """Dispatch, deadlines, kills and retries, over a transport (processes or Ray actors)."""

    sync_depth = SYNC_DEPTH
    # True: sync calls go to a worker only while its lane is empty (those of one dispatch
    # travel together), for a transport that keeps order only within one message.
    lane_exclusive = False

    def __init__(self, specs: list[dict[str, Any]], cfg, n_workers: int, max_async: int):
        self.specs = specs
        self.rewards = reward_meta(specs)  # names and weights; the code itself is imported in the workers
        self.per_group = any(r.form == "trl" for r in self.rewards)
        self.timeout_s = float(cfg.timeout_s)
        self.max_async = max_async
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

    # -- transport (subclasses) -----------------------------------------------------------
    def start_worker(self, slot: Slot) -> None:
        """Start the worker of `slot`; it reports back through on_ready or on_start_failed."""
        raise NotImplementedError

    def send_calls(self, slot: Slot, calls: list[Call]) -> None:
        """Send `calls` to the worker of `slot` in one message (`wire`); answers come to on_results."""
        raise NotImplementedError

    def kill_worker(self, slot: Slot) -> None:
        """Kill the worker of `slot` now (its process group, or its actor)."""
        raise NotImplementedError

    def stop_workers(self, slots: list[Slot]) -> None:
        """Stop these workers for good (shutdown), politely first."""
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
        return outcomes(self.rewards, inputs, plan, answers)

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
            for c in list(self._pending) + [c for s in self.slots for c in s.inflight.values()]:
                self._finish(c, unscored("the reward scorer was closed", len(c.inputs)))
            self._pending.clear()
            self._broken = "the reward scorer was closed"
            slots = list(self.slots)
            for s in slots:
                s.dead = True
            self._cond.notify_all()
            self.flush_wakes()
        self.stop_workers(slots)

    # -- bookkeeping (every method below runs with the lock held) ----------------------------
    def _new_slot(self, index: int) -> Slot:
        slot = Slot(index, next(self._generation))
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
        """Settle the futures that answers finished, on their loops (call with `lock` let go)."""
        by_loop: dict[Any, list] = {}
        for loop, fut, value in self._wake:
            by_loop.setdefault(loop, []).append((fut, value))
        self._wake.clear()
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: its caller is gone
                loop.call_soon_threadsafe(set_results, items)

    def _pick(self, is_async: bool, open_lanes: set[int] | None) -> Slot | None:
        best = None
        for s in self.slots:
            if not s.ready or s.dead:
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
                self._finish(c, unscored(self._broken, len(c.inputs)))
            return
        now = time.monotonic()
        sends: dict[int, tuple[Slot, list[Call]]] = {}
        waiting: deque[Call] = deque()
        open_lanes = {s.generation for s in self.slots if not s.lane} if self.lane_exclusive else None
        while self._pending:
            c = self._pending.popleft()
            if c.finished:
                continue
            slot = self._pick(c.is_async, open_lanes)
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
            self.send_calls(slot, calls)

    def _set_deadline(self, c: Call, start: float) -> None:
        c.deadline = start + self.timeout_s + GRACE_S
        self._push(c.deadline, "call", c)

    def on_ready(self, slot: Slot, info: dict) -> None:
        """The transport's report that the worker of `slot` started (`info`: its pid and reward kinds); under `lock`."""
        if slot.dead:
            return
        slot.ready, slot.pid = True, info.get("pid")
        if self.kinds is None:
            self.kinds = list(info["kinds"])
        self._cond.notify_all()
        self._dispatch()

    def on_start_failed(self, slot: Slot, why: str, traceback: str = "") -> None:
        """The transport's report that the worker of `slot` could not start; under `lock`."""
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
        self._cond.notify_all()
        self._dispatch()

    def on_results(self, slot: Slot, batch: list) -> None:
        """The transport's report of answers from the worker of `slot`: (call id, results, hung); under `lock`."""
        if slot.dead:
            return  # it was killed: these calls were sent again already
        now = time.monotonic()
        hung = False
        for call_id, results, was_hung in batch:
            c = slot.inflight.pop(call_id, None)
            if c is None:
                continue
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
            self._lose(slot, "its reward worker was killed (another call on it timed out)", head_running=False)
        self._dispatch()

    def _expire(self, c: Call) -> None:
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
        self._lose(slot, "its reward worker was killed (another call on it timed out)", head_running=False)

    def _lose(self, slot: Slot, why: str, head_running: bool) -> None:
        """`slot` is gone (killed or died): its calls are sent again, those that were running
        at most once more; a replacement starts. `head_running`: the first call of its sync
        lane had started (false once the call that hung there has been taken off)."""
        if slot.dead:
            return
        slot.dead = True
        self.kill_worker(slot)
        running = {c.id for c in slot.inflight.values() if c.is_async}
        if head_running and slot.lane:
            running.add(slot.lane[0].id)
        again = []
        for c in sorted(slot.inflight.values(), key=lambda c: c.id):
            c.slot, c.deadline = None, None
            if c.finished:
                continue
            if c.id in running:
                c.lost += 1
            if c.lost > 1:
                self._finish(c, unscored(f"{why} while running it, also on its retry", len(c.inputs)))
            else:
                again.append(c)
        slot.inflight.clear()
        slot.lane.clear()
        slot.n_async = 0
        self._pending.extendleft(reversed(again))
        if not self._closed:
            self.restarts += 1
            self.slots[slot.index] = self._new_slot(slot.index)
        self._dispatch()

    def on_exit(self, slot: Slot, why: str) -> None:
        """The transport's report that the worker of `slot` is gone; under `lock`."""
        if slot.dead:
            return
        if not slot.ready:
            self.on_start_failed(slot, f"the worker exited before it was ready ({why})")
        else:
            self._lose(slot, f"its reward worker died ({why})", head_running=True)

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
        wire.append((c.id, c.spec, rows))
    return {"inputs": inputs, "calls": wire}


def unscored(why: str, n: int) -> list[Result]:
    """The results of `n` inputs that could not be scored (a `reward_error`, never a score)."""
    return [Failed("reward_error", "could not be scored", hint=why)] * n


def set_results(items) -> None:
    """Settle (future, value) pairs on their event loop's thread; a future already done is left."""
    for fut, value in items:
        if not fut.done():
            fut.set_result(value)

