"""Start a process as another user from one thread, without a helper program.

When tidal runs as root, bubblewrap must run as the unprivileged `sandbox_uid`. The kernel
keeps credentials per thread; it is the C library's setuid family that changes them for
every thread of a process. So the starter thread switches its own user, groups and
supplementary groups with the raw system calls (as Samba's per-thread credentials do),
starts the process (a vfork and an exec, which inherit the thread's credentials) and
switches back. The rest of the process never changes user.

This replaces `setpriv`, a program executed before bubblewrap on every sandbox start
(measured: 1.5 ms of CPU per start). Python's own `subprocess.Popen(user=...)` would not
do: it changes the user in a forked child, and a fork of a large host process (a trainer)
is far dearer than a vfork.

The saved user id stays 0 while the thread runs as the other user, which is what allows
the switch back; the exec clears it (the started program's saved id is its effective one,
and it has no capabilities). Changing the effective user resets the process's "dumpable"
flag, which is the process's and not the thread's: with several starter threads switching
at once, the first one in saves it and the last one out restores it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4
# Threads switched right now, and the process's dumpable flag from before the first of them.
_switched = {"threads": 0, "dumpable": 0}
_switched_lock = threading.Lock()


class ThreadUserError(OSError):
    """A raw credential call failed."""


@functools.lru_cache(maxsize=1)
def _calls():
    """(syscall, prctl, numbers by name, ctypes) or None where the numbers are unknown
    (no libseccomp to resolve them for this architecture)."""
    import ctypes

    try:
        import pyseccomp as sc

        arch = sc.system_arch()
        numbers = {name: sc.resolve_syscall(arch, name) for name in ("setresuid", "setresgid", "setgroups")}
    except (ImportError, RuntimeError, OSError):
        return None
    if any(number < 0 for number in numbers.values()):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    return libc.syscall, libc.prctl, numbers, ctypes


def available() -> bool:
    """Whether the starter thread can switch its user itself (else `setpriv` is used)."""
    return _calls() is not None


def _raw(name: str, *args) -> None:
    syscall, _, numbers, ctypes = _calls()
    if syscall(numbers[name], *args) != 0:
        err = ctypes.get_errno()
        raise ThreadUserError(err, f"{name} failed: {os.strerror(err)}")


def _set_groups(groups: list[int]) -> None:
    ctypes = _calls()[3]
    array = (ctypes.c_uint * max(1, len(groups)))(*groups)
    _raw("setgroups", ctypes.c_size_t(len(groups)), array)


@contextlib.contextmanager
def thread_runs_as(uid: int, gid: int):
    """Within the block, the calling thread alone is `uid`:`gid` with no supplementary
    groups (saved ids unchanged); afterwards it is what it was. If switching back fails
    the thread keeps the lesser privileges and ThreadUserError says so."""
    prctl = _calls()[1]
    ruid, euid, suid = os.getresuid()  # the calling thread's: these are system calls, per thread
    rgid, egid, sgid = os.getresgid()
    groups = os.getgroups()
    with _switched_lock:
        if _switched["threads"] == 0:
            _switched["dumpable"] = prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
        _switched["threads"] += 1
    changed = []
    try:
        _set_groups([])  # while still privileged: groups, then the group, then the user
        changed.append("groups")
        _raw("setresgid", gid, gid, -1)
        changed.append("gid")
        _raw("setresuid", uid, uid, -1)
        changed.append("uid")
        yield
    finally:
        errors = []
        # The user first: back to effective root, the capabilities to set the rest return.
        for name, undo in (("uid", lambda: _raw("setresuid", ruid, euid, suid)),
                           ("gid", lambda: _raw("setresgid", rgid, egid, sgid)),
                           ("groups", lambda: _set_groups(groups))):
            if name in changed:
                try:
                    undo()
                except ThreadUserError as e:
                    errors.append(str(e))
        with _switched_lock:
            _switched["threads"] -= 1
            if _switched["threads"] == 0 and _switched["dumpable"] > 0:
                prctl(PR_SET_DUMPABLE, _switched["dumpable"], 0, 0, 0)
        if errors:
            raise ThreadUserError(0, "the sandbox starter thread could not switch back to its own user: "
                                  + "; ".join(errors))
