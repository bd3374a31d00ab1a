"""The built-in torch engine: batched sampling with a KV cache on any HF causal LM.

It is the embedded default and the reference for correctness. Prompts are left-padded
and share one KV cache. Continuous batching: a row that finishes (stop token or its own
max_new_tokens) leaves the batch at once, so the others stop paying for it, and waiting
requests join the running batch (prefilled, then their cache is merged in) as soon as
enough rows have left, so the batch stays full. Sampling noise is a function of
(request seed, position, token), so a request's tokens do not depend on which requests
it shares a batch with (up to float rounding of padded attention).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from tidal.engines.sampling import sample
from tidal.types import GenerationRequest, GenerationResult


class EngineClosed(RuntimeError):
    """The engine was closed and serves no more calls."""


class TorchEngine:
    def __init__(self, model, pad_token_id: int, max_batch_size: int = 512):
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self._version = 0
        self._running = threading.Event()
        self._running.set()
        self._closed = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def pause(self) -> None:
        """New generate calls wait until resume(); calls in progress finish."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def close(self) -> None:
        """Stop serving: later calls raise EngineClosed (a replica that was shut down)."""
        self._closed = True
        self._running.set()  # wake anything waiting on pause(), so it can fail

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise EngineClosed(f"torch engine: {call} after close()")

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self._check_open(f"update_weights v{version}")
        params = dict(self.model.named_parameters())
        unknown = sorted(set(tensors) - set(params))
        missing = sorted(set(params) - set(tensors))
        if unknown or missing:
            raise ValueError(f"weight update v{version} does not match the engine's model: unknown {unknown[:5]}, missing {missing[:5]}")
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t)
        self._version = version

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        await asyncio.to_thread(self._running.wait)
        return await asyncio.to_thread(self.generate_sync, requests)

    def generate_sync(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        self._check_open(f"generate ({len(requests)} requests)")
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"request {r.request_id} has an empty prompt")
        # Shortest prompts first: rows that join together pad little.
        waiting = deque(sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids)))
        tokens: list[list[int]] = [[] for _ in requests]
        logps: list[list[float]] = [[] for _ in requests]
        out: list[GenerationResult | None] = [None] * len(requests)
        rows: _Rows | None = None
        with torch.inference_mode():
            while waiting or rows is not None:
                free = self.max_batch_size - (len(rows) if rows is not None else 0)
                # New requests join when a worthwhile number of slots is free (one prefill
                # per join), or when every waiting request fits.
                if waiting and free > 0 and (rows is None or free >= min(len(waiting), self._join_at)):
                    take = [waiting.popleft() for _ in range(min(free, len(waiting)))]
                    new = self._prefill(requests, take)
                    rows = new if rows is None else rows.merge(new)
                assert rows is not None
                tok, lp = sample(rows.logits, rows.temperature, rows.top_k, rows.top_p, rows.seeds, rows.steps)
                keep = []
                for row, (i, t, lpv) in enumerate(zip(rows.idx.tolist(), tok.tolist(), lp.tolist())):
                    tokens[i].append(t)
                    logps[i].append(lpv)
                    params = requests[i].params
                    if t in params.stop_token_ids or len(tokens[i]) >= params.max_new_tokens:
                        reason = "stop" if t in params.stop_token_ids else "length"
                        out[i] = GenerationResult(requests[i].request_id, tokens[i], logps[i], reason, self._version)
                    else:
                        keep.append(row)
                if not keep:
                    rows = None
                    continue
                if len(keep) < len(rows):  # finished rows leave the batch and the cache
                    keep_t = torch.tensor(keep, device=rows.seeds.device)
                    rows.select(keep_t)
                    tok = tok[keep_t]
                rows.decode(self.model, tok)
        return out  # type: ignore[return-value]

    @property
    def _join_at(self) -> int:
        return max(1, self.max_batch_size // 8)

    def _prefill(self, requests: list[GenerationRequest], take: list[int]) -> _Rows:
        reqs = [requests[i] for i in take]
        dev, B = self.device, len(reqs)
        L = max(len(r.prompt_ids) for r in reqs)
        input_ids = torch.full((B, L), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(reqs):
            input_ids[i, L - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attn[i, L - len(r.prompt_ids) :] = 1
        input_ids, attn = input_ids.to(dev), attn.to(dev)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(
            input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
            cache=cache, use_cache=True, logits_to_keep=1,
        ).logits[:, -1]
        return _Rows(
            idx=torch.tensor(take, device=dev), cache=cache, attn=attn, next_pos=attn.sum(-1), logits=logits,
            temperature=torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=dev),
            top_k=torch.tensor([r.params.top_k for r in reqs], dtype=torch.long, device=dev),
            top_p=torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32, device=dev),
            seeds=torch.tensor([r.params.seed for r in reqs], dtype=torch.long, device=dev),
            steps=torch.zeros(B, dtype=torch.long, device=dev),
        )


@dataclass
class _Rows:
    """The running batch: one row per request being decoded, with its KV cache (left-padded
    to a common length), attention mask, next position, next-token logits and sampling
    parameters. Rows leave (`select`) and join (`merge`) between decode steps."""

    idx: torch.Tensor  # request index of each row
    cache: DynamicCache
    attn: torch.Tensor
    next_pos: torch.Tensor
    logits: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor  # tokens generated so far per row: the position of the sampling noise

    _PER_ROW = ("idx", "attn", "next_pos", "logits", "temperature", "top_k", "top_p", "seeds", "steps")

    def __len__(self) -> int:
        return len(self.idx)

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        for name in self._PER_ROW:
            setattr(self, name, getattr(self, name)[keep])

    def decode(self, model, tok: torch.Tensor) -> None:
        """Feed each row's sampled token; the logits become those of the next position."""
        self.attn = torch.cat([self.attn, self.attn.new_ones((len(self), 1))], dim=1)
        self.logits = model(
            input_ids=tok[:, None], attention_mask=self.attn, position_ids=self.next_pos[:, None],
            cache=self.cache, use_cache=True,
        ).logits[:, -1]
        self.next_pos = self.next_pos + 1
        self.steps = self.steps + 1

    def merge(self, new: _Rows) -> _Rows:
        """Append `new` rows: both caches are left-padded to the longer one (masked out)."""
        T = max(self.attn.shape[1], new.attn.shape[1])
        for mine, theirs in zip(self.cache.layers, new.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, T, 2), _left_pad(theirs.keys, T, 2)])
            mine.values = torch.cat([_left_pad(mine.values, T, 2), _left_pad(theirs.values, T, 2)])
        self.attn = torch.cat([_left_pad(self.attn, T, 1), _left_pad(new.attn, T, 1)])
        for name in self._PER_ROW:
            if name != "attn":
                setattr(self, name, torch.cat([getattr(self, name), getattr(new, name)]))
        return self


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)
