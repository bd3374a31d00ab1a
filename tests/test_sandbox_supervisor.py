"""The sandbox's init: the native supervisor (tidal/sandbox/_supervisor.c) and its fallback.

With a C compiler (scripts/setup.sh installs one), the init of every sandbox is the small
native program, and the runner is its child, a fresh process. Without one, the runner forks
and its parent is the init. The reports of both are checked here; the attacks on them
(ptrace, forged results) run against both in test_sandbox_hardening.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest
from sandbox_support import require_bwrap

from tidal.sandbox import SandboxConfig, SandboxPool, SandboxStatus, launch, supervisor
from tidal.sandbox import run_python_sync as run_python

SUPERVISORS = pytest.mark.parametrize("native", [True, False], ids=["native_init", "forked_init"])


@pytest.fixture
def fresh_build(monkeypatch):
    """A cache of its own (TIDAL_CACHE_DIR; not under pytest's tmp_path, whose mode 700 keeps
    the sandbox uid out) and no memoized builds or commands, before and after."""
    root = Path(tempfile.mkdtemp(prefix="tidal-supervisor-test-"))
    root.chmod(0o755)
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(root))
    supervisor.binary.cache_clear()
    launch._command.cache_clear()
    yield root / "sandbox"
    supervisor.binary.cache_clear()
    launch._command.cache_clear()
    shutil.rmtree(root)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, executable) of every process this test can see."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                ppid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
            found[int(pid)] = (ppid, os.readlink(f"/proc/{pid}/exe"))
        except (OSError, StopIteration):
            continue
    return found


def _warm_sandbox_trees(config: SandboxConfig) -> list[list[str]]:
    """For each warm sandbox: the executables from bubblewrap down, one per generation."""
    async def main():
        async with SandboxPool(config.model_copy(update={"warm": 2})) as pool:
            assert (await pool.run_python("print('ran')")).stdout == "ran\n"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                procs = _processes()
                trees = []
                for pid, (ppid, exe) in procs.items():
                    if ppid == os.getpid() and exe.endswith("bwrap"):
                        chain, node = [exe], pid
                        while children := [p for p, (pp, _) in procs.items() if pp == node]:
                            node = children[0]
                            chain.append(procs[node][1])
                        trees.append(chain)
                if trees and all(len(t) == 3 for t in trees):
                    return trees
                await asyncio.sleep(0.05)
            return trees

    return asyncio.run(main())


def require_cc() -> None:
    """Like require_bwrap: a missing compiler fails the test where scripts/setup.sh could
    have installed it (root with apt-get), and skips it elsewhere."""
    if shutil.which("cc"):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        pytest.fail("no C compiler although scripts/setup.sh installs gcc here", pytrace=False)
    pytest.skip("no C compiler (cc): the native supervisor cannot be built here")


def test_the_native_supervisor_is_the_init_and_the_runner_its_fresh_child():
    require_bwrap()
    require_cc()
    for tree in _warm_sandbox_trees(SandboxConfig()):
        assert len(tree) == 3, tree
        assert Path(tree[1]).name.startswith("supervisor-") and Path(tree[1]).parent == supervisor.cache_dir(), tree
        assert Path(tree[2]).name.startswith("python"), tree
    forked = _warm_sandbox_trees(SandboxConfig(native_supervisor=False))
    assert forked and all(Path(t[1]).name.startswith("python") and t[2] == t[1] for t in forked), forked


@SUPERVISORS
def test_the_init_reports_exit_codes_and_signals(native):
    require_bwrap()
    config = SandboxConfig(warm=0, native_supervisor=native)
    exited = run_python("import sys; print('out'); sys.exit(3)", config=config)
    assert (exited.status, exited.exit_code, exited.signal, exited.stdout) == (SandboxStatus.OK, 3, None, "out\n")
    # A chosen exit code of 128+N is not a signal: the init reports the kernel's account.
    chosen = run_python("raise SystemExit(139)", config=config)
    assert (chosen.status, chosen.exit_code, chosen.signal) == (SandboxStatus.OK, 139, None)
    killed = run_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", config=config)
    assert (killed.status, killed.exit_code, killed.signal) == (SandboxStatus.KILLED, None, 11)
    # RLIMIT_CPU's SIGXCPU, reported by the init as a signal, is the run's CPU bound.
    spun = run_python("while True: pass", config=config, limits={"cpu_s": 1, "wall_s": 30})
    assert (spun.status, spun.signal) == (SandboxStatus.TIMEOUT, 24), spun


def test_an_unsafe_cache_directory_is_refused_and_the_runner_supervises_itself(fresh_build, caplog):
    require_bwrap()
    fresh_build.mkdir(parents=True)
    fresh_build.chmod(0o777)  # anyone could swap the binary the next sandbox executes as its init
    with caplog.at_level(logging.WARNING, logger="tidal.sandbox"):
        assert supervisor.binary(launch.sandbox_uid(SandboxConfig())) is None
    assert "writable by others" in caplog.text and str(fresh_build) in caplog.text
    r = run_python("print(6 * 7)", config=SandboxConfig(warm=0))
    assert (r.status, r.stdout) == (SandboxStatus.OK, "42\n")
    assert not any(fresh_build.iterdir()), "nothing may be built into an unsafe directory"


def test_a_cached_binary_others_could_change_is_rebuilt(fresh_build):
    require_bwrap()
    require_cc()
    built = Path(supervisor.binary(launch.sandbox_uid(SandboxConfig())))
    built.write_bytes(b"#!/bin/sh\necho swapped\n")  # what someone who could write it might leave
    built.chmod(0o777)
    supervisor.binary.cache_clear()
    rebuilt = Path(supervisor.binary(launch.sandbox_uid(SandboxConfig())))
    assert rebuilt == built and rebuilt.read_bytes()[:4] == b"\x7fELF"
    assert stat.S_IMODE(rebuilt.stat().st_mode) == 0o755


def test_without_a_compiler_a_warning_names_it_and_runs_still_work(fresh_build, monkeypatch, caplog):
    require_bwrap()
    monkeypatch.setenv("CC", str(fresh_build.parent / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="tidal.sandbox"):
        r = run_python("print('still isolated')", config=SandboxConfig(warm=0))
    assert (r.status, r.stdout) == (SandboxStatus.OK, "still isolated\n")
    assert "native supervisor is unavailable" in caplog.text and "no-such-compiler" in caplog.text
