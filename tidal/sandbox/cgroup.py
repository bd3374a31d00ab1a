"""Per-run cgroups: what bounds a run as a whole (memory, processes, CPU), and how it is torn down.

Each run (each session) gets its own cgroup, made under the cgroup this process is in (read
from /proc/self/cgroup, never at a hierarchy's root unless that is where this process is),
below one directory per pool: `<own cgroup>/tidal-sandbox-<pid>-<n>/run-<k>`. cgroup v2
(one unified tree) is used where the machine has it for the memory and pids controllers;
else v1 (`/sys/fs/cgroup/memory` and `/sys/fs/cgroup/pids`, as on a hybrid host). The cpu
controller (a CPU quota per run) and the freezer (a session's processes stopped between its
turns) are used where they are available too (v1: their own hierarchies; v2: `cpu` in the
tree, `cgroup.freeze` in every non-root cgroup); where one is missing a warning says once what
is then not bounded, or, with `require_cgroups`, nothing runs.

The memory limit counts everything the kernel charges to the run's processes: anonymous
memory, memfds and tmpfs pages (the private /workspace and /tmp are charged to whoever
writes them), page cache they bring in, and kernel memory (inodes and dentries of their
files, page tables, pipe and unix socket buffers): on v1 kernel memory is charged to the same
counter (`memory.usage_in_bytes`, with its share shown in `memory.kmem.usage_in_bytes`), and
`memory.memsw.limit_in_bytes` is set equal where swap accounting exists so that swap is no
way around it; on v2 `memory.max` counts all of it and `memory.swap.max` is 0. TCP and UDP
buffers are the exception on v1: the kernel charges them to a counter of their own, and only
once that counter has a limit (`memory.kmem.tcp.limit_in_bytes`; without one a run limited
to 64 MiB held 375 MiB in loopback TCP connections): it is set to a quarter of the memory
limit (SOCKET_SHARE). On v2 they are part of `memory.max` like the rest. A run that
reaches it is OOM-killed by the kernel and ends `memory` (read from the cgroup's
`oom_kill` counter, which the code cannot write).

Teardown kills through the cgroup (v2 `cgroup.kill`; v1: SIGKILL to every member until none
is left), waits until it is empty, and removes it: a removed cgroup is the proof that no
process of the run survives, whatever it did (fork, setsid, re-parenting). One run's cgroup
is `cgroup_run.RunCgroup`.

Where no cgroup can be made (no write access, controllers not delegated), the pool says so
once, in a warning, and runs are bounded by rlimits alone (docs/sandbox.md).
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import os
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


# v1 only: TCP/UDP buffers have their own counter there, bounded at this share of the
# run's memory limit (on v2 they count inside it).
SOCKET_SHARE = 4
# Optional controllers, and what a run lacks without them (the warning says it).
OPTIONAL = {"cpu": "a run's CPU is then bounded only per process, by RLIMIT_CPU (cpu_s), not by the `cpus` quota",
            "freezer": "a session's background processes then keep running between its turns"}
# Not a controller: v1's separate counter of TCP/UDP buffers (warned about when it cannot be set).
WITHOUT = {**OPTIONAL, "socket memory": "a run's TCP and UDP buffers are then not bounded by its memory limit"}


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


def write_value(path: Path | str, value: str) -> None:
    # Raw descriptors: these files are read and written several times per run, and
    # io.open's buffered text layer costs more than the kernel's side of it.
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def read_value(path: str) -> bytes:
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
    # The cgroups this process is in, where pool directories go, by controller (v1: memory,
    # pids and those of cpu and freezer that are usable; v2: one directory for all).
    parents: dict[str, Path]
    missing: dict[str, str]  # optional controllers that cannot be used here, and why

    @property
    def hierarchies(self) -> tuple[Path, ...]:
        """The distinct parent directories (memory's first)."""
        return tuple(dict.fromkeys(self.parents.values()))

    def describe(self) -> str:
        return f"cgroup v{self.version} under {', '.join(map(str, self.hierarchies))}"


def detect() -> tuple[Layout | None, str]:
    """Where per-run cgroups can be made, or None and why not."""
    try:
        own = _own_paths()
    except OSError as e:
        return None, f"cannot read /proc/self/cgroup: {e}"
    if "memory" in own and "pids" in own:
        parents = {c: ROOT / c / own[c].lstrip("/") for c in ("memory", "pids")}
        if all(p.is_dir() for p in parents.values()):
            denied = [p for p in parents.values() if not os.access(p, os.W_OK)]
            if denied:
                return None, f"no write access to {', '.join(map(str, denied))}"
            missing = {}
            for controller in OPTIONAL:
                parent = ROOT / controller / own.get(controller, "/").lstrip("/")
                if controller not in own or not parent.is_dir():
                    missing[controller] = f"no v1 {controller} hierarchy holds this process"
                elif not os.access(parent, os.W_OK):
                    missing[controller] = f"no write access to {parent}"
                else:
                    parents[controller] = parent
            if not (parents["memory"] / "memory.kmem.tcp.limit_in_bytes").exists():
                missing["socket memory"] = "the v1 memory controller has no memory.kmem.tcp.limit_in_bytes"
            return Layout(1, parents, missing), ""
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
        parents = dict.fromkeys(("memory", "pids"), parent)
        missing = {}
        if "cpu" in available:
            parents["cpu"] = parent
        else:
            missing["cpu"] = f"the cpu controller is not available in {parent} (have: {available})"
        # cgroup.freeze is in every non-root cgroup from Linux 5.2 on.
        if parent != ROOT and not (parent / "cgroup.freeze").exists():
            missing["freezer"] = f"{parent} has no cgroup.freeze (Linux before 5.2)"
        else:
            parents["freezer"] = parent
        return Layout(2, parents, missing), ""
    return None, "neither cgroup v1 memory+pids hierarchies nor a cgroup v2 tree are mounted under /sys/fs/cgroup"


def warn_missing_once(missing: dict[str, str]) -> None:
    """One warning per missing optional controller and reason (per process)."""
    for controller, reason in missing.items():
        key = f"{controller}: {reason}"
        if key not in _warned:
            _warned.add(key)
            log.warning("sandbox: no %s controller for per-run cgroups (%s): %s (docs/sandbox.md; "
                        "sandbox.require_cgroups=true refuses to run instead)", controller, reason, WITHOUT[controller])


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
                rmdir_quietly(run)
            rmdir_quietly(d)


def _remove_at_exit() -> None:
    """At interpreter exit: the directories of pools nobody closed, where empty."""
    for pool in list(_open_pools):
        try:
            pool.remove()
        except CgroupError:
            pass


_open_pools: weakref.WeakSet[PoolCgroups] = weakref.WeakSet()
atexit.register(_remove_at_exit)


def _delegate_v2(parent: Path, controllers: list[str]) -> None:
    """Enable the controllers for the children of `parent` (this process's cgroup).
    cgroup v2 refuses that while `parent` itself holds processes (the
    no-internal-processes rule; only the root is exempt): then tidal must run in a
    cgroup with its own delegated subtree (e.g. `systemd-run --scope -p Delegate=yes`)."""
    enabled = (parent / "cgroup.subtree_control").read_text().split()
    if set(controllers) <= set(enabled):
        return
    try:
        write_value(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in controllers))
    except OSError as e:
        raise OSError(e.errno, f"cannot enable the {', '.join(controllers)} controllers below {parent} ({e.strerror}; "
                      "cgroup v2 allows that only in a cgroup without processes of its own: run tidal in a "
                      "delegated cgroup, e.g. `systemd-run --scope -p Delegate=yes ...`)") from e


