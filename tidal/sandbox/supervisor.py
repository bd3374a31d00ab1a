"""The sandbox's native supervisor: `_supervisor.c`, built once with the system's C compiler.

Every sandbox's init reports how the code ended (tidal/sandbox/_runner.py says why that
report cannot be forged). Where this program can be built, it is that init and it starts the
runner as a fresh process; otherwise the runner forks itself and its parent supervises. The
fork costs every run the copies of the interpreter pages the code's process writes and a
second Python process to tear down (measured with `benchmarks/sandbox.py --against`: about
3 ms of CPU per run of ~20 ms, BENCHMARKS.md).

The binary is cached, keyed by a hash of the source, in `$TIDAL_CACHE_DIR/sandbox`, else
`/var/cache/tidal/sandbox` for root (whose home the sandbox uid cannot read) and
`~/.cache/tidal/sandbox` for other users. It is used only if it, its directory and every
directory above are owned by root or by this user and writable by nobody else, and the
sandbox uid can read it; otherwise it is rebuilt, or (no compiler, an unsafe directory) the
Python supervisor is used and a warning says why, once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from tidal import cache_root

log = logging.getLogger("tidal.sandbox")

SOURCE = Path(__file__).with_name("_supervisor.c")
COMPILE_TIMEOUT_S = 120


def cache_dir() -> Path:
    """tidal's cache (`tidal.cache_root`), but /var/cache/tidal for root without
    TIDAL_CACHE_DIR: root's home is closed to the sandbox uid that must read the binary."""
    if os.geteuid() == 0 and not os.environ.get("TIDAL_CACHE_DIR"):
        return Path("/var/cache/tidal/sandbox")
    return cache_root() / "sandbox"


def _unsafe(path: Path) -> str | None:
    """Why `path` (and each directory above it) could be changed by someone other than root
    or this user, or None."""
    euid = os.geteuid()
    for node in [path, *path.parents]:
        st = node.lstat()
        if stat.S_ISLNK(st.st_mode):
            return f"{node} is a symbolic link"
        if st.st_uid not in (0, euid):
            return f"{node} belongs to uid {st.st_uid}"
        sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX  # /tmp: others cannot rename in it
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (sticky_dir and node != path):
            return f"{node} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _compile(source: Path, target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc) is installed")
    fd, tmp = tempfile.mkstemp(prefix=".supervisor-", dir=target.parent)
    os.close(fd)
    try:
        errors = ""
        for static in (["-static"], []):  # static: no dynamic linker to run on each start
            done = subprocess.run([compiler, "-O2", *static, "-o", tmp, str(source)], capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_S, check=False)
            if done.returncode == 0:
                break
            errors = done.stderr.strip()[-500:]
        else:
            raise OSError(f"{compiler} failed: {errors}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def readable_by(path: str, uid: int) -> bool:
    """Whether `uid` can reach and read `path` through ordinary permissions."""
    if uid == os.geteuid():
        return os.access(path, os.R_OK)
    parts = Path(path).resolve().parts
    for i in range(1, len(parts) + 1):
        node = os.stat(os.path.join(*parts[:i]))
        needed = stat.S_IROTH if i == len(parts) else stat.S_IXOTH
        if node.st_uid == uid:
            needed <<= 6
        if not node.st_mode & needed:
            return False
    return True


@functools.lru_cache(maxsize=8)
def binary(sandbox_uid: int) -> str | None:
    """The path of the built supervisor, built now if needed; None (with a warning, once) if
    it cannot be built or used safely, in which case the runner supervises itself."""
    source = SOURCE.read_bytes()
    directory = cache_dir()
    target = directory / f"supervisor-{hashlib.sha256(source).hexdigest()[:16]}"
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o755)
        if (why := _unsafe(directory)) is not None:
            raise OSError(why)
        if target.exists() and _unsafe(target) is not None:
            target.unlink()
        if not target.exists():
            _compile(SOURCE, target)
        if not readable_by(str(target), sandbox_uid) or stat.S_IMODE(os.stat(target).st_mode) & 0o111 != 0o111:
            raise OSError(f"the sandbox uid {sandbox_uid} cannot read and execute {target}")
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("sandbox: the native supervisor is unavailable (%s); each run's interpreter forks its own "
                    "supervisor instead, which costs a few ms of CPU per run (set TIDAL_CACHE_DIR to a directory "
                    "only you can write, or install a C compiler)", e)
        return None
    return str(target)
