"""How a run stops for its directory, and how a resume finds the directory in order.

`RunFailed` is a run that stopped itself with its last checkpoint intact (the CLI's exit 3);
`DiskError` is one whose directory could not be written (a full disk, a quota, an I/O error):
`disk_failure` turns the error of any write (a checkpoint, the episodes, metrics.jsonl, a log,
an event) into one message naming the path, the reason, the free space and the last good
checkpoint, so that a full disk reads the same whichever write met it first.

On resume (`tidy_for_resume`) what an earlier attempt left past its last checkpoint goes: a
torn last line of each appended file is cut (the process died, or the disk filled, in the
middle of it) and said in the log, and the episode files of steps after the checkpoint (an
attempt that went further than the resume will, or that died in a step) are removed, with the
hidden temporary files of unfinished ones. metrics.jsonl drops its own steps past the
checkpoint as it opens (tidal/monitor/sinks.py).

`clear_run` (`tidal train --overwrite`) empties the directory of an earlier run for a new one,
and says what it removed. It removes only a run's directory (one that holds a config.yaml, or an
empty one): a mistyped run.dir naming a directory of other files is refused, not emptied.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from tidal.durable import disk_error, free_bytes, repair_tail
from tidal.monitor.episodes import episode_files, file_step
from tidal.runtime.run_lock import LOCK_FILE

log = logging.getLogger("tidal")

# The files a run appends to, whose last line a crash or a full disk may tear.
APPENDED = ("metrics.jsonl", "events.jsonl", "resumes.jsonl", "hacking_events.jsonl", "trace.jsonl", "train.log")


class RunFailed(RuntimeError):
    """The run stopped itself (the failure budget, non-finite steps, an alert of alerts.stop_on, a
    full disk): its last checkpoint is intact."""


class DiskError(RunFailed):
    """The run directory could not be written: the run stopped, its last good checkpoint intact."""


def free_space(path: Path) -> str:
    """`N MiB free there` for the file system of `path`."""
    return _size(free_bytes(path))


def _size(n: int | None) -> str:
    if n is None:
        return "free space unknown"
    return f"{n / 2**20:.1f} MiB free there" if n >= 2**20 else f"{n} bytes free there"


def disk_failure(e: BaseException, root: Path, step: int, last_checkpoint: Path | None,
                 what: str | None = None) -> DiskError | None:
    """The DiskError that stops a run for `e`, when `e` is a disk error (durable.disk_error);
    None otherwise. `what`: the write that failed, when its path is not in the error."""
    cause = disk_error(e)
    if cause is None:
        return None
    path = cause.filename or what or "the run directory"
    reason = cause.strerror or str(cause)
    counted = (f"step {step} was checkpointed before it" if last_checkpoint is not None
               and last_checkpoint.name == f"step_{step:06d}" else f"step {step} is not counted")
    return DiskError(f"step {step}: could not write {path} ({reason}; {_size(free_bytes(path if cause.filename else root))}). "
                     f"The run stopped; {counted} and the last good checkpoint is "
                     f"{last_checkpoint or 'none (no step was saved yet)'}. Free space, then continue with: "
                     f"tidal train --resume run.dir={root}")


def tidy_for_resume(root: Path, step: int) -> None:
    """Cut torn tails off the appended files and remove episode files of steps after `step`
    (the checkpoint the run resumes from), each said in the log."""
    for name in APPENDED:
        if name == "metrics.jsonl":
            continue  # its sink drops what it cannot read, with every line past the checkpoint
        cut = repair_tail(root / name)
        if cut:
            log.warning("%s: a torn last line (%d bytes, an interrupted write) was removed", root / name, cut)
    store = root / "episodes"
    if not store.is_dir():
        return
    gone = [f for f in episode_files(store) if (file_step(f) or 0) > step]
    gone += [f for f in store.glob(".step_*.tmp") if f.is_file()]
    for f in gone:
        f.unlink(missing_ok=True)
    if gone:
        log.warning("episodes: %d file(s) of steps after the checkpoint (step %d), left by an earlier attempt, were "
                    "removed: %s", len(gone), step, ", ".join(sorted(f.name for f in gone)[:8]))


def clear_run(root: Path) -> list[str]:
    """Remove everything in `root`, the directory of an earlier run, but its lock (held by the
    caller); the removed entries are named in the log (and returned). A FileExistsError for a
    directory that is not a run's (no config.yaml and not empty)."""
    entries = sorted(p for p in root.iterdir() if p.name != LOCK_FILE) if root.is_dir() else []
    if entries and not (root / "config.yaml").is_file():
        raise FileExistsError(f"--overwrite: {root} is not a run directory (it holds no config.yaml, but "
                              f"{len(entries)} other entries): --overwrite empties only a run's directory; choose "
                              "another run.dir")
    if not entries:
        return []
    names, total = [], 0
    for p in entries:
        files = [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p]
        total += sum(f.stat().st_size for f in files if not f.is_symlink())
        names.append(f"{p.name}/ ({len(files)} files)" if p.is_dir() and not p.is_symlink() else p.name)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    log.warning("--overwrite: removed the earlier run in %s (%.1f MiB): %s", root, total / 2**20, ", ".join(names))
    return names
