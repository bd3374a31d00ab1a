"""Attacks on the sandbox: each one contained and reported with the right status.

Network, fork bomb, memory exhaustion, infinite loops, a busy child that outlives its
parent, writes and reads outside the workspace, output floods, signals to host
processes, filling the disk, and escapes through nested namespaces. Network traffic is
aimed only at a listener this test opens on the host's 127.0.0.1. After the module the
host must be unchanged: no sandbox process alive, no file the attacks wrote.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
from sandbox_support import require_bwrap, sandbox_processes, wait_for_no_sandbox_processes

from tidal.sandbox import SandboxConfig, SandboxStatus
from tidal.sandbox import run_command_sync as run_command
from tidal.sandbox import run_python_sync as run_python
from tidal.sandbox.launch import resolve_python

OK, TIMEOUT, MEMORY, OUTPUT_LIMIT = SandboxStatus.OK, SandboxStatus.TIMEOUT, SandboxStatus.MEMORY, SandboxStatus.OUTPUT_LIMIT
REPO = Path(__file__).resolve().parents[1]
MARKER = f"tidal-attack-{uuid.uuid4().hex[:12]}"
# Paths an attack tries to create; none may exist on the host afterwards.
HOST_PATHS = [Path("/tmp") / MARKER, REPO / MARKER, Path("/root") / MARKER, Path("/etc") / MARKER,
              Path("/usr") / MARKER, Path("/") / MARKER, Path("/dev/shm") / MARKER]


@pytest.fixture(scope="module", autouse=True)
def host_is_unchanged():
    require_bwrap()
    assert sandbox_processes() == [], "sandbox processes alive before the attacks"
    yield
    assert wait_for_no_sandbox_processes() == [], "sandbox processes outlived the attacks"
    assert [p for p in HOST_PATHS if p.exists()] == []
    assert [p for p in Path("/tmp").iterdir() if p.name.startswith("tidal-sandbox-unsafe")] == []


def test_network_has_only_its_own_loopback():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = f"""
import socket
print(socket.if_nameindex())
for family, address in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET6, ("::1", {port}))):
    s = socket.socket(family)
    s.settimeout(2)
    try:
        s.connect(address)
        print("CONNECTED", address)
    except OSError as e:
        print(type(e).__name__)
try:
    socket.getaddrinfo("localhost.invalid", 80)
except OSError as e:
    print("resolve:", type(e).__name__)
"""
    try:
        r = run_python(code)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host's listener
    finally:
        listener.close()
    lines = r.stdout.splitlines()
    assert r.status is OK and lines[0] == "[(1, 'lo')]"  # no interface but its own loopback
    assert lines[1:3] == ["ConnectionRefusedError", "ConnectionRefusedError"]
    assert "CONNECTED" not in r.stdout and lines[3].startswith("resolve:")


def test_fork_bomb_is_held_to_the_process_limit():
    code = """
import os, time
if os.fork() == 0:
    while True:  # every child forks on, for ever
        try:
            os.fork()
        except OSError:
            time.sleep(0.01)
time.sleep(1.0)
print(len([p for p in os.listdir("/proc") if p.isdigit()]), flush=True)
while True:
    time.sleep(1)
