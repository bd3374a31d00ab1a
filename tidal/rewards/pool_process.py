"""The process backend of the reward pools (reward.isolation=process): `reward.workers` worker
processes (`python -m tidal.rewards.worker`, each its own process group) on this machine, spoken to
over pipes. How the pools work: tidal/rewards/pool.py."""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from tidal.rewards.pool_base import (
    Call,
    PoolScorer,
    Slot,
    wire,
)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# -- worker processes --------------------------------------------------------------------------
class _Proc:
    """One worker process: its pipes, a reader thread and a sender thread (a full pipe blocks
    only the sender, never the caller's event loop or the bookkeeping)."""

    def __init__(self, pool: ProcessPool, slot: Slot):
        from multiprocessing.connection import Connection

        self.pool, self.slot = pool, slot
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tidal.rewards.worker", str(to_worker_r), str(from_worker_w)],
                pass_fds=(to_worker_r, from_worker_w), start_new_session=True, stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        self.tx = Connection(to_worker_w, readable=False)
        self.rx = Connection(from_worker_r, writable=False)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox.put(pickle.dumps({"init": {"specs": pool.specs, "timeout_s": pool.timeout_s,
                                               "sys_path": list(sys.path)}}))
        self.killed = False
        threading.Thread(target=self._write, name=f"tidal-reward-tx{slot.index}", daemon=True).start()
        threading.Thread(target=self._read, name=f"tidal-reward-rx{slot.index}", daemon=True).start()

    def _write(self) -> None:
        while (data := self.outbox.get()) is not None:
            try:
                self.tx.send_bytes(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            self.tx.close()

    def _read(self) -> None:
        while True:
            try:
                if not self.rx.poll(1.0):
                    if self.proc.poll() is not None:
                        break
                    continue
                msg = pickle.loads(self.rx.recv_bytes())
            except (EOFError, OSError):
                break
            with self.pool.lock:
                if "results" in msg:
                    self.pool.on_results(self.slot, msg["results"])
                elif "ready" in msg:
                    self.pool.on_ready(self.slot, msg["ready"])
                elif "failed" in msg:
                    self.pool.on_start_failed(self.slot, msg["failed"], msg.get("traceback", ""))
                self.pool.flush_wakes()
        code = self.proc.wait()
        self.outbox.put(None)
        with contextlib.suppress(OSError):
            self.rx.close()
        with self.pool.lock:
            self.pool.on_exit(self.slot, _exit_text(code))
            self.pool.flush_wakes()

    def send(self, data: bytes) -> None:
        self.outbox.put(data)

    def kill(self) -> None:
        """SIGKILL to the worker's process group: a subprocess the reward started goes too
        (one that made itself a new session escapes; the sandbox's own runs are bounded)."""
        self.killed = True
        # The group outlives its leader while a member lives, so its id is not reused meanwhile.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.outbox.put(None)


class ProcessPool(PoolScorer):
    """Rewards in `reward.workers` worker processes on this machine."""

    def __init__(self, specs: list[dict[str, Any]], cfg):
        super().__init__(specs, cfg, int(cfg.workers), int(cfg.max_concurrency))

    def start_worker(self, slot: Slot) -> None:
        slot.transport = _Proc(self, slot)
        slot.pid = slot.transport.proc.pid

    def send_calls(self, slot: Slot, calls: list[Call]) -> None:
        slot.transport.send(pickle.dumps(wire(calls), protocol=pickle.HIGHEST_PROTOCOL))

    def kill_worker(self, slot: Slot) -> None:
        if slot.transport is not None:
            slot.transport.kill()

    def stop_workers(self, slots: list[Slot]) -> None:
        procs = [s.transport for s in slots if s.transport is not None]
        for p in procs:
            p.send(pickle.dumps({"close": True}))
        deadline = time.monotonic() + 5.0
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(max(0.0, deadline - time.monotonic()))
            p.kill()  # whatever is left of its process group
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(1.0)
