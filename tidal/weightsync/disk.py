"""Weight sync through a (shared) directory: the trainer writes each version as safetensors,
engines read the newest. For engines on other machines with a shared filesystem, for
engines that load weights from a path (vLLM's `reload_weights`, SGLang's
`update_weights_from_disk`), and as a record of what each version was.

Layout: `DIR/v{version:08d}/model.safetensors` and `meta.json` (version, checksum, names,
bytes). A version is written into a temporary directory next to it and renamed into place,
so a reader never sees half a version: a `v*` directory is complete or absent. After a
write only the newest `keep` versions remain. A reader that picked a version the writer
then pruned (more than `keep` writes later) gets an error and reads the newest again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tidal.weightsync.base import WeightSyncError, checksum

VERSION_DIR = re.compile(r"^v(\d{8,})$")


class DiskSync:
    def __init__(self, directory: str | Path, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def versions(self) -> list[int]:
        """Complete versions in the directory, oldest first."""
        if not self.directory.is_dir():
            return []
        found = (VERSION_DIR.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, version: int) -> Path:
        return self.directory / f"v{version:08d}"

    def write(self, version: int, tensors: Mapping[str, torch.Tensor], with_checksum: bool = True) -> Path:
        """Write `tensors` as version `version` (replacing one of that number written before)
        and prune to the newest `keep` versions. Returns the version's directory."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(version)
        tmp = self.directory / f".tmp-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir()
        try:
            cpu = _unshared({n: t.detach().contiguous().cpu() for n, t in tensors.items()})
            save_file(cpu, str(tmp / "model.safetensors"), metadata={"version": str(version)})
            meta = {"version": version, "checksum": checksum(cpu) if with_checksum else None,
                    "names": list(cpu), "bytes": sum(t.numel() * t.element_size() for t in cpu.values())}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            if final.exists():  # a version written again (a resumed run): swap the old one out
                old = tmp.with_name(tmp.name + "-old")
                final.rename(old)
                shutil.rmtree(old)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for v in self.versions()[:-self.keep]:
            shutil.rmtree(self.path(v), ignore_errors=True)
        return final

    def read(self, path: str | Path | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Read a version: `path` is a version directory, or None for the newest in the
        directory. Verifies the names and, when `meta.json` has one, the checksum; raises
        WeightSyncError when they differ or the version is missing."""
        version, tensors, _ = self._read(path)
        return version, tensors

    def _read(self, path: str | Path | None) -> tuple[int, dict[str, torch.Tensor], dict]:
        if path is None:
            versions = self.versions()
            if not versions:
                raise WeightSyncError(f"no weight version in {self.directory}")
            path = self.path(versions[-1])
        path = Path(path)
        try:
            meta = json.loads((path / "meta.json").read_text())
            tensors = load_file(str(path / "model.safetensors"))
        except (OSError, ValueError) as e:  # missing/pruned version, or a damaged file
            raise WeightSyncError(f"cannot read weight version at {path}: {type(e).__name__}: {e}") from e
        version = int(meta["version"])
        if set(tensors) != set(meta["names"]):
            raise WeightSyncError(f"weight version v{version} at {path}: the file's tensors differ from meta.json's "
                                  f"names (missing {sorted(set(meta['names']) - set(tensors))[:5]}, "
                                  f"extra {sorted(set(tensors) - set(meta['names']))[:5]})")
        tensors = {n: tensors[n] for n in meta["names"]}
        if meta["checksum"] is not None:
            got = checksum(tensors)
            if got != meta["checksum"]:
                raise WeightSyncError(f"weight version v{version} at {path}: the checksum of what was read ({got}) "
                                      f"differs from the one written ({meta['checksum']})")
        return version, tensors, meta

    def load_into(self, engine, path: str | Path | None = None) -> dict:
        """Read a version (None: the newest) and `engine.update_weights(version, tensors)`; the
        engine must then report that version. Returns `version`, `seconds`, `bytes`,
        `checksum_ok` (True when checked, None when written without a checksum)."""
        t0 = time.perf_counter()
        version, tensors, meta = self._read(path)
        try:
            engine.update_weights(version, tensors)
        except Exception as e:
            raise WeightSyncError(f"disk sync v{version}: the engine's update_weights raised {type(e).__name__}: {e}") from e
        if engine.version != version:
            raise WeightSyncError(f"disk sync v{version}: the engine reports version {engine.version} after the update")
        return {"version": version, "seconds": time.perf_counter() - t0, "bytes": meta["bytes"],
                "checksum_ok": True if meta["checksum"] is not None else None}


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (a tied `lm_head.weight` passed next to
    the embedding): later ones of a shared storage are copied."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    return out