"""
    r = run_python(code, limits={"max_processes": 32, "wall_s": 2.5})
    assert r.status is TIMEOUT
    assert 16 <= int(r.stdout) <= 32  # the bomb filled the sandbox's budget and no more
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still start processes
    assert wait_for_no_sandbox_processes() == []


def test_memory_exhaustion():
    grow = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))"
    r = run_python(grow, limits={"memory_bytes": 512 << 20})
    assert (r.status, r.exit_code) == (MEMORY, 1) and "MemoryError" in r.stderr
    r = run_command(["python3", "-c", "x = ' ' * (1 << 40)"], limits={"memory_bytes": 512 << 20})
    assert r.status is MEMORY


def test_infinite_loops():
    r = run_python("while True: pass", limits={"cpu_s": 1, "wall_s": 20})
    assert r.status is TIMEOUT and r.signal == signal.SIGXCPU
    r = run_python("import time\nwhile True: time.sleep(0.1)", limits={"wall_s": 1})
    assert r.status is TIMEOUT and r.signal == signal.SIGKILL


def test_busy_child_that_outlives_its_parent_dies_with_the_sandbox():
    code = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # a grandchild, orphaned, busy for ever
        while True:
            pass
    os._exit(0)
time.sleep(0.3)
print(len([p for p in os.listdir("/proc") if p.isdigit()]), "processes; parent leaves")
"""
    r = run_python(code)
    count, rest = r.stdout.split(" ", 1)
    assert (r.status, r.exit_code, rest) == (OK, 0, "processes; parent leaves\n")
    assert int(count) >= 3  # init, parent, the busy grandchild (and the unreaped middle child)
    assert wait_for_no_sandbox_processes() == []


def test_writes_outside_the_workspace_fail():
    targets = [f"/tmp/{MARKER}", f"{REPO}/{MARKER}", f"/root/{MARKER}", f"/etc/{MARKER}", f"/usr/{MARKER}",
               f"/{MARKER}", f"/dev/shm/{MARKER}", "/proc/sys/kernel/hostname", "/usr/bin/python3"]
    code = f"""
for path in {targets!r}:
    try:
        with open(path, "a") as f:
            f.write("x")
        print("WROTE", path)
    except OSError as e:
        print(type(e).__name__, path)
"""
    r = run_python(code)
    assert r.status is OK
    wrote = [line for line in r.stdout.splitlines() if line.startswith("WROTE")]
    assert wrote == [f"WROTE /tmp/{MARKER}"]  # its private /tmp only, which the host never sees
    assert not (Path("/tmp") / MARKER).exists()


def test_reads_outside_the_workspace_fail(monkeypatch):
    monkeypatch.setenv("TIDAL_ATTACK_SECRET", MARKER)  # in the host environment only
    home = os.path.expanduser("~")
    code = f"""
import os
for path in ["{REPO}/pyproject.toml", "{home}/.bashrc", "/root/.bashrc", "/etc/shadow", "/etc/passwd",
             "/proc/1/root/etc/hostname"]:
    try:
        open(path).read()
        print("READ", path)
    except OSError as e:
        print(type(e).__name__, path)
print("entries", sorted(os.listdir("/")))
environ = b""
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        environ += open(f"/proc/{{p}}/environ", "rb").read()
    except FileNotFoundError:  # /proc/1, the runner's supervisor, is masked
        pass
print("secret seen:", {MARKER!r}.encode() in environ or {MARKER!r} in str(os.environ))
"""
    r = run_python(code)
    assert r.status is OK
    assert [line for line in r.stdout.splitlines() if line.startswith("READ")] == []
    assert "secret seen: False" in r.stdout
    visible = r.stdout.split("entries ")[1].splitlines()[0]
    assert "'work'" not in visible and "'home'" not in visible  # neither the repo nor homes exist inside
    if not any(p.startswith("/root") for p in resolve_python(SandboxConfig()).prefixes):
        assert "'root'" not in visible  # (an interpreter installed under /root brings its own path)


def test_huge_output_is_cut_at_the_cap():
    r = run_python("import sys\nwhile True: sys.stdout.write('x' * 65536)", limits={"output_bytes": 1 << 20})
    assert r.status is OUTPUT_LIMIT and len(r.stdout) == 1 << 20
    r = run_command(["bash", "-c", "yes error >&2"], limits={"output_bytes": 1 << 20})
    assert r.status is OUTPUT_LIMIT and len(r.stderr) == 1 << 20


