"""Per-run memory and process cgroups: what bounds a run as a whole, and how it is torn down.

Each run (each session) gets its own cgroup, made under the cgroup this process is in (read
from /proc/self/cgroup, never at a hierarchy's root unless that is where this process is),
below one directory per pool: `<own cgroup>/tidal-sandbox-<pid>-<n>/run-<k>`. cgroup v2
(one unified tree) is used where the machine has it for the memory and pids controllers;
else v1 (`/sys/fs/cgroup/memory` and `/sys/fs/cgroup/pids`, as on a hybrid host).

The memory limit counts everything the kernel charges to the run's processes: anonymous
memory, memfds and tmpfs pages (the private /workspace and /tmp are charged to whoever
writes them), page cache they bring in, and kernel memory (inodes and dentries of their
files, page tables, socket buffers): on v1 kernel memory is charged to the same counter
(`memory.usage_in_bytes`, with its share shown in `memory.kmem.usage_in_bytes`), and
`memory.memsw.limit_in_bytes` is set equal where swap accounting exists so that swap is no
way around it; on v2 `memory.max` counts all of it and `memory.swap.max` is 0. A run that
reaches it is OOM-killed by the kernel and ends `memory` (read from the cgroup's
`oom_kill` counter, which the code cannot write).

Teardown kills through the cgroup (v2 `cgroup.kill`; v1: SIGKILL to every member until none
is left), waits until it is empty, and removes it: a removed cgroup is the proof that no
process of the run survives, whatever it did (fork, setsid, re-parenting).

Where no cgroup can be made (no write access, controllers not delegated), the pool says so
once, in a warning, and runs are bounded by rlimits alone (docs/sandbox.md).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import errno
import itertools
import logging
import os
import signal
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tidal.sandbox")

ROOT = Path("/sys/fs/cgroup")
# v1: the starting thread enters the run's cgroups alone, so the sandbox is born in them.
# False (and always on v2, where a thread cannot hold a memory cgroup of its own): the
# sandbox's init is moved in while bubblewrap holds it. (Tests take that path on v1 too.)
THREAD_ENTRY = True
_pool_numbers = itertools.count()
_warned: set[str] = set()


class CgroupError(RuntimeError):
    """A run's cgroup could not be made, filled or removed."""


