"""Soak (slow): many runs on one pool, attacks mixed with honest code and sessions.

Afterwards no process of any sandbox is alive (checked the moment `close()` returns), no
cgroup of the pool is left, the host's memory is back within 50 MB of what it was after a
warm-up, and every honest run printed exactly its answer.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from sandbox_support import own_pool_cgroups, own_sandbox_processes, require_bwrap, settled_rss_bytes

from tidal.sandbox import SandboxConfig, SandboxPool, SandboxStatus

RUNS = int(os.environ.get("TIDAL_SANDBOX_SOAK_RUNS", "2000"))
MiB = 1 << 20
OK, TIMEOUT, MEMORY, OUTPUT_LIMIT, KILLED = (SandboxStatus.OK, SandboxStatus.TIMEOUT, SandboxStatus.MEMORY,
                                             SandboxStatus.OUTPUT_LIMIT, SandboxStatus.KILLED)

# name: (code, limits, the statuses it may end with). Cheap ones recur often; the ones that
# burn CPU until a limit (fork bomb, spinning) are rarer.
ATTACKS = {
    "memfd hoard": (("import os\nfds = [os.memfd_create('m') for _ in range(8)]\n"
                    "while True:\n    for fd in fds: os.write(fd, b'm' * (1 << 20))"),
                    {"memory_bytes": 96 * MiB}, {MEMORY, OUTPUT_LIMIT}),
    "heap": ("x = []\nwhile True: x.append(bytearray(16 << 20))", {"memory_bytes": 128 * MiB}, {MEMORY}),
    "stdout flood": ("import sys\nwhile True: sys.stdout.write('x' * 65536)", {"output_bytes": 1 << 16},
                     {OUTPUT_LIMIT}),
    "detach": (("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
               "    os._exit(0)\nprint('left')"), {}, {OK}),
    "forge": (("import os\nfor fd in range(64):\n    try:\n"
              "        os.write(os.open(f'/proc/1/fd/{fd}', os.O_WRONLY | os.O_NONBLOCK), b'D0 0 0.000\\n')\n"
              "    except OSError: pass\nraise SystemExit(3)"), {}, {OK}),
    "kill all": ("import os, signal\ntry: os.kill(-1, signal.SIGKILL)\nexcept OSError: pass\nprint('alive')", {}, {OK}),
    "sleep past the wall clock": ("import time; time.sleep(30)", {"wall_s": 0.3}, {TIMEOUT}),
    "crash": ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", {}, {KILLED}),
}
RARE_ATTACKS = {
    "fork bomb": ("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", {"wall_s": 1.0}, {TIMEOUT}),
    "spin": ("while True: pass", {"cpu_s": 1, "wall_s": 5}, {TIMEOUT}),
}


@pytest.mark.slow
def test_soak_attacks_and_honest_runs():
    require_bwrap()

    async def go():
        pool = SandboxPool(SandboxConfig(max_concurrency=4, warm=8))
        try:
            async def honest(i: int):
                r = await pool.run_python("import sys; print(int(sys.stdin.read()) * 2)", stdin=str(i))
                return ("honest", i, r)

            async def session(i: int):
                async with await pool.python_session() as s:
                    await s.run(f"v = {i}")
                    await s.run("v += 1")
                    r = await s.run("v")
                return ("session", i, r)

            async def attack(name: str, spec):
                code, limits, _ = spec
                return (name, None, await pool.run_python(code, limits=limits))

            def jobs(n: int):
                kinds = list(ATTACKS.items())
                for i in range(n):
                    if i % 200 == 199:
                        name = list(RARE_ATTACKS)[(i // 200) % len(RARE_ATTACKS)]
                        yield attack(name, RARE_ATTACKS[name])
                    elif i % 4 == 3:
                        yield attack(*kinds[(i // 4) % len(kinds)])
                    elif i % 25 == 24:
                        yield session(i)
                    else:
                        yield honest(i)

            async def in_batches(n: int, batch: int = 64):
                out = []
                pending = list(jobs(n))
                for start in range(0, len(pending), batch):
                    out += await asyncio.gather(*pending[start:start + batch])
                return out

            warmup = await in_batches(64)
            baseline = settled_rss_bytes()
            t0 = time.monotonic()
            results = await in_batches(RUNS)
            elapsed = time.monotonic() - t0
        finally:
            await pool.close()
        left = own_sandbox_processes()  # at once: close() returns only when no sandbox process is left
        return warmup, results, elapsed, baseline, settled_rss_bytes(), left

    warmup, results, elapsed, baseline, rss_after, left = asyncio.run(go())
    statuses = {name: spec[2] for name, spec in {**ATTACKS, **RARE_ATTACKS}.items()}
    expected_stdout = {"honest": lambda i: f"{2 * i}\n", "session": lambda i: f"{i + 1}\n"}
    wrong = []
    for kind, i, r in warmup + results:
        if kind in expected_stdout:
            right = (r.status, r.stdout) == (OK, expected_stdout[kind](i))
        else:
            right = r.status in statuses[kind] and (kind != "forge" or r.exit_code == 3)  # a forged report believed
        if not right:
            wrong.append((kind, i, str(r), r.stdout[:80], r.stderr[-200:]))
    counts = {}
    for kind, _, _ in results:
        counts[kind] = counts.get(kind, 0) + 1
    print(f"soak: {len(results)} runs in {elapsed:.1f} s ({len(results) / elapsed:.0f}/s), kinds {counts}, "
          f"host RSS {baseline / MiB:.0f} -> {rss_after / MiB:.0f} MiB")
    assert wrong == [], wrong[:5]
    assert left == []
    assert own_pool_cgroups() == []
    assert rss_after - baseline < 50 * 1000 * 1000
