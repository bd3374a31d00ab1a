"""Where reward code runs: `RewardHost` calls the rewards with per-call timeouts inside one
process (a worker process of the pool, a Ray reward actor, or the driver for the inline
scorer), and `python -m tidal.rewards.worker IN_FD OUT_FD` is a pool worker process.

A host imports every reward once when it starts. Async rewards run concurrently on the
host's event loop and are cancelled at `timeout_s`. Synchronous rewards run in `lanes` sync
lanes (`reward.sync_concurrency`), each a thread of its own that runs its calls one at a
time, in order, so that up to `lanes` synchronous calls run at once and hung ones time out
together, not one after another; the loop stays free to serve async calls, and a hung call
is observable. The driver says which lane each call goes to (it keeps each lane's deadlines).
A synchronous call past its timeout cannot be stopped from inside the process, so the host
answers it `timeout` with `hung=True` and stops that lane (the calls queued behind it never
start there: the driver sends them elsewhere); the other lanes go on, and the driver retires
the process (killed once its other calls are answered) and starts another. When the hang
holds the GIL (a regex backtracking in C) the host cannot even answer; the driver's own
deadline catches that.

Wire protocol of a worker process (pickled messages over two pipes, see pool.py):
driver → worker: {"init": ...} once, then {"inputs": [RewardInput], "calls": [(id, spec, [input index], lane)]},
or {"close": True}; worker → driver: {"ready": {...}} or {"failed": "message"} once, then
{"results": [(id, [Result], hung)]} (results that finish together travel together).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import pickle
import sys
import threading
import time
import traceback
from typing import Any

from tidal.rewards.contract import RewardInput
from tidal.rewards.forms import (
    BadInput,
    LoadedReward,
    Result,
    arguments,
    bad_input,
    check,
    load_rewards,
    raised,
    timed_out,
)


def _invoke(fn, args, kwargs) -> tuple[bool, Any, str]:
    """(ok, answer or exception, traceback) of one synchronous call."""
    try:
        return True, fn(*args, **kwargs), ""
    except BaseException as e:  # noqa: BLE001 - SystemExit from user code is an error of that call, not of the worker
        return False, e, traceback.format_exc()


async def _awaited(aw) -> tuple[bool, Any, str]:
    try:
        return True, await aw, ""
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - kept inside the task: SystemExit would otherwise stop the loop
        return False, e, traceback.format_exc()


class _Lane:
    """One sync lane: a queue, the thread that runs its calls, and whether a hang stopped it."""

    def __init__(self, index: int):
        self.index = index
        self.queue: asyncio.Queue = asyncio.Queue()
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tidal-reward-sync{index}")
        self.task: asyncio.Task | None = None
        self.stopped = False  # a call hung: nothing more starts in this lane


class RewardHost:
    """The rewards of a run, loaded in this process. `run(spec, inputs)` -> (one Result per
    input, hung). `sync_in_thread=False` (the inline scorer) calls synchronous rewards
    directly in the caller's loop: breakpoints work, a hang cannot be stopped. `lanes`: the
    synchronous calls that may run at once, each lane in a thread of its own."""

    def __init__(self, specs: list[dict[str, Any]], timeout_s: float, *, sync_in_thread: bool = True, lanes: int = 1):
        self.rewards: list[LoadedReward] = load_rewards(specs)
        self.timeout_s = timeout_s
        self.sync_in_thread = sync_in_thread
        self.kinds = [r.is_async for r in self.rewards]
        self.n_lanes = max(1, int(lanes))
        self._lanes: dict[int, _Lane] = {}
        self._delivered: list = []
        self._delivered_lock = threading.Lock()
        self._drain_scheduled = False
        self.hung = False  # some lane is stuck in user code
        # In a worker process (see _main): where the running sync calls' ids are kept for the
        # driver, and what runs each time the last call in flight ends (its children killed).
        self.mark = None
        self.after_call = None
        self._busy = 0  # calls running now (async ones, and each lane's current one)
        self._busy_lock = threading.Lock()  # counted from the loop and from the lanes' threads

    async def run(self, spec: int, inputs: list[RewardInput], call_id: int | None = None,
                  lane: int = 0) -> tuple[list[Result], bool]:
        """`call_id`: the driver's id of the call, kept in `mark` while it runs (a crash is
        charged to it); `lane`: the sync lane it runs in (synchronous rewards)."""
        reward = self.rewards[spec]
        try:
            args, kwargs = arguments(reward, inputs)
        except BadInput as e:
            return bad_input(e, len(inputs)), False
        if reward.is_async or not self.sync_in_thread:
            self._begun()
            try:
                return await self._direct(reward, args, kwargs, inputs), False
            finally:
                self._ended()
        ln = self._lanes.get(lane % self.n_lanes)
        if ln is None:
            ln = self._lanes[lane % self.n_lanes] = _Lane(lane % self.n_lanes)
            ln.task = asyncio.get_running_loop().create_task(self._serve_lane(ln))
        fut = asyncio.get_running_loop().create_future()
        ln.queue.put_nowait((reward, args, kwargs, inputs, fut, call_id))
        return await fut

    async def _direct(self, reward, args, kwargs, inputs) -> list[Result]:
        ok, out, tb = _invoke(reward.fn, args, kwargs)  # an async function returns its coroutine at once
        if not ok:
            return raised(reward, out, inputs, tb)
        if inspect.isawaitable(out):
            return await self._await(reward, out, inputs, self.timeout_s)
        return check(reward, out, inputs)

    async def _await(self, reward, aw, inputs, timeout_s: float) -> list[Result]:
        task = asyncio.ensure_future(_awaited(aw))
        done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout_s))
        if not done:
            task.cancel()  # not awaited: a reward that ignores cancellation must not hold this call
            return timed_out(self.timeout_s, len(inputs))
        ok, out, tb = task.result()
        return check(reward, out, inputs) if ok else raised(reward, out, inputs, tb)

    async def _serve_lane(self, ln: _Lane) -> None:
        """A lane's synchronous calls, one at a time, in arrival order, each timed from its own
        start. The calls waiting when the thread frees up go to it together (one hand-over,
        not one per call); the loop sleeps until the running call's deadline or the batch's end."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [await ln.queue.get()]
            while not ln.queue.empty():
                batch.append(ln.queue.get_nowait())
            progress = [(0, time.monotonic())]  # (index of the running call, its start), set by the thread
            job = loop.run_in_executor(ln.thread, self._run_batch, ln, batch, progress, loop)
            while not job.done():
                i, t0 = progress[0]
                left = t0 + self.timeout_s - time.monotonic()
                if left <= 0:  # the thread is stuck in user code: only killing the process ends it
                    self.hung = ln.stopped = True  # what is queued behind it never starts here
                    fut = batch[i][4]
                    if not fut.done():
                        fut.set_result((timed_out(self.timeout_s, len(batch[i][3])), True))
                    return
                await asyncio.wait({job}, timeout=left)
            job.result()

    def _run_batch(self, ln: _Lane, batch: list, progress: list, loop) -> None:
        """In the lane's thread."""
        for i, (reward, args, kwargs, inputs, fut, call_id) in enumerate(batch):
            if ln.stopped:  # a call before this one hung and came back late: the driver sent the rest elsewhere
                return
            t0 = time.monotonic()
            progress[0] = (i, t0)
            self._begun()
            if self.mark is not None:
                self.mark.set(call_id, ln.index)
            ok, out, tb = _invoke(reward.fn, args, kwargs)
            if self.mark is not None:
                self.mark.set(None, ln.index)
            if not ok:
                res = raised(reward, out, inputs, tb)
            elif inspect.isawaitable(out):  # a sync-looking callable that returned an awaitable
                left = self.timeout_s - (time.monotonic() - t0)
                res = asyncio.run_coroutine_threadsafe(self._await(reward, out, inputs, left), loop).result()
            else:
                res = check(reward, out, inputs)
            self._ended()
            self._deliver(loop, fut, res)

    def _begun(self) -> None:
        with self._busy_lock:
            self._busy += 1

    def _ended(self) -> None:
        """A call ended: when none is left running, `after_call` (a worker kills the processes
        the calls left behind), under the lock that a call takes to start: no call starts
        during the sweep, so none loses a child to it."""
        with self._busy_lock:
            self._busy -= 1
            if self._busy == 0 and self.after_call is not None:
                try:
                    self.after_call()
                except Exception:  # noqa: BLE001 - cleanup must not fail the call that ended
                    traceback.print_exc()

    def _deliver(self, loop, fut, res) -> None:
        """Answers go to the loop in bunches: one wake-up for all that finished meanwhile."""
        with self._delivered_lock:
            self._delivered.append((fut, res))
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._delivered_lock:
            items, self._delivered = self._delivered, []
            self._drain_scheduled = False
        for fut, res in items:
            if not fut.done():
                fut.set_result((res, False))

    async def close(self, timeout_s: float = 5.0) -> None:
        """Give rewards with a `close()` (sandbox pools, HTTP clients) a bounded chance to let go."""
        for r in self.rewards:
            close = getattr(r.fn, "close", None)
            if close is None:
                continue
            try:
                out = close()
                if inspect.isawaitable(out):
                    await asyncio.wait_for(out, timeout_s)
            except Exception:  # noqa: BLE001, S110 - the process ends next; nothing to save
                pass
        for ln in self._lanes.values():
            if ln.task is not None:
                ln.task.cancel()
            ln.thread.shutdown(wait=False, cancel_futures=True)


