"""The process backend of the reward pools (reward.isolation=process): `reward.workers` worker
processes (`python -m tidal.rewards.worker`, each its own process group, and its own cgroup
where the machine allows) on this machine, spoken to over pipes; their stdout and stderr go to
train.log, bounded. How the pools work: tidal/rewards/pool.py; the limits of a worker:
tidal/rewards/limits.py."""

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

from tidal.rewards import limits
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
        out_r, out_w = os.pipe()  # the worker's stdout and stderr: to train.log, never to ours
        self.mark = limits.MarkReader(pool.n_lanes)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["PYTHONUNBUFFERED"] = "1"  # what a reward prints arrives as it prints it (os._exit loses no buffer)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tidal.rewards.worker", str(to_worker_r), str(from_worker_w), str(self.mark.fd)],
                pass_fds=(to_worker_r, from_worker_w, self.mark.fd), start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, env=env)
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
            os.close(out_w)
        self.output = limits.OutputCapture(out_r, f"reward worker {slot.index} (pid {self.proc.pid})",
                                           pool.log_bytes)
        self.cgroup = pool.cgroups.add(self.proc.pid) if pool.cgroups is not None else None  # before any reward code runs
        self.tx = Connection(to_worker_w, readable=False)
        self.rx = Connection(from_worker_r, writable=False)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox.put(pickle.dumps({"init": {"specs": pool.specs, "timeout_s": pool.timeout_s,
                                               "sys_path": list(sys.path), "lanes": pool.n_lanes,
                                               "address_space_mb": pool.address_space_mb}}))
        self.killed = False
        self._cg_lock = threading.Lock()
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
                    self.slot.zombies = msg.get("zombies", 0)
                    self.pool.on_results(self.slot, msg["results"], msg.get("rss"))
                elif "ready" in msg:
                    self.pool.on_ready(self.slot, msg["ready"])
                elif "failed" in msg:
                    self.pool.on_start_failed(self.slot, msg["failed"], msg.get("traceback", ""))
                self.pool.flush_wakes()
        code = self.proc.wait()
        running = self.mark.running()
        why = _exit_text(code)
        if self.cgroup is not None and self.cgroup.oom_killed():
            why += f": its memory limit (reward.worker_memory_mb={self.pool.memory_mb}) was reached"
        self.end_cgroup()  # whatever of its tree is left, sessions of their own included
        self.mark.close()
        self.outbox.put(None)
        with contextlib.suppress(OSError):
            self.rx.close()
        with self.pool.lock:
            self.pool.on_exit(self.slot, why, running)
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
        if self.cgroup is not None:
            self.cgroup.kill_members()
        self.outbox.put(None)

    def end_cgroup(self) -> None:
        """Empty and release the worker's cgroup, once (a released one goes to another worker)."""
        with self._cg_lock:
            cg, self.cgroup = self.cgroup, None
        limits.end_cgroup(cg)

    def close(self) -> None:
        """Ask the worker to end (it closes its rewards and kills what they started)."""
        self.send(pickle.dumps({"close": True}))


class ProcessPool(PoolScorer):
    """Rewards in `reward.workers` worker processes on this machine."""

    def __init__(self, specs: list[dict[str, Any]], cfg, n_workers: int | None = None):
        self.log_bytes = int(cfg.worker_log_bytes)
        self.address_space_mb = cfg.worker_address_space_mb
        self.memory_mb = int(cfg.worker_memory_mb)
        self.cgroups = limits.WorkerCgroups(self.memory_mb, int(cfg.worker_max_processes))
        super().__init__(specs, cfg, int(n_workers or cfg.workers), int(cfg.max_concurrency))

    def start_worker(self, slot: Slot) -> None:
        slot.transport = _Proc(self, slot)
        slot.pid = slot.transport.proc.pid

    def send_calls(self, slot: Slot, calls: list[Call]) -> None:
        slot.transport.send(pickle.dumps(wire(calls), protocol=pickle.HIGHEST_PROTOCOL))

    def kill_worker(self, slot: Slot) -> None:
        if slot.transport is not None:
            slot.transport.kill()

    def _retire(self, slot: Slot) -> None:
        slot.transport.close()
        threading.Thread(target=_end_after, args=(slot.transport, 5.0), name="tidal-reward-retire", daemon=True).start()

    def stop_workers(self, slots: list[Slot]) -> None:
        procs = [s.transport for s in slots if s.transport is not None]
        for p in procs:
            p.close()
        deadline = time.monotonic() + 5.0
        for p in procs:
            _end_after(p, max(0.0, deadline - time.monotonic()))
        for p in procs:
            p.output.thread.join(1.0)  # the last lines it printed, into train.log
        self.cgroups.close()


def _end_after(p: _Proc, wait_s: float) -> None:
    """Wait for a worker asked to end; then kill whatever is left of its process group and cgroup."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.proc.wait(wait_s)
    p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.proc.wait(1.0)
    p.end_cgroup()
