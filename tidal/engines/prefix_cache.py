"""The torch engine's prefix cache across turns: a session's finished request keeps its KV
cache (prompt and generation but the last token), least recently used first out within a byte
budget, so the session's next turn prefills only what the environment added. The engine
empties it on every weight update and sleep: kept KV is used only with the weights that
computed it (docs/engines.md, "Prefix cache across turns")."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Prefix:
    """A finished request's KV cache: `tokens` (its prompt and generation but the last) and
    per layer keys and values [1, heads, len(tokens), head_dim]."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixCache:
    """Sessions' kept KV caches, least recently used first out, at most `max_bytes` (0: off)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0  # requests that found their session's prefix
        self._entries: OrderedDict[str, Prefix] = OrderedDict()
        self._lock = threading.Lock()  # loops of several calls (cross_call_batching=False) share it

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, session: str, prompt: list[int]) -> Prefix | None:
        """The session's entry if `prompt` extends its tokens (removed either way: the request
        will keep its own, longer one)."""
        if not session or self.max_bytes <= 0:
            return None
        with self._lock:
            entry = self._entries.pop(session, None)
            if entry is None:
                return None
            self.bytes -= entry.nbytes
        n = len(entry.tokens)
        if n > len(prompt) or list(prompt[:n]) != entry.tokens:
            return None
        self.hits += 1
        return entry

    def put(self, session: str, entry: Prefix) -> None:
        size = entry.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(session, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._entries[session] = entry
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, out = self._entries.popitem(last=False)
                self.bytes -= out.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
