"""The sandbox's contract: runs, limits and their statuses, the pool, sessions, unsafe mode.

Every test runs real bubblewrap (no mocks); attacks are in test_sandbox_attacks.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from pydantic import ValidationError
from sandbox_support import require_bwrap, wait_for_no_sandbox_processes

from tidal.sandbox import (
    SandboxConfig,
    SandboxLimits,
    SandboxPool,
    SandboxSessionClosed,
    SandboxStatus,
    SandboxUnavailable,
    run_python_sync,
)
from tidal.sandbox import run_command_sync as run_command
from tidal.sandbox import run_python_sync as run_python

OK, TIMEOUT, MEMORY, OUTPUT_LIMIT, KILLED = (SandboxStatus.OK, SandboxStatus.TIMEOUT, SandboxStatus.MEMORY,
                                             SandboxStatus.OUTPUT_LIMIT, SandboxStatus.KILLED)


@pytest.fixture
def bwrap():
    require_bwrap()


def test_python_gets_stdin_argv_and_workspace_files(bwrap):
    code = ("import sys, os\n"
            "print(sys.argv[1:], input(), open('data/in.txt').read(), os.getcwd())\n"
            "from helper import VALUE; print(VALUE)")
    r = run_python(code, stdin="typed\n", argv=["a", "b"], files={"data/in.txt": "hello", "helper.py": b"VALUE = 7"})
    assert (r.status, r.exit_code, r.stderr) == (OK, 0, "")
    assert r.stdout == "['a', 'b'] typed hello /workspace\n7\n"
    assert r.ok


def test_exception_and_exit_codes_are_the_programs_own(bwrap):
    r = run_python("def f():\n    return 1 / 0\nf()")
    assert (r.status, r.exit_code) == (OK, 1)
    assert 'File "/workspace/main.py", line 2, in f' in r.stderr and "ZeroDivisionError" in r.stderr
    assert "<tidal-sandbox-runner>" not in r.stderr  # the runner's own frames are not shown
    assert run_python("import sys; sys.exit(3)").exit_code == 3
    r = run_python("import sys; sys.exit('bad input')")
    assert (r.exit_code, r.stderr) == (1, "bad input\n")
    r = run_python("x = (")
    assert r.exit_code == 1 and "SyntaxError" in r.stderr


def test_interpreter_exit_semantics_threads_and_atexit(bwrap):
    code = ("import atexit, threading, time\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
            "print('main done')")
    r = run_python(code)
    assert r.stdout == "main done\nthread done\natexit ran\n"


def test_command_exit_code_and_missing_command(bwrap):
    r = run_command(["bash", "-c", "cat input.txt | tr a-z A-Z; exit 4"], files={"input.txt": "shout"})
    assert (r.status, r.exit_code, r.stdout) == (OK, 4, "SHOUT")
    r = run_command(["no-such-command-xyz"])
    assert (r.status, r.exit_code) == (OK, 127) and "cannot execute" in r.stderr


def test_cpu_limit_is_a_timeout(bwrap):
    r = run_python("while True: pass", limits={"cpu_s": 1, "wall_s": 10})
    assert r.status is TIMEOUT and r.signal == 24  # SIGXCPU, long before the wall clock
    assert r.wall_s < 5
    r = run_command(["bash", "-c", "trap '' XCPU; while :; do :; done"], limits={"cpu_s": 1, "wall_s": 10})
    assert r.status is TIMEOUT and r.signal == 9  # the hard limit, one second later


def test_wall_clock_is_a_timeout(bwrap):
    t0 = time.monotonic()
    r = run_python("import time; time.sleep(60)", limits={"wall_s": 0.5})
    assert r.status is TIMEOUT and "wall_s=0.5" in r.error
    assert time.monotonic() - t0 < 5


def test_memory_limit(bwrap):
    r = run_python("x = bytearray(4 << 30)", limits={"memory_bytes": 256 << 20})
    assert (r.status, r.exit_code) == (MEMORY, 1) and r.stderr.rstrip().endswith("MemoryError")


def test_output_cap_keeps_the_first_bytes(bwrap):
    r = run_python("import sys\nwhile True: sys.stdout.write('y' * 4096)", limits={"output_bytes": 10_000})
    assert r.status is OUTPUT_LIMIT and r.stdout == "y" * 10_000
    r = run_python("print('a' * 5000, flush=True); import sys; sys.stderr.write('e' * 20000)", limits={"output_bytes": 10_000})
    assert r.status is OUTPUT_LIMIT and r.stdout == "a" * 5000 + "\n" and len(r.stderr) == 10_000


def test_file_size_and_open_file_limits(bwrap):
    r = run_python("open('big', 'wb').write(b'0' * (2 << 20))", limits={"file_bytes": 1 << 20})
    assert r.status is OUTPUT_LIMIT and "File too large" in r.stderr
    r = run_command(["bash", "-c", "head -c 2000000 /dev/zero > big"], limits={"file_bytes": 1 << 20})
    assert r.status is OUTPUT_LIMIT  # bash is not Python: SIGXFSZ ends it
    code = ("import os\nfds = []\ntry:\n    while True: fds.append(os.open('/dev/null', os.O_RDONLY))\n"
            "except OSError as e: print(len(fds), e.errno)")
    r = run_python(code, limits={"max_open_files": 32})
    opened, errno = map(int, r.stdout.split())
    assert r.status is OK and errno == 24 and 20 <= opened < 32  # EMFILE below the limit


def test_signal_ending_is_killed(bwrap):
    r = run_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert (r.status, r.signal, r.exit_code) == (KILLED, 11, None)


def test_runs_do_not_see_each_other(bwrap):
    async def go():
        async with SandboxPool(SandboxConfig(warm=2)) as pool:
            first = await pool.run_python("open('/workspace/left', 'w').write('x'); open('/tmp/left', 'w').write('x')")
            second = await pool.run_python("import os; print(os.listdir('/workspace'), os.listdir('/tmp'))")
            return first, second

    first, second = asyncio.run(go())
    assert first.ok and second.stdout == "['main.py'] []\n"


def test_pool_bounds_concurrency_and_serves_many_episodes(bwrap):
    async def go():
        async with SandboxPool(SandboxConfig(max_concurrency=2, warm=2)) as pool:
            t0 = time.monotonic()
            results = await asyncio.gather(*(pool.run_python(f"import time; time.sleep(0.3); print({i})")
                                             for i in range(6)))
            return results, time.monotonic() - t0

    results, elapsed = asyncio.run(go())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    assert elapsed >= 0.85  # 6 runs of 0.3 s, two at a time
    assert wait_for_no_sandbox_processes() == []


def test_python_session_keeps_state_until_closed(bwrap):
    async def go():
        async with SandboxPool(SandboxConfig(warm=1)) as pool:
            async with await pool.python_session(files={"lib.py": "BASE = 40"}) as session:
                a = await session.run("from lib import BASE\ncount = BASE + 1")
                b = await session.run("count += 1\ncount")
                c = await session.run("undefined_name")
                d = await session.run("print('still here', count)")
            with pytest.raises(SandboxSessionClosed):
                await session.run("count")
            return a, b, c, d

    a, b, c, d = asyncio.run(go())
    assert (a.status, a.exit_code, a.stdout) == (OK, 0, "")
    assert b.stdout == "42\n"  # a final bare expression is shown, as in a notebook
    assert c.exit_code == 1 and "NameError" in c.stderr
    assert d.stdout == "still here 42\n"


def test_session_turn_timeout_ends_the_session(bwrap):
    async def go():
        async with SandboxPool(SandboxConfig(warm=0)) as pool:
            session = await pool.python_session()
            slow = await session.run("import time; time.sleep(30)", wall_s=0.5)
            with pytest.raises(SandboxSessionClosed, match="timeout"):
                await session.run("1")
            flood = await (await pool.python_session(limits={"output_bytes": 2048})).run("print('z' * 10000)")
            return slow, flood

    slow, flood = asyncio.run(go())
    assert slow.status is TIMEOUT and flood.status is OUTPUT_LIMIT
    assert wait_for_no_sandbox_processes() == []


def test_shell_session_keeps_cwd_variables_and_functions(bwrap):
    async def go():
        async with SandboxPool(SandboxConfig(warm=0)) as pool:
            async with await pool.shell_session() as shell:
                outs = [await shell.run(cmd) for cmd in (
                    'mkdir -p a/b && cd a/b && export GREETING="it\'s \\"quoted\\""',
                    "greet() { echo \"$GREETING from $(pwd)\"; }\ngreet",
                    "echo to-stderr >&2; false",
                    "read -r line; echo \"read: [$line]\"",  # stdin is /dev/null, never the protocol
                )]
                exited = await shell.run("exit 5")
            return outs, exited

    outs, exited = asyncio.run(go())
    assert outs[0].ok and outs[1].stdout == "it's \"quoted\" from /workspace/a/b\n"
    assert (outs[2].exit_code, outs[2].stderr) == (1, "to-stderr\n")
    assert outs[3].stdout == "read: []\n"
    assert (exited.status, exited.exit_code) == (OK, 5)


def test_sync_api_and_its_misuse_inside_a_loop(bwrap):
    assert run_python_sync("print(6 * 7)").stdout == "42\n"

    async def inside_loop():
        return run_python_sync("pass")

    with pytest.raises(RuntimeError, match="inside an event loop"):
        asyncio.run(inside_loop())


def test_workspace_paths_must_stay_inside(bwrap):
    for bad in ("../escape", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(ValueError, match="inside the workspace"):
            run_python("pass", files={bad: "x"})
    with pytest.raises(ValueError, match="main.py"):
        run_python("pass", files={"main.py": "x"})


def test_limits_are_validated():
    with pytest.raises(ValidationError, match="wall_s"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValidationError, match="memroy_bytes"):
        SandboxLimits().updated({"memroy_bytes": 1})
    with pytest.raises(ValidationError, match="isolation"):
        SandboxConfig(isolation="none")


def test_without_bwrap_nothing_runs_unless_unsafe_is_named(caplog):
    with pytest.raises(SandboxUnavailable, match="isolation=unsafe_host"):
        run_python("print(1)", config=SandboxConfig(bwrap="/nonexistent/bwrap", warm=0))
    unsafe = SandboxConfig(isolation="unsafe_host", warm=0)

    async def twice():
        async with SandboxPool(unsafe) as pool:
            return [await pool.run_python("import os; print(os.getcwd() != '/workspace')") for _ in range(2)]

    with caplog.at_level(logging.WARNING, logger="tidal.sandbox"):
        results = asyncio.run(twice())
    assert [r.stdout for r in results] == ["True\n"] * 2
    warnings = [r for r in caplog.records if "unsafe_host" in r.getMessage()]
    assert len(warnings) == 2  # one per run
