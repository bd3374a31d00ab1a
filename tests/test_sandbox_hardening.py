"""Attacks on the sandbox's hardening, each with its positive control.

One class per defence: the syscall filter, the kernel keyring, ptrace of the sandbox's
init and processes that outlive their run, memory the address-space limit does not see
(memfds, tmpfs pages, kernel memory for files), floods of the channels to the host,
forged results, and secrets of the host (files, sockets). Each attack runs under the
default isolation, where it must be contained, and the same code runs under
`isolation="unsafe_host"`, where it must succeed: that is the proof that the attack is real
and that the test can fail. Controls only ever touch what the test itself made (its own
processes, keys, files and sockets).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import platform
import socket
import time
import uuid
from pathlib import Path

import pytest
from sandbox_support import own_pool_cgroups, own_sandbox_processes, require_bwrap, settled_rss_bytes

from tidal.sandbox import SandboxConfig, SandboxPool, SandboxStatus
from tidal.sandbox import run_command_sync as run_command
from tidal.sandbox import run_python_sync as run_python
from tidal.sandbox.seccomp import CLONE_NEW_FLAGS, TIOCLINUX, TIOCSTI, denied_syscalls

pyseccomp = pytest.importorskip("pyseccomp")

OK, MEMORY, TIMEOUT, KILLED = SandboxStatus.OK, SandboxStatus.MEMORY, SandboxStatus.TIMEOUT, SandboxStatus.KILLED
SANDBOX = SandboxConfig(warm=0)
# The init that reports each run's end: the native supervisor (_supervisor.c, the default), or
# the runner's forked parent (where no C compiler is): both must hold against the same attacks.
SUPERVISORS = pytest.mark.parametrize("native", [True, False], ids=["native_init", "forked_init"])
UNSAFE = SandboxConfig(isolation="unsafe_host", warm=0)
MARKER = f"tidal-hardening-{uuid.uuid4().hex[:12]}"
NO_PID = 0x3FFFFF00  # above any pid_max: calls on it fail with ESRCH where they are allowed
MiB = 1 << 20


def _nr(name: str) -> int:
    return pyseccomp.resolve_syscall(pyseccomp.system_arch(), name)


@pytest.fixture(scope="module", autouse=True)
def host_is_clean():
    require_bwrap()
    yield
    assert own_sandbox_processes() == [], "sandbox processes outlived the attacks"
    assert own_pool_cgroups() == [], "sandbox cgroups left behind"


# -- 1. the syscall filter ---------------------------------------------------------------

# Each denied call with arguments that make it harmless where it is allowed (a missing pid,
# a bad descriptor, a NULL pointer, a path that does not exist, an invalid flag): under
# unsafe_host, as root, it reaches the kernel and fails (or does nothing) for that reason.
# vhangup is left out: where allowed it would hang up the test's terminal.
STR = "s:"  # an argument passed as a C string
HARMLESS_ARGS: dict[str, tuple] = {
    "ptrace": (3, NO_PID, 0, 0), "process_vm_readv": (NO_PID, 0, 0, 0, 0, 0), "process_vm_writev": (NO_PID, 0, 0, 0, 0, 0),
    "process_madvise": (-1, 0, 0, 0, 0), "pidfd_getfd": (-1, 0, 0), "kcmp": (NO_PID, NO_PID, 0, 0, 0),
    "keyctl": (0, -3, 0), "add_key": (0, 0, 0, 0, 0), "request_key": (0, 0, 0, 0), "bpf": (1000, 0, 0),
    "perf_event_open": (0, 0, -1, -1, 0), "userfaultfd": (0xFFFF,), "io_uring_setup": (0, 0),
    "io_uring_enter": (-1, 0, 0, 0, 0, 0), "io_uring_register": (-1, 0, 0, 0), "mount": (0, 0, 0, 0, 0),
    "umount2": (STR + "/nonexistent-" + MARKER, 0), "pivot_root": (0, 0), "chroot": (STR + "/nonexistent-" + MARKER,),
    "fsopen": (0, 0), "fsconfig": (-1, 0, 0, 0, 0), "fsmount": (-1, 0, 0), "fspick": (-1, 0, 0),
    "move_mount": (-1, 0, -1, 0, 0), "open_tree": (-1, 0, 0), "mount_setattr": (-1, 0, 0, 0, 0), "unshare": (0,),
    "setns": (-1, 0), "kexec_load": (0, 0, 0, 0xFFFFFFFF), "kexec_file_load": (-1, -1, 0, 0, 0xFFFFFFFF),
    "reboot": (0, 0, 0, 0), "init_module": (0, 0, 0), "finit_module": (-1, 0, 0),
    "delete_module": (STR + "tidal_no_such_module", 0x800), "open_by_handle_at": (-1, 0, 0),
    "name_to_handle_at": (-1, 0, 0, 0, 0), "acct": (STR + "/nonexistent-" + MARKER,), "quotactl": (0, 0, 0, 0),
    "quotactl_fd": (-1, 0, 0, 0), "swapon": (STR + "/nonexistent-" + MARKER, 0),
    "swapoff": (STR + "/nonexistent-" + MARKER,), "syslog": (10, 0, 0), "sysfs": (99, 0, 0), "uselib": (0,),
    "ustat": (0, 0), "nfsservctl": (0, 0, 0), "lookup_dcookie": (0, 0, 0), "fanotify_init": (0x7FFFFFFF, 0),
    "settimeofday": (0, 0), "clock_settime": (0, 0), "clock_adjtime": (-99, 0), "iopl": (99,), "ioperm": (0, 0, 0),
    "get_mempolicy": (0, 0, 0, 0, 0), "set_mempolicy": (0, 0, 0), "mbind": (0, 0, 0, 0, 0, 0),
    "migrate_pages": (NO_PID, 0, 0, 0), "move_pages": (NO_PID, 0, 0, 0, 0, 0),
}
CLONE_THREAD = 0x10000  # without CLONE_SIGHAND: clone fails with EINVAL where it is allowed
ARGUMENT_CASES: dict[str, tuple[str, tuple]] = {
    **{f"clone {flag}": ("clone", (value | CLONE_THREAD, 0, 0, 0, 0)) for flag, value in CLONE_NEW_FLAGS.items()},
    "clone3": ("clone3", (0, 0)),
    "ioctl TIOCSTI": ("ioctl", (0, TIOCSTI, 0)),
    "ioctl TIOCLINUX": ("ioctl", (0, TIOCLINUX, 0)),
    "personality READ_IMPLIES_EXEC": ("personality", (0x0400000,)),
    "personality ADDR_NO_RANDOMIZE": ("personality", (0x0040000,)),
}
# Calls ordinary programs make, which the filter must leave alone.
ALLOWED_CASES: dict[str, tuple[str, tuple]] = {
    "personality query": ("personality", (0xFFFFFFFF,)), "personality PER_LINUX": ("personality", (0,)),
    "ioctl FIONREAD": ("ioctl", (0, 0x541B, 0)), "getpid": ("getpid", ()),
}
SYSCALL_PROBE = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
out = {}
for label, (nr, args) in CASES.items():
    argv = [ctypes.c_char_p(a[2:].encode()) if isinstance(a, str) else ctypes.c_long(a) for a in args]
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr), *argv)
    out[label] = ctypes.get_errno() if rc == -1 else 0
print(json.dumps(out))
"""