def _own_paths() -> dict[str, str]:
    """This process's cgroup per v1 controller, and under "" its v2 cgroup."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            paths[controller] = path
    return paths


def _write(path: Path | str, value: str) -> None:
    # Raw descriptors: these files are read and written several times per run, and
    # io.open's buffered text layer costs more than the kernel's side of it.
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Layout:
    version: int  # 1 or 2
    parents: tuple[Path, ...]  # the cgroups this process is in, where pool directories go (v1: memory, pids)

    def describe(self) -> str:
        return f"cgroup v{self.version} under {', '.join(map(str, self.parents))}"


def detect() -> tuple[Layout | None, str]:
    """Where per-run cgroups can be made, or None and why not."""
    try:
        own = _own_paths()
    except OSError as e:
        return None, f"cannot read /proc/self/cgroup: {e}"
    if "memory" in own and "pids" in own:
        parents = (ROOT / "memory" / own["memory"].lstrip("/"), ROOT / "pids" / own["pids"].lstrip("/"))
        if all(p.is_dir() for p in parents):
            missing = [p for p in parents if not os.access(p, os.W_OK)]
            if missing:
                return None, f"no write access to {', '.join(map(str, missing))}"
            return Layout(1, parents), ""
    if "" in own and (ROOT / "cgroup.controllers").exists():
        parent = ROOT / own[""].lstrip("/")
        try:
            available = (parent / "cgroup.controllers").read_text().split()
        except OSError as e:
            return None, f"cannot read {parent / 'cgroup.controllers'}: {e}"
        if not {"memory", "pids"} <= set(available):
            return None, f"the memory and pids controllers are not available in {parent} (have: {available})"
        if not os.access(parent, os.W_OK):
            return None, f"no write access to {parent}"
        return Layout(2, (parent,)), ""
    return None, "neither cgroup v1 memory+pids hierarchies nor a cgroup v2 tree are mounted under /sys/fs/cgroup"


def warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("sandbox: no per-run cgroups (%s); runs are bounded by rlimits only: a run's memory outside "
                    "its address space (memfds, tmpfs pages, kernel memory) and its total over processes are not "
                    "bounded, and teardown relies on the PID namespace alone (docs/sandbox.md)", reason)


def _sweep_stale(parents: tuple[Path, ...]) -> None:
    """Remove the empty pool directories of tidal processes that are gone (a process that
    died without closing its pools); a populated one is left alone."""
    for parent in parents:
        for d in parent.glob("tidal-sandbox-*-*"):
            try:
                pid = int(d.name.split("-")[2])
            except ValueError:
                continue
            if pid == os.getpid() or Path(f"/proc/{pid}").exists():
                continue
            for run in d.glob("run-*"):
                _rmdir_quietly(run)
            _rmdir_quietly(d)


def _remove_at_exit() -> None:
    """At interpreter exit: the directories of pools nobody closed, where empty."""
    for pool in list(_open_pools):
        try:
            pool.remove()
        except CgroupError:
            pass


_open_pools: weakref.WeakSet[PoolCgroups] = weakref.WeakSet()
atexit.register(_remove_at_exit)


def _delegate_v2(parent: Path) -> None:
    """Enable the memory and pids controllers for the children of `parent` (this process's
    cgroup). cgroup v2 refuses that while `parent` itself holds processes (the
    no-internal-processes rule; only the root is exempt): then tidal must run in a
    cgroup with its own delegated subtree (e.g. `systemd-run --scope -p Delegate=yes`)."""
    enabled = (parent / "cgroup.subtree_control").read_text().split()
    if {"memory", "pids"} <= set(enabled):
        return
    try:
        _write(parent / "cgroup.subtree_control", "+memory +pids")
    except OSError as e:
        raise OSError(e.errno, f"cannot enable the memory and pids controllers below {parent} ({e.strerror}; "
                      "cgroup v2 allows that only in a cgroup without processes of its own: run tidal in a "
                      "delegated cgroup, e.g. `systemd-run --scope -p Delegate=yes ...`)") from e


class PoolCgroups:
    """The directory of one pool in each hierarchy, and the runs' cgroups below it."""

    def __init__(self, layout: Layout):
        self.layout = layout
        _sweep_stale(layout.parents)
        name = f"tidal-sandbox-{os.getpid()}-{next(_pool_numbers)}"
        self.dirs = tuple(parent / name for parent in layout.parents)
        self._runs = itertools.count()
        # Emptied run cgroups, handed to later runs: making and removing a memory cgroup
        # costs more than checking that one is empty. (Appended on the event loop, taken on
        # starter threads: deque operations are atomic.)
        self.free: collections.deque[RunCgroup] = collections.deque()
        made = []
        try:
            if layout.version == 2:
                _delegate_v2(layout.parents[0])
            for d in self.dirs:
                d.mkdir()
                made.append(d)
            if layout.version == 2:
                _write(self.dirs[0] / "cgroup.subtree_control", "+memory +pids")
        except OSError as e:
            for d in reversed(made):
                _rmdir_quietly(d)
            raise CgroupError(f"cannot make the pool's cgroup {name} ({e})") from e
        _open_pools.add(self)

    def new_run(self, memory_bytes: int, max_processes: int) -> RunCgroup:
        try:
            run = self.free.popleft()
        except IndexError:
            return RunCgroup(self, f"run-{next(self._runs)}", memory_bytes, max_processes)
        run.reuse(memory_bytes, max_processes)
        return run

    def leftovers(self) -> list[str]:
        """Run cgroups still present below the pool (each one a run not torn down)."""
        return sorted({str(p) for d in self.dirs if d.exists() for p in d.iterdir() if p.is_dir()})

    def remove(self) -> None:
        """Remove the pool's directories; CgroupError naming what is left when runs remain."""
        while self.free:
            run = self.free.popleft()
            if not run._try_remove():
                raise CgroupError(f"sandbox cgroup {run.dirs[0]} is not empty")
        left = self.leftovers()
        if left:
            raise CgroupError(f"sandbox cgroups still present: {left}")
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                raise CgroupError(f"cannot remove {d}: {e}") from e
        _open_pools.discard(self)


