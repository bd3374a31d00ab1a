"""The control connection between rank 0 (the controller) and each other rank of a launcher's
job (placement.mode=launcher, tidal/runtime/launcher.py): rank 0's handle of a rank
(`RemoteRank`) and of itself (`LocalRank`), and the rank's side of the connection (`serve_calls`).

The choice: one connection per rank carrying numbered calls, answered by number, so that two
kinds of call share it without waiting on each other. A trainer call (forward_backward,
optim_step, a save) is a collective: a rank runs them one at a time, in the order sent, each
on a thread that ends with it (tidal/trainer/threads.py). A call of an async method (a
colocated engine's `generate`, placement.colocate) runs at once on the rank's event loop,
many together, as on a Ray actor: the engine batches them, and a generation is not held up
behind a training call, nor a training call behind a rollout. A process that ends closes its
socket, so rank 0 learns at once which rank died, and every call pending on it fails naming it.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import pickle
import queue
import threading
from concurrent.futures import Future

from tidal.runtime.handles import Handle, Pending, RoleDied
from tidal.trainer.threads import on_own_thread

log = logging.getLogger("tidal")

EXIT_WAIT_S = 60.0  # a rank told to exit waits at most this long for the call it is running


def keep_device():
    """A function that gives the thread it runs on the calling thread's CUDA device (a no-op
    without CUDA). CUDA's current device is per thread, and a rank's is set on its main thread
    (its local rank's GPU: tidal/cli.py); a call on a thread of its own would otherwise run on
    GPU 0."""
    import torch

    if not torch.cuda.is_available():
        return lambda: None
    device = torch.cuda.current_device()
    return lambda: torch.cuda.set_device(device)


# -- rank 0's side --------------------------------------------------------------------------------
class LocalRank(Handle):
    """Rank 0's own TrainerWorker: each call on a thread that ends with it, so that it runs while
    the other ranks are sent theirs (the call is a collective) and keeps no OpenMP team alive
    on a long-lived thread (tidal/trainer/threads.py says why). An async call (its colocated
    engine's `generate`) is awaited in the caller's own event loop, as local mode does."""

    def __init__(self, worker):
        super().__init__("trainer rank 0", worker, remote=True)
        self._device = keep_device()

    def submit(self, call: str, *args, **kwargs) -> Pending:
        future: Future = Future()

        def run() -> None:
            try:
                self._device()
                future.set_result(getattr(self.target, call)(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to gather
                future.set_exception(e)

        threading.Thread(target=run, name=f"tidal-rank0-{call}", daemon=True).start()
        return Pending(self, call, future=future)

    async def acall(self, call: str, *args, timeout_s: float = 600.0):
        fn = getattr(self.target, call)
        awaitable = fn(*args) if inspect.iscoroutinefunction(fn) else asyncio.wrap_future(self.submit(call, *args).future)
        try:
            return await asyncio.wait_for(awaitable, timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.role} did not answer {call} within {timeout_s:g} s") from None

    def kill(self) -> None:
        pass


class RemoteRank(Handle):
    """Rank r > 0 over its control connection. Each call gets a number and its answer is
    matched by it; one reader thread resolves them. The connection closing (the process ended)
    fails every call pending and every later one with RoleDied, naming the rank."""

    def __init__(self, rank: int, conn, pid: int, role: str | None = None):
        super().__init__(role or f"trainer rank {rank}", None, remote=True)
        self.rank, self.conn, self.rank_pid = rank, conn, pid
        self._send_lock = threading.RLock()  # _died runs under it from submit
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self.dead: str | None = None
        threading.Thread(target=self._read, name=f"tidal-rank{rank}-reader", daemon=True).start()

    def submit(self, call: str, *args, **kwargs) -> Pending:
        future: Future = Future()
        with self._send_lock:
            if self.dead is None:
                number = next(self._ids)
                self._pending[number] = future
                try:
                    self.conn.send(("call", number, call, args, kwargs))
                except (OSError, EOFError, ValueError) as e:
                    self._died(f"its control connection failed ({type(e).__name__}: {e})")
            if self.dead is not None:
                return Pending(self, call, error=RoleDied(self.dead))
        return Pending(self, call, future=future)

    async def acall(self, call: str, *args, timeout_s: float = 600.0):
        """Await one call from asyncio code (the rollout's requests to this rank's engine)."""
        p = self.submit(call, *args)
        if p.error is not None:
            raise p.error
        try:  # shielded: a timed-out call's answer still arrives, and is dropped by the reader
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(p.future)), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.role} did not answer {call} within {timeout_s:g} s") from None

    def _read(self) -> None:
        while True:
            try:
                kind, number, value = self.conn.recv()
            except (OSError, EOFError, ValueError):
                self._died(f"its process (pid {self.rank_pid}) ended: its control connection closed")
                return
            with self._send_lock:
                future = self._pending.pop(number, None)
            if future is None or future.done():
                continue
            if kind == "ok":
                future.set_result(value)
            else:  # the rank's own exception (or its text, where it did not pickle)
                future.set_exception(value if isinstance(value, BaseException) else RuntimeError(value))

    def _died(self, why: str) -> None:
        with self._send_lock:
            if self.dead is None:
                self.dead = why
                # at once, though the run stops only at its next call to the trainer (a rollout may be under way)
                log.error("launcher: %s (pid %d) ended: %s", self.role, self.rank_pid, why)
            pending, self._pending = list(self._pending.values()), {}
        for f in pending:
            if not f.done():
                f.set_exception(RoleDied(self.dead))

    def stop(self) -> None:
        """Ask the rank to exit (it leaves its loop), then close the connection."""
        if self.dead is None:
            try:
                with self._send_lock:
                    self.conn.send(("exit", None, None, (), {}))
            except (OSError, EOFError, ValueError):
                pass
        self.dead = self.dead or "stopped"
        self.conn.close()

    def kill(self) -> None:
        self.stop()


# -- the rank's side ------------------------------------------------------------------------------
def serve_calls(conn, worker, rank: int) -> int:
    """Answer rank 0's calls on `worker` until told to exit (0) or rank 0's connection closes (1).
    Plain calls run one at a time in the order sent; async ones at once on an event loop."""
    send_lock = threading.Lock()
    device = keep_device()

    def on_device(fn, *args, **kwargs):
        device()
        return fn(*args, **kwargs)

    def answer(number: int, kind: str, value) -> None:
        with send_lock:
            try:
                try:
                    conn.send((kind, number, value))
                except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle: its text
                    conn.send(("err", number, f"{type(value).__name__}: {value}"))
            except (OSError, EOFError):  # rank 0 went away: the reading loop sees it too
                pass

    calls: queue.Queue = queue.Queue()

    def in_order() -> None:
        while (item := calls.get()) is not None:
            number, fn, args, kwargs = item
            try:
                answer(number, "ok", on_own_thread(on_device, fn, *args, **kwargs))
            except Exception as e:  # noqa: BLE001 - sent to rank 0, which names this rank and the step
                answer(number, "err", e)

    serial = threading.Thread(target=in_order, name=f"tidal-rank{rank}-calls", daemon=True)
    serial.start()
    loop: asyncio.AbstractEventLoop | None = None  # started by the first async call
    together: dict[str, int] = {}  # async calls received, by name (logged at the end: where generation ran)

    def finished(number: int, done) -> None:
        try:
            answer(number, "ok", done.result())
        except Exception as e:  # noqa: BLE001 - as above
            answer(number, "err", e)

    try:
        while True:
            try:
                kind, number, call, args, kwargs = conn.recv()
            except (OSError, EOFError):
                log.error("launcher: rank %d: rank 0 (the controller) went away; stopping", rank)
                return 1
            if kind == "exit":
                calls.put(None)
                serial.join(EXIT_WAIT_S)
                conn.close()
                return 0
            fn = getattr(worker, call, None)
            if fn is None:
                answer(number, "err", AttributeError(f"{type(worker).__name__} has no call {call!r}"))
            elif inspect.iscoroutinefunction(fn):
                together[call] = together.get(call, 0) + 1
                if loop is None:
                    loop = asyncio.new_event_loop()
                    threading.Thread(target=on_device, args=(loop.run_forever,), name=f"tidal-rank{rank}-loop",
                                     daemon=True).start()
                done = asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), loop)
                done.add_done_callback(lambda d, number=number: finished(number, d))
            else:
                calls.put((number, fn, args, kwargs))
    finally:
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if together:
            log.info("launcher: rank %d answered %s", rank, ", ".join(f"{n} × {c}" for n, c in together.items()))