def _syscall_cases() -> dict[str, tuple[int, tuple]]:
    assert set(HARMLESS_ARGS) == set(denied_syscalls()) - {"vhangup"}, "every denied syscall has a test case"
    cases = {name: (_nr(name), args) for name, args in HARMLESS_ARGS.items() if _nr(name) >= 0}
    cases.update({label: (_nr(name), args) for label, (name, args) in {**ARGUMENT_CASES, **ALLOWED_CASES}.items()})
    return cases


def _probe_syscalls(config: SandboxConfig) -> dict[str, int]:
    cases = _syscall_cases()
    r = run_python(f"CASES = {cases!r}\n" + SYSCALL_PROBE, config=config)
    assert (r.status, r.exit_code) == (OK, 0), r.stderr
    return json.loads(r.stdout)


def test_syscall_filter_denies_its_list_and_leaves_ordinary_calls():
    got = _probe_syscalls(SANDBOX)
    denied = {label: code for label, code in got.items() if label not in ALLOWED_CASES}
    expected = {label: errno.ENOSYS if label == "clone3" else errno.EPERM for label in denied}
    assert denied == expected
    assert got["personality query"] == 0 and got["personality PER_LINUX"] == 0 and got["getpid"] == 0
    assert got["ioctl FIONREAD"] != errno.EPERM  # an ordinary ioctl reaches the kernel (ENOTTY on a memfd)