def _rmdir_quietly(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


class RunCgroup:
    """The cgroup of one run (v1: one in the memory and one in the pids hierarchy)."""

    # An emptied cgroup still charged more than this (memory its runs left, e.g. page cache)
    # is removed rather than handed to another run.
    REUSE_MAX_BYTES = 1 << 20

    def __init__(self, pool: PoolCgroups, name: str, memory_bytes: int, max_processes: int):
        self.pool = pool
        self.version = pool.layout.version
        self.dirs = tuple(d / name for d in pool.dirs)
        self.removed = False
        self.oom_kills_before = 0
        self.limits: tuple[int, int] | None = None
        # Paths as strings, made once: the per-run checks read them.
        self._procs = [str(d / "cgroup.procs") for d in self.dirs]
        self._tasks = [(str(d / "tasks"), str(d.parent.parent / "tasks")) for d in self.dirs]
        self._oom_file = str(self.dirs[0] / ("memory.oom_control" if self.version == 1 else "memory.events"))
        self._usage_file = str(self.dirs[0] / ("memory.usage_in_bytes" if self.version == 1 else "memory.current"))
        made = []
        try:
            for d in self.dirs:
                d.mkdir()
                made.append(d)
            if self.version == 2 and (self.dirs[0] / "memory.swap.max").exists():
                _write(self.dirs[0] / "memory.swap.max", "0")
            self.set_limits(memory_bytes, max_processes)
        except (OSError, CgroupError) as e:
            for d in reversed(made):
                _rmdir_quietly(d)
            raise CgroupError(f"cannot make the run's cgroup {self.dirs[0]} ({e})") from e

    def reuse(self, memory_bytes: int, max_processes: int) -> None:
        """Hand this emptied cgroup to a new run."""
        self.removed = False
        self.oom_kills_before = self._oom_kills()
        self.set_limits(memory_bytes, max_processes)

    def set_limits(self, memory_bytes: int, max_processes: int) -> None:
        """The memory limit of the whole run and its process count (threads included; one
        more for bubblewrap's own process, outside the sandbox's user namespace)."""
        if self.limits == (memory_bytes, max_processes):
            return
        try:
            if self.version == 1:
                memory, pids = self.dirs
                memsw = memory / "memory.memsw.limit_in_bytes"
                # memsw must stay >= the memory limit: raise them in the order that keeps it so.
                order = [memory / "memory.limit_in_bytes", memsw] if memsw.exists() else [memory / "memory.limit_in_bytes"]
                if self.limits is not None and memory_bytes > self.limits[0]:
                    order.reverse()
                for path in order:
                    _write(path, str(memory_bytes))
                _write(pids / "pids.max", str(max_processes + 1))
            else:
                _write(self.dirs[0] / "memory.max", str(memory_bytes))
                _write(self.dirs[0] / "pids.max", str(max_processes + 1))
        except OSError as e:
            raise CgroupError(f"cannot set the limits of {self.dirs[0]} ({e})") from e
        self.limits = (memory_bytes, max_processes)

    def add(self, pid: int) -> None:
        """Move a process (not yet running untrusted code) into this cgroup."""
        for d in self.dirs:
            _write(d / "cgroup.procs", str(pid))

    @property
    def thread_entry(self) -> bool:
        return self.version == 1 and THREAD_ENTRY

    @contextlib.contextmanager
    def entered_by_this_thread(self):
        """v1 only: move the calling thread alone into this cgroup while the block runs, so
        that a process it starts there is born in it (no later migration; a thread moving
        itself skips the global lock that moving another process takes)."""
        moved = []
        try:
            for inside, home in self._tasks:
                _write(inside, "0")
                moved.append(home)
            yield
        finally:
            for home in moved:
                _write(home, "0")

    def pids(self) -> list[int]:
        out: set[int] = set()
        for path in self._procs:
            try:
                out.update(int(p) for p in _read(path).split())
            except FileNotFoundError:
                pass
        return sorted(out)

    def _oom_kills(self) -> int:
        try:
            text = _read(self._oom_file)
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
            return int(_read(self._usage_file))
        except (OSError, ValueError):
            return self.REUSE_MAX_BYTES + 1

    def kill_members(self, members: list[int] | None = None) -> None:
        if self.version == 2:
            try:
                _write(self.dirs[0] / "cgroup.kill", "1")
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
            raise CgroupError(f"sandbox processes {self.pids()} in {self.dirs[0]} survived SIGKILL for "
                              f"{timeout_s:.0f} s")
        return False

    def _release(self) -> bool:
        """An empty cgroup: keep it for another run if (almost) nothing is charged to it,
        else remove it. False if the kernel still counts a process in it."""
        if self._charged_bytes() <= self.REUSE_MAX_BYTES:
            self.removed = True
            self.pool.free.append(self)
            return True
        if self._try_remove():
            self.removed = True
            return True
        return False

    def _try_remove(self) -> bool:
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
