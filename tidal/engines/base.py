"""The Engine protocol (docs/architecture.md, "Roles"). The built-in torch engine, vLLM and SGLang each implement it, as do
the router over replicas and the driver's proxy of an engine actor; the rest of tidal never
knows which one runs.

Every engine has the calls of `Engine`. The optional ones are declared in `EngineBase`, with
what an engine that lacks them does (nothing to close; it cannot sleep): an engine class
inherits it and overrides what it has, so no caller probes for a method.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import ClassVar, Protocol

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

    def close(self) -> None: ...


class EngineBase:
    """The optional parts of an engine, declared once with their defaults."""

    # Whether `sleep`/`wake_up` release and take back the engine's memory (colocated with a
    # synchronous trainer, the trainer rank puts its engine to sleep while it trains).
    can_sleep: ClassVar[bool] = False

    def close(self) -> None:
        """Release processes, memory and threads; nothing to release by default."""

    def sleep(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot sleep (can_sleep is False)")

    def wake_up(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot sleep (can_sleep is False)")

    @contextlib.contextmanager
    def peer_weights(self) -> Iterator[tuple[int, Mapping[str, torch.Tensor]]]:
        """(version, {HF name: whole tensor}) readable while the body runs, for a new replica to
        take (tidal/weightsync/peer.py); no update lands meanwhile. By default the engine keeps
        no readable copy: PeerUnavailable."""
        from tidal.weightsync.peer import PeerUnavailable

        raise PeerUnavailable(f"{type(self).__name__} keeps no readable copy of its weights to serve a peer")
        yield  # a generator, for contextmanager