def test_syscall_filter_control_the_calls_reach_the_kernel_without_it():
    got = _probe_syscalls(UNSAFE)
    # These fail for their harmless arguments (or succeed doing nothing) where nothing filters them.
    reached = ["ptrace", "process_vm_readv", "kcmp", "keyctl", "bpf", "mount", "unshare", "setns", "reboot",
               "open_by_handle_at", "clone CLONE_NEWUSER", "clone CLONE_NEWNS", "clone3", "ioctl TIOCSTI",
               "personality READ_IMPLIES_EXEC"]
    assert {label: got[label] for label in reached if got[label] == errno.EPERM} == {}
    assert got["clone3"] != errno.ENOSYS


SYSCALL_32BIT = """
import ctypes, mmap
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20 (i386 getpid); int 0x80; ret
getpid_i386 = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
print(getpid_i386() > 0)
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the i386 syscall ABI exists on x86-64 only")
def test_syscalls_of_another_abi_kill_the_process():
    r = run_python(SYSCALL_32BIT)
    assert (r.status, r.signal) == (KILLED, 31)  # SIGSYS: the filter knows only the native numbers
    control = run_python(SYSCALL_32BIT, config=UNSAFE)
    assert (control.status, control.stdout) == (OK, "True\n")  # int 0x80 works where nothing filters it


# -- 2. the kernel keyring ---------------------------------------------------------------

KEYCTL, ADD_KEY = _nr("keyctl"), _nr("add_key")
KEY_SPEC_SESSION, KEY_SPEC_USER = -3, -4
KEYCTL_SEARCH, KEYCTL_READ, KEYCTL_INVALIDATE = 10, 11, 21
KEYRING_PROBE = f"""
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
def search(description):
    for keyring in ({KEY_SPEC_SESSION}, {KEY_SPEC_USER}):
        key = libc.syscall(L({KEYCTL}), L({KEYCTL_SEARCH}), L(keyring), b"user", description.encode(), L(0))
        if key > 0:
            buf = ctypes.create_string_buffer(256)
            n = libc.syscall(L({KEYCTL}), L({KEYCTL_READ}), L(key), buf, L(256))
            return buf.raw[:n].decode() if n > 0 else "unreadable"
    return None
def plant(description, payload):
    return [libc.syscall(L({ADD_KEY}), b"user", description.encode(), payload.encode(), L(len(payload)), L(k)) > 0
            for k in ({KEY_SPEC_SESSION}, {KEY_SPEC_USER})]
try:
    listed = open("/proc/keys").read()
except OSError:
    listed = ""
