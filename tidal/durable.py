"""Writes of a run directory that a full disk or an I/O error cannot leave half done, and what
counts as such an error.

Appended files (metrics.jsonl, events.jsonl, resumes.jsonl, hacking_events.jsonl, trace.jsonl)
take whole lines or nothing: `append_lines` remembers the file's size, writes, and on a
failure cuts the file back to that size (a run holds its directory's lock, so nobody else
appends meanwhile). What can still tear a line is the process dying inside the write, or the
cut failing too (an I/O error); `repair_tail` removes such a torn last line when the run
resumes. Other files are written beside their place and renamed (`write_atomic`).

A disk error is an OSError of ENOSPC, EDQUOT, EIO, EFBIG (a file-size limit) or EROFS, found in
an exception's chain or in the message of a library that reports it as text: Rust's "(os error
28)" (safetensors), Arrow's "[errno 28]" (pyarrow), and torch.save's zip writer, whose
"[enforce fail at inline_container.cc:...] unexpected pos" is a short write it gives no errno for.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS}
_OS_ERROR_TEXT = re.compile(r"\((?:os error) (\d+)\)|\[errno (\d+)\]", re.IGNORECASE)
_TORCH_SHORT_WRITE = re.compile(r"inline_container\.cc.*unexpected pos", re.DOTALL)


def named(e: OSError, path: str | Path) -> OSError:
    """`e` with `path` as its file name (a failed write on an open file names none)."""
    if e.filename is not None:
        return e
    return OSError(e.errno, e.strerror or str(e), str(path))


def append_lines(path: str | Path, lines: list[str]) -> None:
    """Append `lines` (each ending in a newline) to `path`, all of them or none: on a failure
    the file is cut back to its size before, and the OSError names `path`."""
    data = "".join(lines).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        start = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]  # a short write (the disk filled) is followed by its error
        except OSError as e:
            with contextlib.suppress(OSError):  # the cut can fail too (EIO): repair_tail mends it on resume
                os.ftruncate(fd, start)
            raise named(e, path) from e
    finally:
        os.close(fd)


def repair_tail(path: str | Path) -> int:
    """Cut a torn last line (one without its newline) off `path`; returns the bytes removed
    (0: none, or no file)."""
    p = Path(path)
    if not p.is_file():
        return 0
    with p.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep, end = 0, size
        while end > 0:  # back to the last newline, a block at a time
            start = max(0, end - (1 << 16))
            f.seek(start)
            i = f.read(end - start).rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            end = start
        f.truncate(keep)
        return size - keep


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to a hidden file beside `path` and rename it into place: a reader (or a
    resume) sees the old content or the new, never half; on a failure nothing is left."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise named(e, p) from e


def _chain(e: BaseException | None) -> list[BaseException]:
    out = []
    while e is not None and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def disk_error(e: BaseException | None) -> OSError | None:
    """The disk error behind `e` (ENOSPC, EDQUOT, EIO, EFBIG, EROFS: an OSError in its chain,
    else one said in a library's message), or None for any other error."""
    chain = _chain(e)
    for x in chain:  # the OSError itself first: it names the file
        if isinstance(x, OSError) and x.errno in DISK_ERRNOS:
            return x
    for x in chain:
        text = str(x)
        m = _OS_ERROR_TEXT.search(text)
        if m and int(m.group(1) or m.group(2)) in DISK_ERRNOS:
            code = int(m.group(1) or m.group(2))
            return OSError(code, os.strerror(code), getattr(x, "filename", None))
        if _TORCH_SHORT_WRITE.search(text):
            return OSError(errno.EIO, "torch.save wrote short (its zip writer's 'unexpected pos': the file system took "
                           "fewer bytes than written, a full disk or an I/O error)")
    return None


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system of `path` (its nearest existing parent); None if unknown."""
    p = Path(path)
    for q in [p, *p.parents]:
        if q.exists():
            with contextlib.suppress(OSError):
                return shutil.disk_usage(q).free
            return None
    return None