# -- the worker process ------------------------------------------------------------------------
def _main(in_fd: int, out_fd: int, mark_fd: int | None = None) -> None:
    from multiprocessing.connection import Connection

    from tidal.rewards import limits

    limits.become_subreaper()  # what the rewards start stays findable (tidal/rewards/limits.py)
    rx, tx = Connection(in_fd, writable=False), Connection(out_fd, readable=False)
    send_lock = threading.Lock()

    def send(msg: dict) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with send_lock:
            tx.send_bytes(data)

    init = pickle.loads(rx.recv_bytes())["init"]
    sys.path[:] = init["sys_path"]  # the driver's import path: the rewards import here as they do there
    try:
        limits.set_address_space(init.get("address_space_mb"))
        host = RewardHost(init["specs"], init["timeout_s"], lanes=init.get("lanes", 1))
    except Exception as e:  # noqa: BLE001 - reported to the driver, which raises it at start
        send({"failed": str(e) if isinstance(e, ValueError) else f"{type(e).__name__}({e})",
              "traceback": traceback.format_exc()})
        return
    host.mark = limits.CrashMark(mark_fd, host.n_lanes)
    host.after_call = limits.end_group_children
    send({"ready": {"pid": os.getpid(), "kinds": host.kinds}})
    asyncio.run(_serve(host, rx, send))