"""


def _host_add_key(description: str, payload: bytes) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(ctypes.c_long(ADD_KEY), b"user", description.encode(), payload, ctypes.c_long(len(payload)),
                       ctypes.c_long(KEY_SPEC_SESSION))
    if key < 0:
        pytest.skip(f"this host does not let the test add a key ({os.strerror(ctypes.get_errno())})")
    return key


def _host_invalidate_keys(description: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for keyring in (KEY_SPEC_SESSION, KEY_SPEC_USER):
        invalidated = set()
        for _ in range(8):  # an invalidated key may still be found until the kernel collects it
            key = libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(KEYCTL_SEARCH), ctypes.c_long(keyring),
                               b"user", description.encode(), ctypes.c_long(0))
            if key <= 0 or key in invalidated:
                break
            libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(KEYCTL_INVALIDATE), ctypes.c_long(key))
            invalidated.add(key)


@pytest.mark.parametrize("config, contained", [(SANDBOX, True), (UNSAFE, False)], ids=["sandbox", "control"])
def test_a_key_the_host_holds_is_not_readable(config, contained):
    description = f"{MARKER}-host-{contained}"
    _host_add_key(description, b"host secret")
    try:
        r = run_python(KEYRING_PROBE + f"print(json.dumps([search({description!r}), {description!r} in listed]))",
                       config=config)
    finally:
        _host_invalidate_keys(description)
    assert r.status is OK, r.stderr
    found, listed = json.loads(r.stdout)
    if contained:
        assert (found, listed) == (None, False)
    else:
        assert found == "host secret"


@pytest.mark.parametrize("config, contained", [(SANDBOX, True), (UNSAFE, False)], ids=["sandbox", "control"])
def test_runs_cannot_pass_data_through_the_keyring(config, contained):
    description = f"{MARKER}-runs-{contained}"
    try:
        first = run_python(KEYRING_PROBE + f"print(json.dumps(plant({description!r}, 'from run 1')))", config=config)
        second = run_python(KEYRING_PROBE + f"print(json.dumps(search({description!r})))", config=config)
    finally:
        _host_invalidate_keys(description)
    assert first.status is OK and second.status is OK, first.stderr + second.stderr
    if contained:
        assert json.loads(first.stdout) == [False, False] and json.loads(second.stdout) is None
    else:
        assert json.loads(second.stdout) == "from run 1"


# -- 3. ptrace, and processes that outlive their run ----------------------------------------

PTRACE_PARENT = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_SEIZE = 0x4206  # attach without stopping: the tracee runs on, and is let go when we exit
rc = libc.syscall(ctypes.c_long({_nr("ptrace")}), ctypes.c_long(PTRACE_SEIZE), ctypes.c_long(os.getppid()), None, None)
print(os.getppid(), "seized" if rc == 0 else os.strerror(ctypes.get_errno()))
"""


@SUPERVISORS
def test_the_code_cannot_ptrace_the_sandbox_init(native):
    r = run_python(PTRACE_PARENT, config=SandboxConfig(warm=0, native_supervisor=native))
    assert (r.status, r.stdout) == (OK, "1 Operation not permitted\n")  # the parent is the sandbox's init
    control = run_python(PTRACE_PARENT, config=UNSAFE)  # the parent: the runner, a process of this test
    assert control.status is OK and control.stdout.endswith(" seized\n")


@SUPERVISORS
def test_without_the_filter_the_init_still_cannot_be_ptraced(native):
    r = run_python(PTRACE_PARENT, config=SandboxConfig(warm=0, seccomp=False, native_supervisor=native))
    assert (r.status, r.stdout) == (OK, "1 Operation not permitted\n")  # it made itself non-dumpable


DETACH = """
import os, sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()  # a session of its own: no process-group kill reaches it
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        for fd in (0, 1, 2):
            os.close(fd)
        time.sleep(60)
    os._exit(0)
print(os.read(r, 32).decode(), flush=True)
"""


def test_processes_that_detach_end_with_the_run():
    async def go():
        async with SandboxPool(SandboxConfig(warm=1)) as pool:
            results = await asyncio.gather(*(pool.run_python(DETACH) for _ in range(3)))
        return results, own_sandbox_processes()  # at once: close() returns when nothing is left

    results, left = asyncio.run(go())
    assert [r.status for r in results] == [OK] * 3
    assert left == []
    assert own_pool_cgroups() == []


def test_the_init_can_also_be_moved_into_the_cgroup_while_bubblewrap_holds_it(monkeypatch):
    """The admission that cgroup v2 uses (--block-fd, then the init moved in), on this
    machine's cgroups: the run is bounded and torn down just the same."""
    from tidal.sandbox import cgroup

    monkeypatch.setattr(cgroup, "THREAD_ENTRY", False)
    r = run_python(MEMFD, limits={"memory_bytes": 128 * MiB})
    assert r.status is MEMORY and "memory limit" in r.error
    assert run_python(DETACH).status is OK and own_sandbox_processes() == [] and own_pool_cgroups() == []


