"""The cgroup of one run (or one session): its limits, its freezing, and its teardown.

On v1 a run has one directory per hierarchy (memory, pids, and cpu and freezer where they
are usable); on v2 one directory holds every controller. What it bounds: the run's memory
(all the kernel charges to it; on v1 TCP/UDP buffers apart, at a share of it, see
`cgroup.SOCKET_SHARE`), its processes and threads, and its CPU time per period (`cpus`,
the CFS bandwidth quota: a run of many processes gets `cpus` cores' worth, never the host).
A session's cgroup is frozen between turns, so what it left running in the background
does not run while the session holds no concurrency slot.

Teardown thaws, kills every member (v2 `cgroup.kill`; v1 SIGKILL to each until none is
left), waits until the cgroup is empty, and removes it or keeps it, uncharged, for a later
run of the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from pathlib import Path

from tidal.sandbox import cgroup
from tidal.sandbox.cgroup import (
    SOCKET_SHARE,
    CgroupError,
    PoolCgroups,
    read_value,
    rmdir_quietly,
    warn_missing_once,
    write_value,
)

# The CFS period (the kernel's default): a run may use `cpus` times this in every period.
CPU_PERIOD_US = 100_000
# v1: bound TCP/UDP buffers (memory.kmem.tcp.limit_in_bytes). False only in the tests'
# positive control, which shows what a run holds without it.
ACCOUNT_SOCKETS_V1 = True


class RunCgroup:
    """The cgroup of one run (v1: one directory per hierarchy)."""

    # An emptied cgroup still charged more than this (memory its runs left, e.g. page cache)
    # is removed rather than handed to another run.
    REUSE_MAX_BYTES = 1 << 20

    def __init__(self, pool: PoolCgroups, name: str, memory_bytes: int, max_processes: int, cpus: float):
        self.pool = pool
        self.version = pool.layout.version
        self.dirs = tuple(d / name for d in pool.dirs)
        by_controller = {c: d / name for c, d in pool.controller_dirs.items()}
        self.memory_dir, self.pids_dir = by_controller["memory"], by_controller["pids"]
        self.cpu_dir: Path | None = by_controller.get("cpu")
        self.freezer_dir: Path | None = by_controller.get("freezer")
        self.removed = False
        self.frozen = False
        self.oom_kills_before = 0
        self.limits: tuple[int, int, float] | None = None
        # Paths as strings, made once: the per-run checks read them.
        self._procs = [str(d / "cgroup.procs") for d in self.dirs]
        self._tasks = [(str(d / "tasks"), str(d.parent.parent / "tasks")) for d in self.dirs]
        self._oom_file = str(self.memory_dir / ("memory.oom_control" if self.version == 1 else "memory.events"))
        self._usage_file = str(self.memory_dir / ("memory.usage_in_bytes" if self.version == 1 else "memory.current"))
        tcp = self.memory_dir / "memory.kmem.tcp.limit_in_bytes"
        self._tcp_file = str(tcp) if self.version == 1 and ACCOUNT_SOCKETS_V1 else None
        if self.freezer_dir is None:
            self._freeze_file = None
        else:
            self._freeze_file = str(self.freezer_dir / ("freezer.state" if self.version == 1 else "cgroup.freeze"))
        made = []
        try:
            for d in self.dirs:
                d.mkdir()
                made.append(d)
            if self._tcp_file is not None and not tcp.exists():
                self._tcp_file = None  # a kernel without socket accounting on v1 (the pool warned)
            if self._freeze_file is not None and not os.path.exists(self._freeze_file):
                self._freeze_file = None  # v2 before Linux 5.2: no cgroup.freeze (the pool warned)
            if self.version == 2 and (self.memory_dir / "memory.swap.max").exists():
                write_value(self.memory_dir / "memory.swap.max", "0")
            self.set_limits(memory_bytes, max_processes, cpus)
        except (OSError, CgroupError) as e:
            for d in reversed(made):
                rmdir_quietly(d)
            raise CgroupError(f"cannot make the run's cgroup {self.memory_dir} ({e})") from e

    def reuse(self, memory_bytes: int, max_processes: int, cpus: float) -> None:
        """Hand this emptied cgroup to a new run."""
        self.removed = False
        self.oom_kills_before = self._oom_kills()
        self.set_limits(memory_bytes, max_processes, cpus)

    def set_limits(self, memory_bytes: int, max_processes: int, cpus: float) -> None:
        """The memory limit of the whole run, its process count (threads included; one
        more for bubblewrap's own process, outside the sandbox's user namespace) and its CPU
        quota (`cpus` cores' worth per period)."""
        if self.limits == (memory_bytes, max_processes, cpus):
            return
        quota_us = max(1000, round(cpus * CPU_PERIOD_US))  # the kernel's minimum quota is 1 ms
        try:
            if self.version == 1:
                memsw = self.memory_dir / "memory.memsw.limit_in_bytes"
                # memsw must stay >= the memory limit: raise them in the order that keeps it so.
                order = [self.memory_dir / "memory.limit_in_bytes", memsw] if memsw.exists() \
                    else [self.memory_dir / "memory.limit_in_bytes"]
                if self.limits is not None and memory_bytes > self.limits[0]:
                    order.reverse()
                for path in order:
                    write_value(path, str(memory_bytes))
                if self._tcp_file is not None:
                    self._bound_sockets_v1(memory_bytes // SOCKET_SHARE)
                write_value(self.pids_dir / "pids.max", str(max_processes + 1))
                if self.cpu_dir is not None:
                    write_value(self.cpu_dir / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                    write_value(self.cpu_dir / "cpu.cfs_quota_us", str(quota_us))
            else:
                write_value(self.memory_dir / "memory.max", str(memory_bytes))
                write_value(self.pids_dir / "pids.max", str(max_processes + 1))
                if self.cpu_dir is not None:
                    write_value(self.cpu_dir / "cpu.max", f"{quota_us} {CPU_PERIOD_US}")
        except OSError as e:
            raise CgroupError(f"cannot set the limits of {self.memory_dir} ({e})") from e
        self.limits = (memory_bytes, max_processes, cpus)

    def _bound_sockets_v1(self, limit: int) -> None:
        """The v1 TCP/UDP buffer limit; a kernel that refuses it (socket accounting off, e.g.
        booted with cgroup.memory=nosocket) gets a warning, once, and runs go on without it."""
        try:
            write_value(self._tcp_file, str(limit))
        except OSError as e:
            warn_missing_once({"socket memory": f"cannot write {self._tcp_file}: {e.strerror}"})
            self._tcp_file = None

    def add(self, pid: int) -> None:
        """Move a process (not yet running untrusted code) into this cgroup."""
        for d in self.dirs:
            write_value(d / "cgroup.procs", str(pid))

    @property
    def thread_entry(self) -> bool:
        return self.version == 1 and cgroup.THREAD_ENTRY  # the module's: tests switch it

    @contextlib.contextmanager
    def entered_by_this_thread(self):
        """v1 only: move the calling thread alone into this cgroup while the block runs, so
        that a process it starts there is born in it (no later migration; a thread moving
        itself skips the global lock that moving another process takes)."""
        moved = []
        try:
            for inside, home in self._tasks:
                write_value(inside, "0")
                moved.append(home)
            yield
        finally:
            for home in moved:
                write_value(home, "0")

    @property
    def can_freeze(self) -> bool:
        return self._freeze_file is not None

    def freeze(self) -> None:
        """Stop every process of the run where it stands (a session between turns). v1's
        freezer finishes asynchronously; nothing waits for it."""
        if self._freeze_file is not None and not self.frozen:
            write_value(self._freeze_file, "FROZEN" if self.version == 1 else "1")
            self.frozen = True

    def thaw(self) -> None:
        if self._freeze_file is not None and self.frozen:
            write_value(self._freeze_file, "THAWED" if self.version == 1 else "0")
            self.frozen = False

    def pids(self) -> list[int]:
        out: set[int] = set()
        for path in self._procs:
            try:
                out.update(int(p) for p in read_value(path).split())
            except FileNotFoundError:
                pass
        return sorted(out)

    def _oom_kills(self) -> int:
        try:
            text = read_value(self._oom_file)
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith(b"oom_kill "):
                return int(line.split()[1])
        return 0

    def oom_killed(self) -> bool:
        """Whether the kernel OOM-killed a process of the run (the memory limit was reached)."""
        return self._oom_kills() > self.oom_kills_before

    def _charged_bytes(self) -> int:
        try:
            return int(read_value(self._usage_file))
        except (OSError, ValueError):
            return self.REUSE_MAX_BYTES + 1

    def kill_members(self, members: list[int] | None = None) -> None:
        # A frozen v1 task does not act on SIGKILL until thawed: thaw first (the run is over).
        with contextlib.suppress(OSError):
            self.thaw()
        if self.version == 2:
            try:
                write_value(self.memory_dir / "cgroup.kill", "1")
                return
            except OSError:
                pass  # kernels before 5.14 have no cgroup.kill: signal each member
        for pid in self.pids() if members is None else members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def destroy(self, timeout_s: float) -> None:
        """Kill every process in the cgroup, wait until none is left, and remove the cgroup
        or, empty and (almost) uncharged, keep it for another run of the pool. CgroupError
        (naming the survivors) if that takes longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while not self._teardown_round(deadline, timeout_s):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def destroy_sync(self, timeout_s: float) -> None:
        """`destroy` for a thread without an event loop (a start that failed half-way)."""
        deadline = time.monotonic() + timeout_s
        while not self._teardown_round(deadline, timeout_s):
            time.sleep(0.005)

    def _teardown_round(self, deadline: float, timeout_s: float) -> bool:
        """One round of teardown: True once the cgroup is released (kept for reuse or removed);
        otherwise its members are killed again, and past `deadline` CgroupError names them."""
        if self.removed:
            return True
        members = self.pids()
        if not members and self._release():
            return True
        self.kill_members(members)
        if time.monotonic() > deadline:
            raise CgroupError(f"sandbox processes {self.pids()} in {self.memory_dir} survived SIGKILL for "
                              f"{timeout_s:.0f} s")
        return False

    def _release(self) -> bool:
        """An empty cgroup: keep it for another run if (almost) nothing is charged to it,
        else remove it. False if the kernel still counts a process in it."""
        with contextlib.suppress(OSError):
            self.thaw()
        if self._charged_bytes() <= self.REUSE_MAX_BYTES:
            self.removed = True
            self.pool.free.append(self)
            return True
        if self.try_remove():
            self.removed = True
            return True
        return False

    def try_remove(self) -> bool:
        """Remove the run's directories; False when one is still busy (the pool retries it later)."""
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno == errno.EBUSY:
                    return False
                raise CgroupError(f"cannot remove {d}: {e}") from e
        return True


def new_run(pool: PoolCgroups, memory_bytes: int, max_processes: int, cpus: float) -> RunCgroup:
    """A run's cgroup under `pool`: one the pool kept for reuse (re-limited), else a new one."""
    try:
        run = pool.free.popleft()
    except IndexError:
        return RunCgroup(pool, f"run-{next(pool.run_numbers)}", memory_bytes, max_processes, cpus)
    run.reuse(memory_bytes, max_processes, cpus)
    return run
