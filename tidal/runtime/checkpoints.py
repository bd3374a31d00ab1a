"""Checkpoints you can trust: a manifest of every file's size and SHA-256, written (and every
file fsynced) before the temporary directory is renamed into place, and checked on resume.

A checkpoint directory `step_N/` is complete when its `manifest.json` lists each of its files
with the size and hash it has. `--resume` takes the newest complete one; a damaged one (a
file missing, truncated or changed, no manifest) is named in a warning and the one before it
is tried. Retention deletes old checkpoints only once the new one verified, so the last good
checkpoint is never deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tidal.durable import disk_error, write_atomic

log = logging.getLogger("tidal")

MANIFEST = "manifest.json"


@dataclass
class RunPaths:
    """Where a run keeps its checkpoints: `ROOT/checkpoints/step_N/`."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:06d}"

    def latest_checkpoint(self) -> Path | None:
        """The newest checkpoint whose manifest verifies (a damaged newer one is named and skipped)."""
        return latest_good(self.checkpoints)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path) -> None:
    """Fsync every file of `directory` and record it in its manifest (itself fsynced, with the
    directory), so a rename after this leaves a checkpoint that is whole on disk."""
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            _fsync(p)
            files[str(p.relative_to(directory))] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    manifest = directory / MANIFEST
    manifest.write_text(json.dumps({"files": files}, indent=1) + "\n")
    _fsync(manifest)
    for d in {directory, *(p.parent for p in directory.rglob("*") if p.is_file())}:
        _fsync(d)


def damage(directory: Path) -> str | None:
    """Why the checkpoint in `directory` cannot be trusted, or None when every file listed in
    its manifest is there with its size and hash."""
    manifest = directory / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        return f"{MANIFEST} is missing (the checkpoint was not completed)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for name, want in files.items():
        p = directory / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, the manifest says {want['bytes']} (truncated or overwritten)"
        if _sha256(p) != want["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest (corrupted)"
    return None


def checkpoint_dirs(root: Path) -> list[Path]:
    """The checkpoint directories under `root`, oldest first (temporary ones left out)."""
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))


def latest_good(root: Path) -> Path | None:
    """The newest checkpoint that verifies; each damaged newer one is named in a warning."""
    for p in reversed(checkpoint_dirs(root)):
        why = damage(p)
        if why is None:
            return p
        log.warning("checkpoint %s is damaged (%s): falling back to the one before it", p, why)
    return None


def prune(root: Path, keep: int, newest: Path, protect: Path | None = None) -> None:
    """Keep `newest` and the `keep - 1` checkpoints before it; delete the older ones, and only
    once `newest` verified (otherwise nothing is deleted: the last good checkpoint stays).
    `protect` (the run's best, eval.keep_best) is never deleted and does not count in `keep`.
    Directories after `newest` (left by an attempt that was resumed from earlier) are not
    touched: the run overwrites them when it gets there."""
    why = damage(newest)
    if why is not None:
        log.error("checkpoint %s did not verify after writing (%s): older checkpoints are kept", newest, why)
        return
    import shutil

    older = [p for p in checkpoint_dirs(root) if p.name < newest.name and p != protect]
    for p in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)


def read_best(root: Path) -> dict | None:
    """The run's best checkpoint by eval.keep_best (`root/best.json`), or None."""
    path = root / "best.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_best(root: Path, record: dict) -> None:
    write_atomic(root / "best.json", json.dumps(record, indent=1) + "\n")


def file_system_error(e: BaseException) -> OSError | None:
    """The file-system error behind `e`: a disk error as tidal/durable.py reads them (in the
    chain, or in a library's message: safetensors' "(os error 28)", torch.save's short write),
    else any OSError in its chain (a trainer rank's error holds the rank's as its cause); None
    otherwise."""
    found = disk_error(e)
    for _ in range(8):
        if found is not None or e is None:
            return found
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None
