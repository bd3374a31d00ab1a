"""The syscall filter of every sandboxed process: a seccomp-BPF program given to bubblewrap.

Built once per process with libseccomp (through `pyseccomp`, ctypes over the system's
libseccomp2) and handed to bubblewrap on a pipe (`--seccomp FD`), which installs it just
before it executes the runner, after its own set-up: the runner, the code and everything
they start carry it, and no process can remove it (filters only ever add up).

The default is to allow: what is denied below is the kernel surface a program has no use
for and that escapes, privilege escalations and cross-run channels go through. The list
covers what Docker's and Flatpak's default profiles deny. Denied calls fail with EPERM
(clone3 with ENOSYS, so that the C library falls back to clone, whose flags the filter can
read); nothing is killed for asking. A syscall of another ABI (i386 `int 0x80`, x32 on
x86-64) kills the process: the filter only knows the native numbers.

Arguments the kernel reads as a C `int` (a socket's family, an ioctl request) are compared
on their low 32 bits only: the kernel ignores the upper half of the register, so a rule on
all 64 bits could be passed by setting bits the kernel never looks at.
"""

from __future__ import annotations

import errno
import functools
import os
from dataclasses import dataclass

from tidal.sandbox.result import SandboxUnavailable


@dataclass(frozen=True)
class Denial:
    syscalls: tuple[str, ...]
    why: str


DENIED: tuple[Denial, ...] = (
    Denial(("ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp"),
           "read, write or steer another process (the sandbox's own init, a sibling run's helper, the runner that "
           "reports results): ptrace is how code would take over its init and outlive the run"),
    Denial(("keyctl", "add_key", "request_key"),
           "the kernel keyring: keys are not namespaced by bubblewrap, so a key the host or the sandbox uid holds "
           "would be readable and runs could pass data to later runs through it"),
    Denial(("bpf",), "eBPF programs and maps: a large kernel attack surface, and maps are a channel between processes"),
    Denial(("perf_event_open",), "performance counters: side channels on other processes, frequent kernel bugs"),
    Denial(("userfaultfd",), "user-handled page faults: the classic primitive for winning kernel races"),
    Denial(("io_uring_setup", "io_uring_enter", "io_uring_register"),
           "io_uring performs its operations outside the syscall path, so this filter could not see them; "
           "a frequent source of kernel exploits (Docker denies it too)"),
    Denial(("mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
            "open_tree", "mount_setattr"),
           "changing the mount tree (old and new mount API): the read-only system must stay read-only"),
    Denial(("unshare", "setns"),
           "new namespaces or joining others: a new user namespace would give the code capabilities over "
           "new mount and network namespaces (bubblewrap's --disable-userns also refuses it)"),
    Denial(("kexec_load", "kexec_file_load", "reboot", "init_module", "finit_module", "delete_module"),
           "replacing the kernel, rebooting, loading kernel modules"),
    Denial(("open_by_handle_at", "name_to_handle_at"),
           "opening files by handle bypasses the mount tree (the 'shocker' container escape)"),
    Denial(("acct", "quotactl", "quotactl_fd", "swapon", "swapoff", "syslog", "sysfs", "uselib", "ustat",
            "nfsservctl", "lookup_dcookie", "vhangup", "fanotify_init"),
           "system administration and obsolete calls no program needs (process accounting, quotas, swap, the "
           "kernel log, a.out libraries)"),
    Denial(("settimeofday", "clock_settime", "clock_adjtime"), "setting the host's clocks"),
    Denial(("iopl", "ioperm"), "direct access to I/O ports"),
    Denial(("get_mempolicy", "set_mempolicy", "mbind", "migrate_pages", "move_pages"),
           "NUMA placement, also of other processes' pages (Docker denies these without CAP_SYS_NICE)"),
)

# Argument-dependent denials (each also explained in docs/sandbox.md).
CLONE_NEW_FLAGS = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
                   "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
                   "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080}
TIOCSTI, TIOCLINUX = 0x5412, 0x541C  # push characters into a terminal's input; console control
# personality() flags that weaken memory protections (Docker allows only a few values; a
# filter rule compares an argument once, so the flags are denied instead, whatever else is
# set, except in the query 0xffffffff).
PERSONALITY_DENIED = {"READ_IMPLIES_EXEC": 0x0400000, "ADDR_NO_RANDOMIZE": 0x0040000, "MMAP_PAGE_ZERO": 0x0100000,
                      "ADDR_COMPAT_LAYOUT": 0x0200000, "ADDR_LIMIT_32BIT": 0x0800000, "ADDR_LIMIT_3GB": 0x8000000}
