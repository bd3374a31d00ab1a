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

from __future__ import annotations

import importlib

# The public names, loaded on first use (PEP 562): importing one submodule, such as
# `tidal.sandbox.cgroup` from the reward pools, does not load the whole sandbox, and the
# submodules that import their siblings by `from tidal.sandbox import cgroup` form no cycle
# through this file.
_EXPORTS = {
    "PythonSession": "session",
    "SandboxConfig": "config",
    "SandboxLimits": "config",
    "SandboxPool": "pool",
    "SandboxResult": "result",
    "SandboxSessionClosed": "result",
    "SandboxStatus": "result",
    "SandboxUnavailable": "result",
    "ShellSession": "session",
    "run_command_sync": "pool",
    "run_python_sync": "pool",
}
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


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal.sandbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tidal.sandbox.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
