"""The built-in torch engine: batched sampling with a KV cache on any HF causal LM.

It is the embedded default and the reference for correctness. Prompts of a batch are
left-padded and share one KV cache; a row that finishes (stop token or its own
max_new_tokens) leaves the batch at once, so the remaining rows stop paying for it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Mapping

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
        # Similar prompt lengths batch together: less padding.
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        out: list[GenerationResult | None] = [None] * len(requests)
        for start in range(0, len(order), self.max_batch_size):
            idx = order[start : start + self.max_batch_size]
            for i, res in zip(idx, self._generate_batch([requests[i] for i in idx])):
                out[i] = res
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def _generate_batch(self, reqs: list[GenerationRequest]) -> list[GenerationResult]:
        dev, B = self.device, len(reqs)
        L = max(len(r.prompt_ids) for r in reqs)
        input_ids = torch.full((B, L), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(reqs):
            if not r.prompt_ids:
                raise ValueError(f"request {r.request_id} has an empty prompt")
            input_ids[i, L - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attn[i, L - len(r.prompt_ids) :] = 1
        input_ids, attn = input_ids.to(dev), attn.to(dev)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        temperature = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=dev)
        top_k = torch.tensor([r.params.top_k for r in reqs], dtype=torch.long, device=dev)
        top_p = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32, device=dev)
        seeds = torch.tensor([r.params.seed for r in reqs], dtype=torch.long, device=dev)
        stops = [set(r.params.stop_token_ids) for r in reqs]
        max_new = [r.params.max_new_tokens for r in reqs]

        cache = DynamicCache()
        logits = self.model(
            input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
            cache=cache, use_cache=True, logits_to_keep=1,
        ).logits[:, -1]
        next_pos = attn.sum(-1)
        active = torch.arange(B, device=dev)  # which request each cache row belongs to
        tokens: list[list[int]] = [[] for _ in reqs]
        logps: list[list[float]] = [[] for _ in reqs]
        finish = ["length"] * B
        step = 0
        while True:
            tok, lp = sample(logits, temperature[active], top_k[active], top_p[active], seeds[active],
                             torch.full_like(active, step))
            keep = []
            for row, (i, t, l) in enumerate(zip(active.tolist(), tok.tolist(), lp.tolist())):
                tokens[i].append(t)
                logps[i].append(l)
                if t in stops[i]:
                    finish[i] = "stop"
                elif len(tokens[i]) < max_new[i]:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):  # finished rows leave the batch and the cache
                keep_t = torch.tensor(keep, device=dev)
                cache.batch_select_indices(keep_t)
                active, attn, next_pos, tok = active[keep_t], attn[keep_t], next_pos[keep_t], tok[keep_t]
            attn = torch.cat([attn, attn.new_ones((len(active), 1))], dim=1)
            logits = self.model(
                input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                cache=cache, use_cache=True,
            ).logits[:, -1]
            next_pos = next_pos + 1
            step += 1
        return [
            GenerationResult(r.request_id, tokens[i], logps[i], finish[i], self._version)
            for i, r in enumerate(reqs)
        ]
