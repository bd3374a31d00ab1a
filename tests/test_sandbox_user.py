"""The user bubblewrap runs as when tidal is root: a uid of the pool's range, its own for
each live sandbox (or the one sandbox uid without a pool), no groups, no capabilities,
whether the starter thread switches its own user (tidal/sandbox/thread_user.py) or
`setpriv` does; and the rest of the host process never changes user."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time

import pytest
from sandbox_support import require_bwrap

from tidal.sandbox import SandboxConfig, SandboxPool, launch, thread_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the user switch happens only when tidal runs as root")
UID = SandboxConfig().sandbox_uid
POOL = range(SandboxConfig().uid_pool_start, SandboxConfig().uid_pool_start + SandboxConfig().uid_pool_size)
PR_GET_DUMPABLE = 3


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}


def _bubblewrap_children() -> list[dict[str, str]]:
    """The status of every bubblewrap this process started (the warm sandboxes)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = _status(int(pid))
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0]
        except OSError:
            continue
        if int(status["PPid"]) == os.getpid() and argv0.endswith(b"bwrap"):
            found.append(status)
    return found


def _started_bubblewraps(config: SandboxConfig | None = None) -> list[dict[str, str]]:
    async def main():
        pool = SandboxPool(config or SandboxConfig(warm=2))
        try:
            result = await pool.run_python("print('ran')")
            assert result.stdout == "ran\n", result
            deadline = time.monotonic() + 10
            while not (found := _bubblewrap_children()) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return found
        finally:
            await pool.close()

    return asyncio.run(main())


def _assert_unprivileged(found: list[dict[str, str]], uids=POOL) -> None:
    """Each bubblewrap runs as one uid of `uids` (real, effective, saved, filesystem), its
    gid the same number; with a pool, no two share a uid."""
    assert found, "no warm sandbox's bubblewrap found among this process's children"
    seen = []
    for status in found:
        uid = int(status["Uid"].split()[0])
        seen.append(uid)
        assert uid in uids, (uid, uids)
        assert status["Uid"].split() == [str(uid)] * 4, status["Uid"]
        assert status["Gid"].split() == [str(uid)] * 4, status["Gid"]
        assert status["Groups"] == "", status["Groups"]
        assert int(status["CapPrm"], 16) == 0 and int(status["CapEff"], 16) == 0, (status["CapPrm"], status["CapEff"])
    if len(uids) > 1:
        assert len(set(seen)) == len(seen), f"two live sandboxes share a uid: {seen}"


def _dumpable() -> int:
    return ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)


def _assert_host_unchanged(dumpable: int) -> None:
    """Root in every id, and the dumpable flag as it was before (the switch resets it)."""
    assert os.getresuid() == (0, 0, 0) and os.getresgid() == (0, 0, 0)
    assert _dumpable() == dumpable, "the host process's dumpable flag was not restored"


def test_bubblewrap_runs_as_the_sandbox_uid_with_no_groups_or_capabilities():
    require_bwrap()
    dumpable = _dumpable()
    assert thread_user.available(), "libseccomp resolves the credential syscalls here, so no setpriv is needed"
    _assert_unprivileged(_started_bubblewraps())
    _assert_host_unchanged(dumpable)


def test_without_a_uid_pool_every_sandbox_runs_as_the_sandbox_uid():
    require_bwrap()
    _assert_unprivileged(_started_bubblewraps(SandboxConfig(warm=2, uid_pool_size=0)), uids=[UID])


def test_without_the_thread_switch_setpriv_starts_it_as_the_same_user(monkeypatch):
    require_bwrap()
    dumpable = _dumpable()
    monkeypatch.setattr(thread_user, "available", lambda: False)
    launch._command.cache_clear()
    try:
        _assert_unprivileged(_started_bubblewraps())
    finally:
        launch._command.cache_clear()
    _assert_host_unchanged(dumpable)


def test_only_the_switching_thread_changes_user_and_it_switches_back():
    dumpable = _dumpable()
    switched, checked = threading.Event(), threading.Event()
    seen = {}

    def starter():
        with thread_user.thread_runs_as(UID, UID):
            seen["inside"] = (os.getresuid(), os.getresgid(), os.getgroups())
            switched.set()
            checked.wait(10)
        seen["after"] = (os.getresuid(), os.getresgid())

    thread = threading.Thread(target=starter)
    thread.start()
    assert switched.wait(10)
    main_thread = (os.getresuid(), os.getresgid())  # while the other thread is switched
    checked.set()
    thread.join(10)
    assert seen["inside"] == ((UID, UID, 0), (UID, UID, 0), [])
    assert main_thread == ((0, 0, 0), (0, 0, 0))
    assert seen["after"] == ((0, 0, 0), (0, 0, 0))
    _assert_host_unchanged(dumpable)


def test_the_uid_pool_hands_each_uid_to_one_holder_at_a_time():
    """Two pools (as two tidal processes would: each its own lock descriptors) over one
    small range: no uid is handed out twice while held, an exhausted range says so, and
    a returned uid can be taken again."""
    from tidal.sandbox.uids import UidPool, UidPoolExhausted

    start = SandboxConfig().uid_pool_start + SandboxConfig().uid_pool_size  # past the default range
    first, second = UidPool(start, 3), UidPool(start, 3)
    taken = [first.acquire(), second.acquire(), first.acquire()]
    assert sorted(taken) == [start, start + 1, start + 2]
    with pytest.raises(UidPoolExhausted, match="all 3 sandbox uids"):
        second.acquire()
    first.release(taken[0])
    assert second.acquire() == taken[0]
    for pool in (first, second):
        for uid in pool.held():
            pool.release(uid)
