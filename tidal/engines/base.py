"""The Engine protocol (docs/architecture.md, "Roles"). The built-in torch engine, vLLM and SGLang each
implement it; the rest of tidal never knows which one runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from tidal.types import GenerationRequest, GenerationResult


class Engine(Protocol):
    @property
    def version(self) -> int:
        """Weight version the engine holds now."""

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]: ...

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...
