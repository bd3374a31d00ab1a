"""What a sandbox run returns: output, exit code and a typed status; and the sandbox's errors.

The statuses other than `sandbox_error` are outcomes of the code (it looped, allocated too
much, printed too much, crashed): a reward should score them as failures. `sandbox_error`
is an infrastructure failure, which must never be scored (docs/architecture.md, "Invariants": failures are typed).
Since `memory` and `output_limit` are partly read from the program's own stderr, a
program can make itself look like one of them; it can never make itself look `ok`.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from enum import Enum


class SandboxStatus(str, Enum):
    OK = "ok"  # ran to its end within every limit; its exit code may still be non-zero
    TIMEOUT = "timeout"  # wall clock (killed by the host) or CPU time (SIGXCPU)
    MEMORY = "memory"  # an allocation failed against the address-space limit
    OUTPUT_LIMIT = "output_limit"  # too much stdout/stderr, too large a file, workspace full
    KILLED = "killed"  # ended by a signal that is not one of the limits above
    SANDBOX_ERROR = "sandbox_error"  # the sandbox could not run it; not the code's fault


@dataclass(frozen=True)
class SandboxResult:
    status: SandboxStatus
    stdout: str
    stderr: str
    exit_code: int | None  # None when the process ended by a signal or was killed by the host
    signal: int | None = None  # the signal that ended it, if any
    wall_s: float = 0.0
    error: str = ""  # for sandbox_error (and for host-side kills): what failed

    @property
    def ok(self) -> bool:
        """Ran within its limits and exited 0."""
        return self.status is SandboxStatus.OK and self.exit_code == 0

    def __str__(self) -> str:
        detail = f"exit {self.exit_code}" if self.exit_code is not None else f"signal {self.signal}"
        return f"SandboxResult({self.status.value}, {detail}, {self.wall_s:.3f} s{', ' + self.error if self.error else ''})"


class SandboxUnavailable(RuntimeError):
    """Isolation was asked for and cannot be provided here; nothing was run."""


class SandboxSessionClosed(RuntimeError):
    """A session turn was asked of a session that has ended (it timed out, hit a limit,
    exited, or was closed)."""


_MEMORY_RE = re.compile(rb"\bMemoryError\b|Cannot allocate memory|std::bad_alloc|[Oo]ut of memory")
_DISK_RE = re.compile(rb"No space left on device|File too large|Disk quota exceeded")
_TAIL_BYTES = 4096


def classify_signal(sig: int, cpu_s: float | None = None, cpu_limit_s: float | None = None) -> SandboxStatus:
    """The status of a process ended by `sig`. SIGKILL after the CPU limit (the hard limit,
    one second past the soft one) is a timeout when the CPU time used is known."""
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s is not None and cpu_limit_s is not None
                                 and cpu_s >= cpu_limit_s):
        return SandboxStatus.TIMEOUT
    if sig == signal.SIGXFSZ:
        return SandboxStatus.OUTPUT_LIMIT
    return SandboxStatus.KILLED


def classify_exit(returncode: int, stderr: bytes, from_bwrap: bool) -> tuple[SandboxStatus, int | None, int | None]:
    """Status, exit code and signal of a process that ended on its own.

    bubblewrap (and a shell) report a child killed by signal N as exit code 128+N; Popen
    reports a direct child as -N. A program that exits 128+N by choice is read as that
    signal, which only ever mislabels its own failure.
    """
    sig = None
    if returncode < 0:
        sig = -returncode
    elif from_bwrap and 128 < returncode < 128 + signal.NSIG:
        sig = returncode - 128
    if sig is not None:
        return classify_signal(sig), None, sig
    if returncode != 0:
        tail = stderr[-_TAIL_BYTES:]
        if _MEMORY_RE.search(tail):
            return SandboxStatus.MEMORY, returncode, None
        if _DISK_RE.search(tail):
            return SandboxStatus.OUTPUT_LIMIT, returncode, None
    return SandboxStatus.OK, returncode, None
