"""Metric sinks. JSONL in the run directory is always on; others plug in beside it."""

from __future__ import annotations

import json
import math
from pathlib import Path


class JsonlSink:
    """One JSON object per step in `metrics.jsonl`, flushed at once (a crash loses nothing)."""

    def __init__(self, path: Path, truncate_after: int | None = None):
        self.path = path
        if truncate_after is not None and path.exists():
            # On resume, drop records past the checkpoint so the file reads as one run.
            keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= truncate_after]
            path.write_text("".join(line + "\n" for line in keep))
        self._f = path.open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}
        self._f.write(json.dumps({"step": step, **clean}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
