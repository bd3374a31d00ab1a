"""Shared by the sandbox tests: when bubblewrap must be present, and what the host shows.

Tests that need bubblewrap skip only where it is truly absent and could not have been
installed (scripts/setup.sh installs it as root with apt-get); on such a machine, or with
TIDAL_REQUIRE_BWRAP=1, its absence is a failure, so CI never passes by skipping them.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import re
import shutil
import time
from pathlib import Path

import pytest

from tidal.sandbox import SandboxConfig
from tidal.sandbox.launch import sandbox_uid


def require_bwrap() -> None:
    if shutil.which("bwrap"):
        return
    installable = os.geteuid() == 0 and shutil.which("apt-get") is not None
    if os.environ.get("TIDAL_REQUIRE_BWRAP") == "1" or installable:
        pytest.fail("bubblewrap (bwrap) is not installed although this machine could install it "
                    "(scripts/setup.sh does, as root with apt-get); sandbox tests do not skip here", pytrace=False)
    pytest.skip("bubblewrap is not installed and cannot be here (not root, or no apt-get); "
                "TIDAL_REQUIRE_BWRAP=1 makes this a failure")


def _pid_namespace(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


_OTHER_POOL = re.compile(r"/tidal-sandbox-(\d+)-\d+(/|$)")


def _in_another_live_pool(pid: str) -> bool:
    """Whether the process sits in the run cgroup of another live process's sandbox pool
    (tidal/sandbox/cgroup.py names them tidal-sandbox-<owner pid>-<n>): a suite running beside
    this one. A process of ours, or one that left every pool's cgroup, still counts."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            owners = {int(m.group(1)) for line in f for m in [_OTHER_POOL.search(line)] if m}
    except OSError:
        return False
    return bool(owners) and os.getpid() not in owners and all(os.path.exists(f"/proc/{o}") for o in owners)


def _is_sandbox_uid(uid: int) -> bool:
    """A uid sandboxes run as: the configured sandbox uid, or one of the uid pool's range
    (when tidal runs as root; else the current user, which is never counted by uid)."""
    config = SandboxConfig()
    if os.geteuid() != 0:
        return False
    return uid == config.sandbox_uid or config.uid_pool_start <= uid < config.uid_pool_start + config.uid_pool_size


def sandbox_processes() -> list[str]:
    """Live (not zombie) processes that belong to a sandbox: run as the sandbox uid (when
    that is not ours) or in a PID namespace other than ours, except those in another live
    process's pool. Zombies are left out: the inner bubblewrap is reaped by the host's init,
    which may take a moment."""
    own_ns = _pid_namespace("self")
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        if fields.get("State", "").strip().startswith("Z"):
            continue
        process_uid = int(fields["Uid"].split()[0])
        ns = _pid_namespace(pid)
        if (_is_sandbox_uid(process_uid) or (ns is not None and ns != own_ns)) \
                and not _in_another_live_pool(pid):
            found.append(f"{pid} uid={process_uid} {cmdline}")
    return found


def wait_for_no_sandbox_processes(timeout_s: float = 5.0) -> list[str]:
    """Sandbox processes still alive after up to `timeout_s` (teardown is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while (left := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def own_pool_cgroups() -> list[Path]:
    """The pool cgroup directories this process has left (none may remain)."""
    roots = [Path("/sys/fs/cgroup") / c for c in ("pids", "memory", "cpu", "freezer")] + [Path("/sys/fs/cgroup")]
    return [d for root in roots if root.is_dir() for d in root.rglob(f"tidal-sandbox-{os.getpid()}-*")]


def own_sandbox_processes() -> list[str]:
    """Live processes of the sandbox uid that descend from this process (another tidal
    process's sandboxes on the same machine are not ours to count)."""
    own_uid = sandbox_uid(SandboxConfig())  # not root: sandboxes run as this user
    parents, found = {}, []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        parents[int(pid)] = (int(fields["PPid"]), int(fields["Uid"].split()[0]), fields["State"].strip())
    for pid, (ppid, process_uid, state) in parents.items():
        if not (_is_sandbox_uid(process_uid) or process_uid == own_uid) or state.startswith("Z"):
            continue
        seen = set()
        while ppid > 1 and ppid not in seen:
            if ppid == os.getpid():
                found.append(f"{pid} uid={process_uid} {state}")
                break
            seen.add(ppid)
            ppid = parents.get(ppid, (0,))[0]
    return found


def settled_rss_bytes() -> int:
    """This process's resident memory once freed memory has gone back to the system. Without
    the trim, glibc keeps freed heap pages resident, and how many depends on what ran before in
    the same process: in the full suite, 65 MiB of a flood's freed output buffers stayed."""
    gc.collect()
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
