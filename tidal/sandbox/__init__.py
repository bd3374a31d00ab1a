"""Isolated execution of untrusted code (tool calls, unit-test rewards, shell tasks).

Isolation is bubblewrap with every namespace new (no network but the sandbox's own
loopback, read-only system, private /tmp and workspace, own PID namespace, dies with its
parent), a seccomp syscall filter, a fresh session keyring, a memory and pids cgroup per
run (teardown through it), rlimits, and a host-side wall clock and output caps; results
come from a supervisor the code cannot reach. Without bubblewrap, nothing runs unless the
config names `isolation="unsafe_host"`. See docs/sandbox.md.

    async with SandboxPool(SandboxConfig()) as pool:
        result = await pool.run_python("print(sum(range(10)))")
        assert result.status is SandboxStatus.OK and result.stdout == "45\\n"
"""

from tidal.sandbox.config import SandboxConfig, SandboxLimits
from tidal.sandbox.pool import SandboxPool, run_command_sync, run_python_sync
from tidal.sandbox.result import SandboxResult, SandboxSessionClosed, SandboxStatus, SandboxUnavailable
from tidal.sandbox.session import PythonSession, ShellSession

__all__ = [
    "PythonSession",
    "SandboxConfig",
    "SandboxLimits",
    "SandboxPool",
    "SandboxResult",
    "SandboxSessionClosed",
    "SandboxStatus",
    "SandboxUnavailable",
    "ShellSession",
    "run_command_sync",
    "run_python_sync",
]
