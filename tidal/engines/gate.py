"""What a served engine (vLLM, SGLang) needs between generate calls and weight updates.

`UpdateGate`: an update waits until every generate call in flight has finished and holds
new calls back until it is done, so each result's `version` produced all of its tokens;
`pause()` holds new calls back too. `with_tied_head`: engines that keep a separately packed
output layer need `lm_head.weight` in every update, even when the model ties it to the
input embedding (docs/weightsync.md, "Tied embeddings": log-probs off by 0.2–0.7 without it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch


class UpdateGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inflight = 0
        self._updating = False
        self._paused = False

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def enter(self, check_open: Callable[[], None]) -> None:
        """Wait until neither paused nor updating, then count one call in flight. Polls, so a
        cancelled caller leaves nothing behind; `check_open` raises once the engine is closed."""
        while True:
            with self._cond:
                check_open()
                if not self._paused and not self._updating:
                    self._inflight += 1
                    return
            await asyncio.sleep(0.005)

    def exit(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    @contextmanager
    def exclusive(self, timeout_s: float, on_timeout: Callable[[int], Exception]) -> Iterator[None]:
        """Hold new calls back, wait up to timeout_s for those in flight, run the body alone.
        `on_timeout(calls_in_flight)` builds the error raised when they do not finish."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._updating = True
            try:
                while self._inflight:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise on_timeout(self._inflight)
                    self._cond.wait(left)
            except BaseException:
                self._updating = False
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()


def with_tied_head(tensors: Mapping[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """The update as a dict, with `lm_head.weight` added from the input embedding when the
    model ties them and the caller left it out. Raises ValueError when it cannot be added."""
    named = dict(tensors)
    if tied and "lm_head.weight" not in named:
        embed = next((k for k in named if k.endswith("embed_tokens.weight")), None)
        if embed is None:
            raise ValueError("the model ties its embeddings but the update has neither lm_head.weight nor an "
                             f"embed_tokens.weight (first names: {sorted(named)[:5]})")
        named["lm_head.weight"] = named[embed]
    return named