def test_processes_that_detach_control_survive_without_the_sandbox():
    r = run_python(DETACH, config=UNSAFE)
    pid = int(r.stdout)
    try:
        assert Path(f"/proc/{pid}").exists(), "the detached process should outlive an unsandboxed run"
    finally:
        os.kill(pid, 9)


# -- 4. memory outside the address-space limit ---------------------------------------------

MEMFD = """
import os
hoard = [os.memfd_create("hoard") for _ in range(12)]  # each one below file_bytes (RLIMIT_FSIZE)
for fd in hoard:
    for i in range(32):
        os.write(fd, b"m" * (1 << 20))  # pages of a memfd: no address space is used for them
print("held 384 MiB")
"""


def test_memory_in_a_memfd_is_bounded():
    r = run_python(MEMFD, limits={"memory_bytes": 128 * MiB})
    assert r.status is MEMORY and "memory limit" in r.error and "held" not in r.stdout
    control = run_python(MEMFD, config=UNSAFE, limits={"memory_bytes": 128 * MiB})
    assert (control.status, control.stdout) == (OK, "held 384 MiB\n")  # RLIMIT_AS alone does not see it


def test_tmpfs_pages_and_kernel_memory_for_files_are_bounded():
    big_file = "open('big', 'wb').write(b'f' * (200 << 20)); print('wrote')"
    r = run_python(big_file, limits={"memory_bytes": 96 * MiB, "workspace_bytes": 512 * MiB, "file_bytes": 512 * MiB})
    assert r.status is MEMORY and "wrote" not in r.stdout  # the workspace is memory, and counted
    tiny_files = ("import os\nfor i in range(400_000):\n    os.close(os.open(f'f{i:06}', os.O_CREAT | os.O_WRONLY))\n"
                  "print('made them all')")
    r = run_python(tiny_files, limits={"memory_bytes": 64 * MiB, "wall_s": 60, "cpu_s": 60})
    assert r.status is MEMORY and "made them all" not in r.stdout  # inodes and dentries: kernel memory


# -- 5. floods of the channels, forged results ----------------------------------------------

FORGE = """
import os
forged, flooded = 0, 0
parent = os.getppid()
try:
    fds = os.listdir(f"/proc/{parent}/fd")
except OSError:
    fds = []
own = {(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)}
for fd in fds:
    try:
        out = os.open(f"/proc/{parent}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        continue
    if (os.fstat(out).st_dev, os.fstat(out).st_ino) in own:  # its own stdout and stderr: no news
        os.close(out)
        continue
    try:
        os.write(out, b"D0 0 0.000\\n")  # "the code exited 0", in the runner's report format
        forged += 1
        for _ in range(64):  # 4 MiB at most (/dev/null would take it for ever)
            flooded += os.write(out, b"D" * 65536)
    except OSError:
        pass
    os.close(out)
print(forged, flooded >= 65536, flush=True)
raise SystemExit(3)
"""


@SUPERVISORS
def test_the_code_cannot_forge_its_result_nor_flood_the_status_channel(native):
    config = SandboxConfig(warm=0, native_supervisor=native)
    r = run_python(FORGE, config=config)
    assert (r.status, r.exit_code, r.stdout) == (OK, 3, "0 False\n")  # nothing of its supervisor can be opened
    command = run_command(["python3", "-I", "-c", FORGE], config=config)
    assert (command.status, command.exit_code, command.stdout) == (OK, 3, "0 False\n")
    control = run_python(FORGE, config=UNSAFE)
    # Where it can reach the runner's status pipe, it writes a report of its own and the host
    # believes it: "exit 0" from a program that exits 3 (before it even printed its line).
    assert (control.status, control.exit_code) == (OK, 0)