def test_processes_outside_cannot_be_signalled():
    victim = subprocess.Popen(["sleep", "60"])
    try:
        code = f"""
import os, signal
for pid in ({victim.pid}, {os.getpid()}, {os.getppid()}):
    try:
        os.kill(pid, signal.SIGKILL)
        print("KILLED", pid)
    except OSError as e:
        print(type(e).__name__, pid)
try:
    os.kill(-1, signal.SIGKILL)  # everything it may signal: only its own sandbox
except OSError as e:
    print(type(e).__name__)
print("still running")
"""
        r = run_python(code)
        assert victim.poll() is None, "a host process was killed from inside the sandbox"
    finally:
        victim.kill()
        victim.wait()
    assert r.status is OK and "KILLED" not in r.stdout and r.stdout.endswith("still running\n")


def test_filling_the_disk_stops_at_the_workspace_size():
    free_before = shutil.disk_usage("/").free
    code = """
import os
written = 0
try:
    with open("fill", "wb") as f:
        while True:
            f.write(b"0" * (1 << 20))
            f.flush()
            written += 1 << 20
finally:
    print(written >> 20, flush=True)
"""
    r = run_python(code, limits={"workspace_bytes": 16 << 20, "file_bytes": 64 << 20})
    assert r.status is OUTPUT_LIMIT and "No space left on device" in r.stderr
    assert int(r.stdout) <= 16
    r = run_command(["bash", "-c", "for i in $(seq 100); do head -c 1048576 /dev/zero > /tmp/f$i || exit 1; done"],
                    limits={"tmp_bytes": 8 << 20})
    assert r.status is OUTPUT_LIMIT and "No space left on device" in r.stderr
    assert shutil.disk_usage("/").free > free_before - (64 << 20)  # the host disk took none of it


def test_no_nested_namespaces_or_mounts():
    r = run_command(["bash", "-c", ("unshare -U true; echo unshare=$?; unshare -rn true; echo unshare_r=$?; "
                                    "mount -t tmpfs none /workspace; echo mount=$?")])
    assert r.status is OK
    assert "unshare=0" not in r.stdout and "unshare_r=0" not in r.stdout and "mount=0" not in r.stdout


def test_unsafe_mode_leaves_nothing_behind():
    r = run_python("open('left.txt', 'w').write('x'); print(__import__('os').getcwd())",
                   config=SandboxConfig(isolation="unsafe_host", warm=0))
    assert r.ok and not Path(r.stdout.strip()).exists()  # its host workspace is removed


@pytest.mark.slow
def test_attacks_and_honest_runs_mixed_under_load():
    """Many episodes at once: attacks running next to honest runs and sessions change
    nothing about the honest results, and leave nothing behind."""
    import asyncio

    from tidal.sandbox import SandboxPool

    attacks = {
        "fork bomb": ("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", {"wall_s": 2}, TIMEOUT),
        "memory": ("x = []\nwhile True: x.append(bytearray(32 << 20))", {"memory_bytes": 256 << 20}, MEMORY),
        "flood": ("while True: print('x' * 4096)", {"output_bytes": 1 << 16}, OUTPUT_LIMIT),
        "spin": ("while True: pass", {"cpu_s": 1}, TIMEOUT),
    }

    async def go():
        async with SandboxPool(SandboxConfig(max_concurrency=4, warm=8)) as pool:
            async def honest(i: int):
                return await pool.run_python("import sys; print(int(sys.stdin.read()) * 2)", stdin=str(i))

            async def session(i: int):
                async with await pool.python_session() as s:
                    outs = [await s.run(f"v = {i}"), await s.run("v += 1"), await s.run("v")]
                return outs[-1]

            jobs = [honest(i) for i in range(120)] + [session(i) for i in range(20)]
            jobs += [pool.run_python(code, limits=limits) for code, limits, _ in attacks.values() for _ in range(3)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(go())
    honest, sessions, attacked = results[:120], results[120:140], results[140:]
    assert [r.stdout for r in honest] == [f"{2 * i}\n" for i in range(120)]
    assert [r.stdout for r in sessions] == [f"{i + 1}\n" for i in range(20)]
    expected = [status for _, _, status in attacks.values() for _ in range(3)]
    assert [r.status for r in attacked] == expected
    assert wait_for_no_sandbox_processes() == []