# Socket families a run may create: local sockets, IP on the sandbox's own loopback, and
# route netlink (the C library's getaddrinfo and getifaddrs read the interfaces through it;
# without capabilities it can change nothing). Every other family up to FAMILY_SCAN_END is
# refused with EAFNOSUPPORT, as if the kernel lacked it (Docker's profile refuses AF_VSOCK,
# Flatpak's all but these): vsock, packet, bluetooth, the crypto API (AF_ALG), CAN, TIPC, RDS,
# XDP… reach kernel code and host-wide state that no network namespace covers.
ALLOWED_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}
AF_NETLINK, NETLINK_ROUTE = 16, 0
# The kernel refuses families >= AF_MAX (46 in Linux 6.x) itself; the scan leaves room for
# families later kernels add.
FAMILY_SCAN_END = 64
# preadv2(RWF_NOWAIT) fails with EAGAIN exactly when the data is not in the page cache: a
# precise probe of what other runs read (the page-cache channel, docs/sandbox.md). Refused
# with EOPNOTSUPP, which callers already handle (files that cannot do non-blocking reads).
RWF_NOWAIT = 0x8
# posix_fadvise(POSIX_FADV_DONTNEED) evicts clean pages of any file the caller can open, the
# page-cache channel's way to write a 0; made a no-op that succeeds (it is only advice).
POSIX_FADV_DONTNEED = 4
ARGUMENT_RULES = (
    ("clone", "with any CLONE_NEW* flag: new namespaces, as unshare"),
    ("clone3", "fails with ENOSYS (its flags sit in memory the filter cannot read); the C library then uses clone"),
    ("ioctl", "TIOCSTI and TIOCLINUX: typing into a terminal the sandbox shares (bubblewrap's own advice)"),
    ("socket", (f"of a family other than {', '.join(ALLOWED_FAMILIES)} (EAFNOSUPPORT); netlink other than "
                "NETLINK_ROUTE (EPROTONOSUPPORT)")),
    ("socketpair", f"of a family other than {', '.join(ALLOWED_FAMILIES)} (EAFNOSUPPORT)"),
    ("preadv2", "with RWF_NOWAIT (EOPNOTSUPP): it tells whether data is in the page cache"),
    ("fadvise64", "POSIX_FADV_DONTNEED does nothing and succeeds: it would evict other runs' page cache"),
    ("personality", (f"with {', '.join(PERSONALITY_DENIED)} (READ_IMPLIES_EXEC makes every readable page "
                     "executable; the others undo address-space randomization or map page zero)")),
)


def _load_pyseccomp():
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: the package found no libseccomp
        raise SandboxUnavailable(
            f"the sandbox's syscall filter needs libseccomp and its Python bindings ({e}): install `pyseccomp` "
            "(a tidal dependency) and libseccomp2 (`apt-get install libseccomp2`), or set sandbox.seccomp=false "
            "to run sandboxes without a syscall filter (docs/sandbox.md says what that leaves open)") from e
    return pyseccomp


@functools.lru_cache(maxsize=1)
def filter_program() -> bytes:
    """The compiled filter (classic BPF, as bubblewrap's --seccomp reads it)."""
    sc = _load_pyseccomp()
    arch = sc.system_arch()
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    f.set_attr(sc.Attr.CTL_NNP, 0)  # bubblewrap sets no_new_privs itself before loading it
    try:
        f.set_attr(sc.Attr.CTL_OPTIMIZE, 2)  # a binary tree over syscall numbers (libseccomp >= 2.5)
    except OSError:
        pass
    deny = sc.ERRNO(errno.EPERM)

    def rule(action: int, name: str, *args) -> None:
        try:
            number = sc.resolve_syscall(arch, name)
        except OSError:
            return  # not a syscall of this architecture (e.g. uselib on arm64)
        if number < 0:
            return
        f.add_rule(action, number, *args)

    for denial in DENIED:
        for name in denial.syscalls:
            rule(deny, name)
    for flag in CLONE_NEW_FLAGS.values():
        rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for request in (TIOCSTI, TIOCLINUX):
        rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    low32 = 0xFFFFFFFF
    for family in range(FAMILY_SCAN_END):
        if family not in ALLOWED_FAMILIES.values():
            for call in ("socket", "socketpair"):
                rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.MASKED_EQ, low32, family))
    # Any protocol but NETLINK_ROUTE; "not 0" on all 64 bits refuses more, never less.
    rule(sc.ERRNO(errno.EPROTONOSUPPORT), "socket", sc.Arg(0, sc.MASKED_EQ, low32, AF_NETLINK),
         sc.Arg(2, sc.NE, NETLINK_ROUTE))
    rule(sc.ERRNO(errno.EOPNOTSUPP), "preadv2", sc.Arg(5, sc.MASKED_EQ, RWF_NOWAIT, RWF_NOWAIT))
    for call in ("fadvise64", "fadvise64_64"):  # the name differs between architectures
        rule(sc.ERRNO(0), call, sc.Arg(3, sc.MASKED_EQ, low32, POSIX_FADV_DONTNEED))
    # A flag set, and some other bit of the 32-bit argument clear (so: not the query).
    for flag in PERSONALITY_DENIED.values():
        for bit in range(32):
            if not flag & (1 << bit):
                rule(deny, "personality", sc.Arg(0, sc.MASKED_EQ, flag | (1 << bit), flag))
    fd = os.memfd_create("tidal-seccomp", os.MFD_CLOEXEC)
    try:
        with open(fd, "wb", closefd=False) as out:
            f.export_bpf(out)
        size = os.lseek(fd, 0, os.SEEK_END)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def denied_syscalls() -> list[str]:
    """Every syscall name denied outright (for the docs and the tests)."""
    return [name for denial in DENIED for name in denial.syscalls]


KEYCTL_JOIN_SESSION_KEYRING = 1


@functools.lru_cache(maxsize=1)
def _keyctl():
    import ctypes

    sc = _load_pyseccomp()
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall, sc.resolve_syscall(sc.system_arch(), "keyctl"), ctypes


def join_fresh_session_keyring() -> None:
    """Give the calling thread a new, empty, anonymous session keyring, which the process
    it starts next inherits: a sandbox never shares the host's session keyring, nor one
    with another run. (Creds are per thread: the rest of this process keeps its own.)"""
    syscall, number, ctypes = _keyctl()
    if syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"keyctl(KEYCTL_JOIN_SESSION_KEYRING) failed: {os.strerror(err)}")