def test_a_flood_does_not_delay_other_runs():
    """Floods of stdout and of the status channel (the latter where it is reachable:
    unsafe_host) next to runs whose wall clock must fire on time and whose results must
    come back at once; host memory stays flat."""
    flood_stdout = "import sys\nwhile True: sys.stdout.write('x' * 65536)"

    async def go(config: SandboxConfig):
        async with SandboxPool(config.model_copy(update={"max_concurrency": 4})) as pool:
            async def timed(coro):
                t0 = time.monotonic()
                result = await coro
                return result, time.monotonic() - t0

            floods = [pool.run_python(flood_stdout, limits={"output_bytes": 256 * MiB, "wall_s": 1.5}),
                      pool.run_python(FORGE.replace("raise SystemExit(3)", "import time; time.sleep(1)"),
                                      limits={"wall_s": 1.5})]
            others = [timed(pool.run_python("import time; time.sleep(30)", limits={"wall_s": 0.5})),
                      timed(pool.run_python("print('quick')"))]
            return await asyncio.gather(*floods, *others)

    for config in (SANDBOX, UNSAFE):
        rss_before = settled_rss_bytes()
        results = asyncio.run(go(config))
        flood, _, (slow, slow_s), (quick, quick_s) = results
        assert slow.status is TIMEOUT and slow_s < 2.0, (config.isolation, slow_s)
        assert quick.stdout == "quick\n" and quick_s < 2.0, (config.isolation, quick_s)
        assert len(flood.stdout) <= 256 * MiB
        # The flood's output is its result's alone: once the caller drops the result, the host's
        # memory is back. Measured alone, with the heap trimmed: 256 MiB of growth while the
        # result is held, 0-1 MiB once it is dropped. A pool that kept the output would keep a
        # copy of at least its 256 MiB; 64 MiB leaves room for what the rest of the suite's
        # heap does meanwhile, and is a quarter of what a kept copy would cost.
        del results, flood
        assert settled_rss_bytes() - rss_before < 64 * MiB  # nothing of it kept by the pool


# -- 6. secrets of the host -------------------------------------------------------------------

SECRETS = """
import json, os, socket
seen = {}
try:
    seen["file"] = open(FILE).read()
except OSError as e:
    seen["file"] = type(e).__name__
for name, address in (("path socket", SOCKET_PATH), ("abstract socket", "\\0" + ABSTRACT)):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(address)
        seen[name] = s.recv(64).decode()
    except OSError as e:
        seen[name] = type(e).__name__
    finally:
        s.close()
seen["fds"] = sorted(os.listdir("/proc/self/fd"))
print(json.dumps(seen))
"""


@pytest.mark.parametrize("config, contained", [(SANDBOX, True), (UNSAFE, False)], ids=["sandbox", "control"])
def test_host_files_and_sockets_are_out_of_reach(tmp_path, config, contained):
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text("file secret")
    servers = []
    for address in (str(tmp_path / "s.sock"), "\0" + MARKER):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen()
        servers.append(server)

    async def serve(server):
        loop = asyncio.get_running_loop()
        server.setblocking(False)
        while True:
            conn, _ = await loop.sock_accept(server)
            conn.sendall(b"socket secret")
            conn.close()

    async def go():
        tasks = [asyncio.ensure_future(serve(s)) for s in servers]
        try:
            code = f"FILE = {str(secret_file)!r}\nSOCKET_PATH = {str(tmp_path / 's.sock')!r}\nABSTRACT = {MARKER!r}\n"
            async with SandboxPool(config) as pool:
                return await pool.run_python(code + SECRETS)
        finally:
            for t in tasks:
                t.cancel()

    try:
        r = asyncio.run(go())
    finally:
        for s in servers:
            s.close()
    assert r.status is OK, r.stderr
    seen = json.loads(r.stdout)
    if contained:
        assert seen == {"file": "FileNotFoundError", "path socket": "FileNotFoundError",
                        "abstract socket": "ConnectionRefusedError", "fds": ["0", "1", "2", "3"]}
    else:
        assert (seen["file"], seen["path socket"], seen["abstract socket"]) == (
            "file secret", "socket secret", "socket secret")
