"""The bounds of one reward worker process: its memory, its processes, its output, its life.

Worker side (called in `python -m tidal.rewards.worker`):
- the worker is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): a process a reward starts
  stays its descendant even when its parent exits or it starts a new session, so the worker
  can find it; after every call that leaves the worker idle, the processes of the worker's
  own process group (what `subprocess`/`os.fork` start by default) are killed
  (`end_group_children`); when the worker ends, every descendant is (`end_descendants`).
  Processes in a session of their own (a sandbox pool's warm sandboxes) live until then.
- `rss_bytes`: the worker's resident memory, reported with every answer; the driver recycles
  a worker past `reward.worker_max_rss_mb` (or `reward.worker_max_calls` calls).
- `CrashMark`: 8 bytes a sync lane of memory shared with the driver (a memfd) holding the
  id of the synchronous call running in that lane, so that a crash (a segfault, the OOM
  killer) is charged to that call alone (several running: each runs again alone, which tells).

Driver side:
- `WorkerCgroups`: each worker in a cgroup of its own (memory.max = `reward.worker_memory_mb`,
  pids.max = `reward.worker_max_processes`), made with the sandbox's cgroup code
  (tidal/sandbox/cgroup.py) under the cgroup tidal runs in; a worker's end kills through it,
  which no process of its tree escapes. Where no cgroup can be made (no write access,
  controllers not delegated), one warning says so and the worker is bounded by the RSS
  recycling, `reward.worker_address_space_mb` (RLIMIT_AS, off by default: an address-space
  limit also counts the reservations of libraries such as torch) and the subreaper alone.
- `OutputCapture`: the worker's stdout and stderr are one pipe, read by a thread of the
  driver into train.log (logger `tidal.rewards.output`, INFO, one record per line, prefixed
  with the worker): at most `reward.worker_log_bytes` per worker are logged, the rest is read
  and dropped (and counted): a reward that prints 100 MB costs a bounded amount of log and
  memory, never blocks on a full pipe, and never writes into tidal's own stdout.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import signal
import struct
import threading
import time

from tidal.sandbox import cgroup, cgroup_run
from tidal.sandbox.cgroup import CgroupError

log = logging.getLogger("tidal.rewards")
out_log = logging.getLogger("tidal.rewards.output")

PR_SET_CHILD_SUBREAPER = 36
_PAGE = os.sysconf("SC_PAGE_SIZE")
LINE_MAX = 4096  # longer lines are logged cut, with their length


# -- worker side -------------------------------------------------------------------------------
def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def set_address_space(mb: int | None) -> None:
    if mb:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (mb << 20, mb << 20))


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(p) for p in f.read().split()]
    return out


def descendants(pid: int | None = None) -> list[int]:
    """Every live descendant of `pid` (this process by default), parents before children."""
    todo, out = [pid or os.getpid()], []
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def has_children() -> bool:
    """Whether this process has any child (running or exited), in one system call: the sweep
    after each call costs nothing for a reward that starts no process."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def zombies() -> int:
    """Exited children nobody has waited for. As a subreaper the worker inherits the orphans of
    what rewards start (a sandbox's processes killed together); it does not wait for them (a
    reward's own `Popen` may still want a child's status), so the driver recycles a worker
    that holds more than pool.MAX_ZOMBIES, before they use up its process limit."""
    n = 0
    for child in _children(os.getpid()) if has_children() else ():
        try:
            with open(f"/proc/{child}/stat", "rb") as f:
                n += f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except (OSError, IndexError):
            continue
    return n


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def end_group_children() -> int:
    """SIGKILL the descendants in this process's process group; returns how many were."""
    if not has_children():
        return 0
    me, group = os.getpid(), os.getpgrp()
    mine = [p for p in descendants(me) if _pgid(p) == group]
    _kill_and_reap(mine)
    return len(mine)


def end_descendants(timeout_s: float = 2.0) -> None:
    """SIGKILL every descendant, again until none is left (a dying parent's children come to us)."""
    deadline = time.monotonic() + timeout_s
    while (left := descendants()) and time.monotonic() < deadline:
        _kill_and_reap(left)
        time.sleep(0.005)


