"""One run per run directory: `RUN/run.lock`, held for the run's life.

Two runs writing one directory interleave their metrics, episodes and checkpoints beyond
repair, and a `--resume` of a run that is still going trains its steps twice. So a run takes an
exclusive `flock` on `RUN/run.lock` before it writes anything there, and writes into the file
who holds it (pid, host, start time, command). A second run, or a `--resume` of a live run, finds
the lock taken and is refused naming that holder.

The choice of `flock` over a pid file alone: the kernel drops the lock when the holder's
last descriptor closes, whatever ends the process (kill -9 included), so no run is ever
refused by a dead one. A lock file whose holder is gone (the lock free, the file still naming
it) is a stale one: it is named in the log and taken over. The descriptor is not inherited
by the programs a run starts (close-on-exec), so it does not outlive the run in them. On a
network file system the lock is as good as its `flock` support (Linux NFS maps it to NFS locks).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path

from tidal.durable import named

log = logging.getLogger("tidal")

LOCK_FILE = "run.lock"


class RunLocked(FileExistsError):
    """The run directory is held by another live run."""


def _holder(text: str) -> dict:
    try:
        info = json.loads(text)
        return info if isinstance(info, dict) else {}
    except ValueError:
        return {}


def describe(info: dict) -> str:
    """`pid P on host H, started T (command)` of a lock file's content."""
    if not info:
        return "a process that left no record in the lock file"
    cmd = f" ({info['command']})" if info.get("command") else ""
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}{cmd}"


_SECRET = re.compile(r"(token|key|secret|password)", re.IGNORECASE)


def _command() -> str:
    """This process's command line, values of secret-looking overrides masked (the lock file is
    readable by others, and its content goes into another run's error message)."""
    args = [a.split("=", 1)[0] + "=***" if "=" in a and _SECRET.search(a.split("=", 1)[0]) else a for a in sys.argv]
    return " ".join(args)[:300]


class RunLock:
    """The lock of one run directory. `acquire` takes it or raises RunLocked naming the holder;
    `release` (idempotent; also when the process ends, by the kernel) lets it go."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._f = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the run's life; Python opens it close-on-exec
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = describe(_holder(f.read()))
            f.close()
            raise RunLocked(f"run directory {self.path.parent} is in use by another run: {holder} holds {self.path}. "
                            "A second run (or a --resume of a live one) into it would interleave their files: stop "
                            "that run first, or choose another run.dir") from None
        except BaseException:
            f.close()
            raise
        f.seek(0)
        previous = _holder(f.read())
        if previous:  # the lock was free: whoever the file names ended without releasing it
            log.warning("run directory %s: a stale lock of %s (it ended without releasing it) was taken over",
                        self.path.parent, describe(previous))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": _command()}
        try:
            f.seek(0)
            f.truncate()
            f.write(json.dumps(me) + "\n")
            f.flush()
        except OSError as e:  # a full disk: said naming this file, and the lock not kept
            with contextlib.suppress(OSError):  # its buffer cannot be written either
                f.close()
            raise named(e, self.path) from e
        self._f = f

    def release(self) -> None:
        if self._f is None:
            return
        f, self._f = self._f, None
        with contextlib.suppress(OSError):  # a full disk must not keep the lock: closing the file drops it anyway
            f.truncate(0)  # released cleanly: nothing stale to report next time
            f.flush()
        with contextlib.suppress(OSError):
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            f.close()

    @property
    def held(self) -> bool:
        return self._f is not None
