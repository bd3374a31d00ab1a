"""The torch engine's records of the work in flight: generate calls, their requests, the running batch.

A `Call` is one `generate` call, resolved when the last of its requests finishes; a `Seq` is one
request being generated (its tokens, log-probs and weight versions so far); `Rows` is the batch
being decoded, one row per `Seq`, holding the rows' KV cache and sampling state as tensors so
that a decode step runs on all rows at once. Rows leave and join between decode steps
(tidal/engines/torch_engine.py says when).
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from tidal.engines.lean_decode import KVCache
from tidal.types import GenerationRequest, GenerationResult


class Call:
    """One generate call: its requests, their results as they finish, and the future its
    caller waits on (resolved when the last of them finishes)."""

    def __init__(self, requests: list[GenerationRequest]):
        self.requests = requests
        self.out: list[GenerationResult | None] = [None] * len(requests)
        self.left = len(requests)
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    def seqs(self) -> list[Seq]:
        return [Seq(self, i) for i in range(len(self.requests))]


@dataclass(eq=False)
class Seq:
    """One request being generated: the tokens, log-probs and versions so far."""

    call: Call
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: list[np.ndarray] = field(default_factory=list)  # an MoE's experts [layers, k] per fed token

    @property
    def request(self) -> GenerationRequest:
        return self.call.requests[self.index]

    def finish(self, reason: str) -> None:
        call = self.call
        call.out[self.index] = GenerationResult(self.request.request_id, self.tokens, self.logprobs, reason,
                                                max(self.versions), token_versions=self.versions,
                                                routed_experts=self._routed())
        call.left -= 1
        if call.left == 0 and not call.future.done():
            try:
                call.future.set_result(call.out)
            except concurrent.futures.InvalidStateError:  # cancelled just now
                pass


    def _routed(self) -> np.ndarray | None:
        """[tokens, layers, k]: the experts of each fed token; the last (never fed) row marks none."""
        if not self.routed:
            return None
        last = np.full_like(self.routed[0], np.iinfo(self.routed[0].dtype).max)[None]
        return np.concatenate([np.stack(self.routed[: len(self.tokens) - 1]), last])


def calls_of(waiting: Waiting, rows: Rows | None) -> set[Call]:
    return {s.call for s in waiting} | {s.call for r in (waiting.ready, rows) if r is not None for s in r.seqs}


def fail_calls(calls, error: BaseException) -> None:
    for call in calls:
        if not call.future.done():
            try:
                call.future.set_exception(error)
            except concurrent.futures.InvalidStateError:
                pass


@dataclass
class Rows:
    """The running batch: one row per request being decoded, with its KV cache (left-padded
    to a common length, with its mask), next position, next-token logits and sampling
    parameters. Rows leave (`select`) and join (`merge`) between decode steps."""

    seqs: list[Seq]  # the request of each row
    cache: KVCache
    next_pos: torch.Tensor
    logits: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor  # tokens generated so far per row: the position of the sampling noise
    versions: torch.Tensor  # weight version that computed each row's `logits`

    _PER_ROW = ("next_pos", "logits", "temperature", "top_k", "top_p", "seeds", "steps", "versions")

    def __len__(self) -> int:
        return len(self.seqs)

    def select(self, keep: list[int]) -> torch.Tensor:
        """Keep the rows `keep`; returns their new order (old row at each new position) as
        a tensor, for the caller's own per-row tensors."""
        order = self.cache.select(keep)  # also cuts left padding that no remaining row needs
        order_t = torch.tensor(order, device=self.seeds.device)
        for name in self._PER_ROW:
            setattr(self, name, getattr(self, name)[order_t])
        self.seqs = [self.seqs[i] for i in order]
        return order_t

    def decode(self, step, tok: torch.Tensor, version: int) -> None:
        """Feed each row's sampled token through `step(tok, positions, cache) -> logits`; the
        logits become those of the next position, computed by the weights of `version`
        (earlier positions keep their cache)."""
        self.logits = step(tok, self.next_pos, self.cache)
        self.next_pos = self.next_pos + 1
        self.steps = self.steps + 1
        self.versions = torch.full_like(self.versions, version)

    def split(self, n: int) -> Rows:
        """Take the first `n` rows out (returned as their own Rows); these keep the rest. Both
        caches are views of the same buffers, on rows apart, so neither copies or sees the
        other's writes."""
        kv = self.cache
        head = Rows(self.seqs[:n], KVCache(kv.k[:, :n], kv.v[:, :n], kv.mask[:n], n, kv.lo, kv.hi),
                    **{name: getattr(self, name)[:n] for name in self._PER_ROW})
        self.cache = KVCache(kv.k[:, n:], kv.v[:, n:], kv.mask[n:], kv.n - n, kv.lo, kv.hi)
        for name in self._PER_ROW:
            setattr(self, name, getattr(self, name)[n:])
        self.seqs = self.seqs[n:]
        return head

    def merge(self, new: Rows) -> Rows:
        """Append `new` rows: both caches are left-padded to the longer one (masked out)."""
        self.cache = self.cache.merge(new.cache)
        for name in self._PER_ROW:
            setattr(self, name, torch.cat([getattr(self, name), getattr(new, name)]))
        self.seqs = self.seqs + new.seqs
        return self


class Waiting(deque):
    """The requests not decoding yet: the queue of Seqs (oldest first), and `ready`, rows
    already prefilled that join the batch as soon as it has room (torch_engine.py's
    `TorchEngine._step`). They count as in flight."""

    def __init__(self, seqs=()):
        super().__init__(seqs)
        self.ready: Rows | None = None

    @property
    def empty(self) -> bool:
        return not self and self.ready is None

    def clear(self) -> None:
        super().clear()
        self.ready = None


def image_ids(request: GenerationRequest) -> tuple[str, ...]:
    """The ids of a request's pictures, in order."""
    return tuple(b.id for b in request.images)


def shared_prompts(requests: list[GenerationRequest]) -> tuple[list[GenerationRequest], list[int]]:
    """The requests with distinct prompts (tokens and pictures; the first of each), and for every
    request the position of its prompt among them."""
    first: dict[tuple, int] = {}
    distinct: list[GenerationRequest] = []
    position = []
    for r in requests:
        key = (tuple(r.prompt_ids), image_ids(r))
        if key not in first:
            first[key] = len(distinct)
            distinct.append(r)
        position.append(first[key])
    return distinct, position
