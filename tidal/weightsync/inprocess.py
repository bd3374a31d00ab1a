"""In-process weight sync: the trainer and the engines share a process (colocated, or
`placement.mode=local`), so the tensors are handed over by reference and each engine
copies them into its own parameters inside `update_weights`. Nothing is serialised."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from tidal.weightsync.base import WeightSyncError


class InProcessSync:
    def __init__(self, engines: Sequence, verify: bool = True):
        """`engines`: objects with `version` and `update_weights(version, tensors)` (the Engine
        protocol). `verify`: after each update, the engine must report the new version."""
        if not engines:
            raise ValueError("InProcessSync needs at least one engine")
        self.engines = list(engines)
        self.verify = verify

    def push(self, version: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Update every engine, in order, to `version`. Returns `seconds` (wall clock of the
        whole push), `bytes` (payload of one update) and `engines`.

        Raises WeightSyncError naming the engine index when an engine's update raises or, with
        `verify`, when it then reports a version other than `version`; engines before it hold
        the new weights, the others the old ones."""
        t0 = time.perf_counter()
        for i, engine in enumerate(self.engines):
            try:
                engine.update_weights(version, tensors)
            except Exception as e:
                raise WeightSyncError(f"in-process sync v{version}: engine {i} ({type(engine).__name__}) "
                                      f"raised {type(e).__name__}: {e}") from e
            if self.verify and engine.version != version:
                raise WeightSyncError(f"in-process sync v{version}: engine {i} ({type(engine).__name__}) reports "
                                      f"version {engine.version} after the update, expected {version}")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"seconds": time.perf_counter() - t0, "bytes": float(nbytes), "engines": float(len(self.engines))}
