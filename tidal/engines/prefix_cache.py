"""The torch engine's caches of things the current weights computed, each least recently used
first out within a byte budget, and each emptied by the engine on every weight update and
sleep: kept values are used only with the weights that computed them.

`PrefixCache`: a session's finished request keeps its KV cache (prompt and generation but the
last token), so the session's next turn prefills only what the environment added
(docs/engines.md, "Prefix cache across turns"). With images, an entry also names the images
whose runs its tokens hold: image pads are the same token whatever the picture, so the tokens
alone cannot tell that a later prompt shows the same pictures.

`FeatureCache`: a vision-language model's image features (the vision tower's output, one row
per image token) by image id, so a group's samples of one prompt and an episode's later turns
do not run the vision tower again for a picture it has already encoded."""

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
    images: tuple[str, ...] = ()  # ids of the images whose runs start in `tokens`, in order

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
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, session: str, prompt: list[int], images: tuple[str, ...] = ()) -> Prefix | None:
        """The session's entry if `prompt` extends its tokens and `images` (ids, one per image
        run of `prompt`) begin with the entry's (removed either way: the request will keep its
        own, longer one)."""
        if not session or self.max_bytes <= 0:
            return None
        with self._lock:
            entry = self._entries.pop(session, None)
            if entry is None:
                return None
            self.bytes -= entry.nbytes
        n = len(entry.tokens)
        if n > len(prompt) or list(prompt[:n]) != entry.tokens or tuple(images[:len(entry.images)]) != entry.images:
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


class FeatureCache:
    """Image features [tokens, hidden] by image id, least recently used first out, at most
    `max_bytes` (0: off; a single image larger than that is not kept)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, image_id: str) -> torch.Tensor | None:
        with self._lock:
            hit = self._entries.get(image_id)
            if hit is not None:
                self._entries.move_to_end(image_id)
            return hit

    def put(self, image_id: str, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(image_id, None)
            if old is not None:
                self.bytes -= old.numel() * old.element_size()
            self._entries[image_id] = features
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, out = self._entries.popitem(last=False)
                self.bytes -= out.numel() * out.element_size()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