async def _serve(host: RewardHost, rx, send) -> None:
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    outbox: list = []
    tasks: set[asyncio.Task] = set()

    def flush() -> None:
        batch = outbox[:]
        outbox.clear()
        if batch:
            send({"results": batch, **limits_state()})

    async def one(call_id: int, spec: int, inputs: list[RewardInput], lane: int) -> None:
        try:
            results, hung = await host.run(spec, inputs, call_id, lane)
        except Exception as e:  # noqa: BLE001 - a bug here must answer the call, not strand it
            results, hung = raised(host.rewards[spec], e, inputs), False
        if not outbox:
            loop.call_soon(flush)  # everything that finishes in this turn of the loop goes in one message
        outbox.append((call_id, results, hung))

    def on_message(msg: dict) -> None:
        if "close" in msg:
            if not stop.done():
                stop.set_result(None)
            return
        inputs = msg["inputs"]
        for call_id, spec, rows, lane in msg["calls"]:
            t = loop.create_task(one(call_id, spec, [inputs[i] for i in rows], lane))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    def read() -> None:
        """Blocking reads in a thread of their own: a message is handed to the loop whole.
        When the driver goes away (the pipe ends), the process ends, even with a stuck lane."""
        while True:
            try:
                msg = pickle.loads(rx.recv_bytes())
            except (EOFError, OSError):
                _exit()
            loop.call_soon_threadsafe(on_message, msg)

    threading.Thread(target=read, name="tidal-reward-reader", daemon=True).start()
    await stop
    await host.close()
    flush()
    _exit()


def limits_state() -> dict:
    """What the driver recycles a worker by: its resident memory and the orphans it holds."""
    from tidal.rewards.limits import rss_bytes, zombies

    return {"rss": rss_bytes(), "zombies": zombies()}


def _exit() -> None:
    """End the worker and every process its rewards started (it is their subreaper)."""
    from tidal.rewards.limits import end_descendants

    end_descendants()
    sys.stdout.flush()
    os._exit(0)  # a stuck sync thread must not keep the process alive


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
