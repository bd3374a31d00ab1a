"""A distinct host uid for every live sandbox, so that no sandbox shares a per-user quota.

Some kernel limits are per user and not per namespace: inotify instances (128 per user),
pipe buffer pages (`fs.pipe-user-pages-soft`: past it every new pipe of that user gets two
pages and no pipe may grow), POSIX message queue bytes (RLIMIT_MSGQUEUE, charged to the
host uid as well as inside the sandbox's user namespace), user namespaces. With one uid for
all sandboxes, one run could exhaust them for every other run and for the next one (a
message queue's bytes are returned only when its IPC namespace is freed, after the run).
So, when tidal runs as root, each sandbox runs as a uid of its own, taken from a reserved
range (`uid_pool_start`, `uid_pool_size`), and the uid goes back only after the sandbox's
processes are gone. Uids are handed out round-robin, so a returned one is the last to be
reused.

Several tidal processes on one machine share the range: a uid is taken by holding an
exclusive `flock` on its lock file in a root-only directory, which the kernel releases when
the holder exits, however it ends. Nothing waits: a uid in use is skipped.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import random
import stat
import threading
from pathlib import Path

LOCK_DIR = Path("/run/tidal-sandbox-uids")


class UidPoolExhausted(OSError):
    """Every uid of the range is held by a live sandbox."""


def _lock_dir() -> Path:
    """The lock files' directory: made by root, writable by root alone (a lock file another
    user could hold would let it deny uids)."""
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    info = LOCK_DIR.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise OSError(f"{LOCK_DIR} must be a directory owned by root and writable by root alone")
    return LOCK_DIR


class UidPool:
    """Hands out uids from [start, start + size), one per live sandbox."""

    def __init__(self, start: int, size: int):
        self.start, self.size = start, size
        # A random first uid per process: pools of several processes rarely probe the same lock.
        self._next = itertools.count(random.randrange(size))
        self._held: dict[int, int] = {}  # uid -> descriptor of its held lock file
        self._lock = threading.Lock()  # starter threads take uids, the event loop returns them

    def acquire(self) -> int:
        """A uid no live sandbox of this machine uses; UidPoolExhausted if there is none."""
        directory = _lock_dir()
        with self._lock:
            for _ in range(self.size):
                uid = self.start + next(self._next) % self.size
                if uid in self._held:
                    continue
                fd = os.open(directory / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._held[uid] = fd
                return uid
        raise UidPoolExhausted(f"all {self.size} sandbox uids from {self.start} are in use by live sandboxes; "
                               "raise sandbox.uid_pool_size")

    def release(self, uid: int) -> None:
        """Give a uid back once no process of its sandbox is left."""
        with self._lock:
            fd = self._held.pop(uid, None)
        if fd is not None:
            os.close(fd)  # closing drops the flock

    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._held)
