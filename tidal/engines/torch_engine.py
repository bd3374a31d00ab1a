"""The built-in torch engine: batched sampling with a KV cache on any HF causal LM.

It is the embedded default and the reference for correctness. Prompts are left-padded
and share one KV cache. Continuous batching: a row that finishes (stop token or its own
max_new_tokens) leaves the batch at once, so the others stop paying for it, and waiting
requests join the running batch (prefilled, then their cache is merged in) as soon as
enough rows have left, so the batch stays full. Sampling noise is a function of
(request seed, position, token), so a request's tokens do not depend on which requests
it shares a batch with (up to float rounding of padded attention).

New weights during generation (the asynchronous loop calls `update_weights` from another
thread while `generate_sync` decodes). With `partial_rollout=True` (the default) the update
lands between two decode steps: each step holds the weights lock shared, an update takes
it exclusive and goes first once it waits, so decoding cannot starve it; the running batch
then continues on the new weights with its KV cache as computed so far. Every token
records the version of the weights whose forward pass gave the logits it was sampled from
(`GenerationResult.token_versions`): the token sampled right after an update still comes
from logits the old weights computed. With `partial_rollout=False` a generate call holds
the lock for its whole length: an update waits for the calls in flight, and calls that
start while it waits wait for it (what vLLM and SGLang do), so each result has one version.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from tidal.engines.sampling import sample
from tidal.types import GenerationRequest, GenerationResult


class EngineClosed(RuntimeError):
    """The engine was closed and serves no more calls."""


class WeightUpdateTimeout(TimeoutError):
    """A weight update waited longer than `update_timeout_s` for generation to make room."""


class TorchEngine:
    def __init__(self, model, pad_token_id: int, max_batch_size: int = 512, *, partial_rollout: bool = True,
                 update_timeout_s: float = 600.0):
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.partial_rollout = partial_rollout
        self.update_timeout_s = update_timeout_s
        self.decode_steps = 0  # sampling steps run so far (all calls): lets a watcher see progress
        self._weights = _WeightsLock()
        self._version = 0
        self._running = threading.Event()
        self._running.set()
        self._closed = False
        self._home: torch.device | None = None  # where the weights live while asleep on the host

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

    def sleep(self) -> None:
        """Give the accelerator memory back while a colocated trainer trains: new generate
        calls wait until `wake_up()`, and on a GPU the weights move to host memory (the KV
        cache lives only inside a generate call). On CPU only the pause remains."""
        self.pause()
        if self.device.type == "cuda" and self._home is None:
            with self._weights.exclusive(self.update_timeout_s, lambda n: WeightUpdateTimeout(
                    f"torch engine: sleep waited {self.update_timeout_s:g} s for {n} generate steps")):
                self._home = self.device
                self.model.to("cpu")
                torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self._home is not None:
            self.model.to(self._home)
            self._home = None
        self.resume()

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
        waits_for = "a decode step" if self.partial_rollout else "generate calls in flight (engine.partial_rollout=false)"
        too_slow = lambda n: WeightUpdateTimeout(
            f"torch engine: update_weights v{version} waited {self.update_timeout_s:g} s for {waits_for} to finish "
            f"({n} holding the weights; is update_weights called from the thread that runs generate?)")
        with self._weights.exclusive(self.update_timeout_s, too_slow), torch.no_grad():
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
        if self.partial_rollout:
            return self._generate(requests, step_lock=self._weights.shared)
        with self._weights.shared():  # the whole call on one version
            return self._generate(requests, step_lock=contextlib.nullcontext)

    def _generate(self, requests: list[GenerationRequest],
                  step_lock: Callable[[], contextlib.AbstractContextManager]) -> list[GenerationResult]:
        """The decode loop; each iteration (join, sample, decode) runs under `step_lock()`."""
        # Shortest prompts first: rows that join together pad little.
        waiting = deque(sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids)))
        tokens: list[list[int]] = [[] for _ in requests]
        logps: list[list[float]] = [[] for _ in requests]
        versions: list[list[int]] = [[] for _ in requests]
        out: list[GenerationResult | None] = [None] * len(requests)
        rows: _Rows | None = None
        with torch.inference_mode():
            while waiting or rows is not None:
                with step_lock():  # weight updates land between iterations, never inside one
                    rows = self._step(requests, waiting, rows, tokens, logps, versions, out)
        return out  # type: ignore[return-value]

    def _step(self, requests, waiting, rows, tokens, logps, versions, out) -> _Rows | None:
        """One iteration: waiting requests join, every row samples a token, finished rows
        leave, the others are decoded. Returns the running batch (None when empty)."""
        free = self.max_batch_size - (len(rows) if rows is not None else 0)
        # New requests join when a worthwhile number of slots is free (one prefill
        # per join), or when every waiting request fits.
        if waiting and free > 0 and (rows is None or free >= min(len(waiting), self._join_at)):
            take = [waiting.popleft() for _ in range(min(free, len(waiting)))]
            new = self._prefill(requests, take)
            rows = new if rows is None else rows.merge(new)
        assert rows is not None
        tok, lp = sample(rows.logits, rows.temperature, rows.top_k, rows.top_p, rows.seeds, rows.steps)
        self.decode_steps += 1
        keep = []
        # A token's version is that of the logits it was sampled from (prefill or last decode).
        for row, (i, t, lpv, v) in enumerate(zip(rows.idx.tolist(), tok.tolist(), lp.tolist(),
                                                 rows.versions.tolist())):
            tokens[i].append(t)
            logps[i].append(lpv)
            versions[i].append(v)
            params = requests[i].params
            if t in params.stop_token_ids or len(tokens[i]) >= params.max_new_tokens:
                reason = "stop" if t in params.stop_token_ids else "length"
                out[i] = GenerationResult(requests[i].request_id, tokens[i], logps[i], reason, max(versions[i]),
                                          token_versions=versions[i])
            else:
                keep.append(row)
        if not keep:
            return None
        if len(keep) < len(rows):  # finished rows leave the batch and the cache
            keep_t = torch.tensor(keep, device=rows.seeds.device)
            rows.select(keep_t)
            tok = tok[keep_t]
        rows.decode(self.model, tok, self._version)
        return rows

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
            versions=torch.full((B,), self._version, dtype=torch.long, device=dev),
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
    versions: torch.Tensor  # weight version that computed each row's `logits`

    _PER_ROW = ("idx", "attn", "next_pos", "logits", "temperature", "top_k", "top_p", "seeds", "steps", "versions")

    def __len__(self) -> int:
        return len(self.idx)

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        for name in self._PER_ROW:
            setattr(self, name, getattr(self, name)[keep])

    def decode(self, model, tok: torch.Tensor, version: int) -> None:
        """Feed each row's sampled token; the logits become those of the next position,
        computed by the weights of `version` (earlier positions keep their cache)."""
        self.attn = torch.cat([self.attn, self.attn.new_ones((len(self), 1))], dim=1)
        self.logits = model(
            input_ids=tok[:, None], attention_mask=self.attn, position_ids=self.next_pos[:, None],
            cache=self.cache, use_cache=True,
        ).logits[:, -1]
        self.next_pos = self.next_pos + 1
        self.steps = self.steps + 1
        self.versions = torch.full_like(self.versions, version)

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


class _WeightsLock:
    """Generation (shared) against weight updates (exclusive), updates first: once an update
    waits, no new holder gets the lock until it is done, so back-to-back decode steps or
    generate calls cannot starve it. Holders in the same thread must not nest."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.holders = 0  # shared holders now
        self.updates_waiting = 0
        self._updating = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._updating and not self.updates_waiting)
            self.holders += 1
        try:
            yield
        finally:
            with self._cond:
                self.holders -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, timeout_s: float, on_timeout: Callable[[int], Exception]) -> Iterator[None]:
        """Wait up to timeout_s for the shared holders to leave, then run the body alone.
        `on_timeout(holders)` builds the error raised when they do not."""
        with self._cond:
            self.updates_waiting += 1
            try:
                if not self._cond.wait_for(lambda: not self._updating and not self.holders, timeout_s):
                    raise on_timeout(self.holders)
                self._updating = True
            finally:
                self.updates_waiting -= 1
                self._cond.notify_all()  # after a timeout, shared holders waiting behind it may go
        try:
            yield
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()