class PoolCgroups:
    """The directory of one pool in each hierarchy, and the runs' cgroups below it."""

    def __init__(self, layout: Layout, sandboxes: int = 1):
        """`sandboxes`: how many of the pool's sandboxes run or start at once (concurrency
        plus warm ones): the pool's CPU weight is that many processes' (see `_weigh`)."""
        self.layout = layout
        _sweep_stale(layout.hierarchies)
        name = f"tidal-sandbox-{os.getpid()}-{next(_pool_numbers)}"
        self.dirs = tuple(parent / name for parent in layout.hierarchies)
        # Each controller's pool directory (v2: the same one for all).
        self.controller_dirs = {c: parent / name for c, parent in layout.parents.items()}
        v2_controllers = [c for c in ("memory", "pids", "cpu") if c in layout.parents]
        self.run_numbers = itertools.count()  # names the runs' cgroups (run-0, run-1, ...)
        # Emptied run cgroups, handed to later runs: making and removing a memory cgroup
        # costs more than checking that one is empty. (Appended on the event loop, taken on
        # starter threads: deque operations are atomic.)
        self.free: collections.deque = collections.deque()  # RunCgroups kept for reuse (cgroup_run.new_run)
        made = []
        try:
            if layout.version == 2:
                _delegate_v2(layout.parents["memory"], v2_controllers)
            for d in self.dirs:
                d.mkdir()
                made.append(d)
            if layout.version == 2:
                write_value(self.dirs[0] / "cgroup.subtree_control", " ".join(f"+{c}" for c in v2_controllers))
            if "cpu" in self.controller_dirs:
                self._weigh(sandboxes)
        except OSError as e:
            for d in reversed(made):
                rmdir_quietly(d)
            raise CgroupError(f"cannot make the pool's cgroup {name} ({e})") from e
        _open_pools.add(self)

    def _weigh(self, sandboxes: int) -> None:
        """Give the pool's cpu cgroup the weight of `sandboxes` ordinary processes. A cgroup
        competes for CPU as one scheduling entity of a process's default weight: left at
        that, every sandbox of the pool (the runs, the warm ones starting) would share one
        process's share of a busy host (measured at a load of 29 on two cores: 12 runs/s
        against 37 without the cpu cgroup). The pool weighs as many processes as it may
        have sandboxes running or starting at once, what they weighed as separate processes
        at most; each run below it weighs as one process (runs compete evenly, whatever
        number of processes each starts), and each is capped by its own quota."""
        if self.layout.version == 1:
            write_value(self.controller_dirs["cpu"] / "cpu.shares", str(min(262144, 1024 * sandboxes)))
        else:
            write_value(self.controller_dirs["cpu"] / "cpu.weight", str(min(10000, 100 * sandboxes)))

    def leftovers(self) -> list[str]:
        """Run cgroups still present below the pool (each one a run not torn down)."""
        return sorted({str(p) for d in self.dirs if d.exists() for p in d.iterdir() if p.is_dir()})

    def remove(self) -> None:
        """Remove the pool's directories; CgroupError naming what is left when runs remain."""
        while self.free:
            run = self.free.popleft()
            if not run.try_remove():
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


def rmdir_quietly(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