def _kill_and_reap(pids: list[int]) -> None:
    """SIGKILL each, then collect those that are this process's children (as the subreaper, a
    dead parent's children are ours to wait for). Only killed processes are waited for: a
    reward's own `subprocess.Popen` keeps the status of a child that exited by itself."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    for p in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(p, 0)  # returns at once for a killed child; ECHILD for another's


class CrashMark:
    """The id of the synchronous call running now in each lane (+1; 0: none), in memory the
    driver reads after the worker died."""

    def __init__(self, fd: int | None, lanes: int = 1):
        self._map = mmap.mmap(fd, 8 * lanes) if fd is not None else None

    def set(self, call_id: int | None, lane: int = 0) -> None:
        if self._map is not None:
            struct.pack_into("q", self._map, 8 * lane, 0 if call_id is None else call_id + 1)


# -- driver side -------------------------------------------------------------------------------
class MarkReader:
    """The driver's end of a worker's CrashMark: a memfd passed to the worker, 8 bytes a lane."""

    def __init__(self, lanes: int = 1):
        self.lanes = lanes
        self.fd = os.memfd_create("tidal-reward-mark", 0)
        os.ftruncate(self.fd, 8 * lanes)
        self._map = mmap.mmap(self.fd, 8 * lanes)

    def running(self) -> set[int]:
        """The ids of the synchronous calls running when the worker died (one per busy lane)."""
        values = struct.unpack_from(f"{self.lanes}q", self._map, 0)
        return {v - 1 for v in values if v > 0}

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError, BufferError):
            self._map.close()
            os.close(self.fd)


class WorkerCgroups:
    """A cgroup per worker process, under one pool directory; None per worker where the
    machine gives none (said once)."""

    def __init__(self, memory_mb: int, max_processes: int):
        self.memory_bytes, self.max_processes = memory_mb << 20, max_processes
        self.pool = None
        layout, why = cgroup.detect()
        if layout is not None:
            try:
                self.pool = cgroup.PoolCgroups(layout, kind="rewards")
            except cgroup.CgroupError as e:
                why = str(e)
        if self.pool is None:
            _warn_once(f"reward workers run without a cgroup ({why}): their memory is bounded by "
                       "reward.worker_max_rss_mb recycling (and reward.worker_address_space_mb where set), their "
                       "process count is not bounded, and a process a reward started in a session of its own "
                       "outlives a worker that is killed (docs/rewards.md, Limits)")

    def add(self, pid: int):
        """Put a worker that has not run reward code yet into a cgroup of its own (None: none)."""
        if self.pool is None:
            return None
        try:
            # Every core: a reward worker's CPU is not bounded here (the sandbox's quota is for its runs).
            cg = cgroup_run.new_run(self.pool, self.memory_bytes, self.max_processes, float(os.cpu_count() or 1))
            cg.add(pid)
            return cg
        except (CgroupError, OSError) as e:
            _warn_once(f"a reward worker could not be put in a cgroup ({e}); it runs without one")
            return None

    def close(self) -> None:
        if self.pool is not None:
            with contextlib.suppress(CgroupError, OSError):
                self.pool.remove()


def end_cgroup(cg, timeout_s: float = 5.0) -> None:
    """Kill whatever is left in a worker's cgroup and release it."""
    if cg is None:
        return
    try:
        cg.destroy_sync(timeout_s)
    except (CgroupError, OSError) as e:
        log.warning("a reward worker's cgroup could not be emptied: %s", e)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


class OutputCapture:
    """Reads a worker's stdout+stderr pipe in a thread into train.log, bounded."""

    def __init__(self, fd: int, name: str, budget_bytes: int):
        self.fd, self.name, self.budget = fd, name, budget_bytes
        self.logged = 0
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name=f"tidal-reward-out-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        rest = b""
        try:
            while chunk := os.read(self.fd, 1 << 16):
                if self.logged >= self.budget:
                    self.dropped += len(chunk)
                    continue
                rest += chunk
                *lines, rest = rest.split(b"\n")
                if len(rest) > LINE_MAX:
                    lines.append(rest)
                    rest = b""
                for line in lines:
                    self._line(line)
        except OSError:
            pass
        finally:
            if rest:
                self._line(rest)
            with contextlib.suppress(OSError):
                os.close(self.fd)
            if self.dropped:
                out_log.info("%s: %d more bytes of output were dropped (reward.worker_log_bytes=%d)", self.name,
                             self.dropped, self.budget)

    def _line(self, line: bytes) -> None:
        if self.logged >= self.budget:
            self.dropped += len(line) + 1
            return
        self.logged += len(line) + 1
        text = line[:LINE_MAX].decode("utf-8", "replace")
        if len(line) > LINE_MAX:
            text += f" ... ({len(line)} bytes)"
        out_log.info("%s: %s", self.name, text)
