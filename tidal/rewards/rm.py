"""A Hugging Face sequence-classification reward model, served with dynamic batching.

`RewardModelPool` owns one model and one worker thread. Callers (`await pool.score(texts)`
from any event loop, or `pool.score_sync(texts)` from any thread) put their texts on one
queue; the worker takes the oldest, waits at most `max_wait_ms` for more, up to
`max_batch_size` texts, runs them through the model in one forward pass and hands every
caller its own scores in order. The choice: a thread and `concurrent.futures` rather
than an asyncio task, so one pool serves the FastAPI server, a reward worker's event loop,
a Ray actor and plain threads alike, and the forward pass never blocks an event loop.
One pool is one replica; more throughput is more pools (processes, actors or servers).

`RewardModelReward` is the reward function of a task (tidal's per-sample form): it scores
the prompt as the policy saw it followed by the completion, and loads its pool lazily in
whatever process calls it first (a reward worker process, a Ray actor, the driver).
`RewardModelActor` is the same pool as a Ray actor with resources of its own.

The score of a text is the classifier's logit at its last token (right padding; a text
longer than the model's window keeps its end: truncation from the left, counted).
"""

from __future__ import annotations

import asyncio
import json
import math
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any, Literal, Self

import torch

from tidal.models import DTYPES
from tidal.rewards.pool_ray import named_actor

Transform = Literal["raw", "sigmoid", "standard"]
META_FILE = "tidal_rm.json"  # written by `tidal train-rm`: history, held-out accuracy, score statistics


class RewardModelError(RuntimeError):
    pass


def load_reward_model(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) of an HF sequence-classification directory with one label."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging


    p = Path(path)
    if not (p / "config.json").is_file():
        raise RewardModelError(f"reward model `{path}` is not a Hugging Face model directory (no config.json)")
    if dtype not in DTYPES:
        raise RewardModelError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(p))
    model = AutoModelForSequenceClassification.from_pretrained(str(p), dtype=DTYPES[dtype])
    if model.config.num_labels != 1:
        raise RewardModelError(f"reward model `{path}` has num_labels={model.config.num_labels}; a reward model has 1")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        # The classifier reads the last token that is not padding: it must know the pad id.
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model.to(device), tokenizer


def encode(tokenizer, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Right-padded (input_ids, attention_mask) of `texts`, each cut to its last `max_length`
    tokens; also how many were cut. Shared by scoring and `tidal train-rm`, so the model is
    trained on exactly the token sequences it is later asked to score."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    cut = sum(len(r) > max_length for r in rows)
    rows = [r[-max_length:] if r else [tokenizer.pad_token_id] for r in rows]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    return ids, attn, cut


def render(tokenizer, completion: str, prompt: str | None = None, prompt_messages: list | None = None) -> str:
    """The text a reward model scores: the prompt as the policy saw it (rendered by the
    chat template, special tokens included), then the completion."""
    if prompt is None and prompt_messages:
        prompt = tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=False)
    if prompt is None:
        raise ValueError("a reward model scores prompt + completion: it needs `prompt` (the rendered prompt) "
                         "or `prompt_messages`, and got neither")
    return prompt + completion


class _Item:
    __slots__ = ("future", "text")

    def __init__(self, text: str):
        self.text = text
        self.future: Future = Future()


_STOP = object()


class RewardModelPool:
    """One reward model behind a dynamic batcher (see the module docstring).

    max_batch_size: most texts in one forward pass. max_wait_ms: how long the worker waits
    for more texts after the first one of a batch arrived (0: take what is queued now).
    max_length: longest input in tokens (default: the model's max_position_embeddings).
    threads: torch intra-op threads of the process (None: leave as it is)."""

    def __init__(self, path: str | Path, max_batch_size: int = 32, max_wait_ms: float = 5.0, device: str = "cpu",
                 dtype: str = "float32", max_length: int | None = None, threads: int | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if threads:
            torch.set_num_threads(threads)
        self.path = str(path)
        self.max_batch_size, self.max_wait_s = max_batch_size, max_wait_ms / 1000.0
        self.device = device
        self.model, self.tokenizer = load_reward_model(path, dtype, device)
        self.max_length = max_length or int(getattr(self.model.config, "max_position_embeddings", 4096))
        meta = Path(path) / META_FILE
        self.meta: dict[str, Any] = json.loads(meta.read_text()) if meta.is_file() else {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._model_lock = threading.Lock()  # the worker and `forward` callers share one model
        self._stats_lock = threading.Lock()
        self.histogram: Counter[int] = Counter()  # texts per forward pass -> number of passes
        self.texts = self.requests = self.truncated = 0
        self.forward_s = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"reward-model {Path(path).name}", daemon=True)
        self._thread.start()

    # -- scoring ----------------------------------------------------------------------------
    def forward(self, texts: list[str]) -> list[float]:
        """Scores of `texts` in one forward pass, in the caller's thread (no batching)."""
        ids, attn, cut = encode(self.tokenizer, texts, self.max_length)
        t0 = time.perf_counter()
        with self._model_lock, torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits
        scores = logits[:, 0].float().cpu().tolist()
        with self._stats_lock:
            self.histogram[len(texts)] += 1
            self.truncated += cut
            self.forward_s += time.perf_counter() - t0
        return scores

    def submit(self, texts: list[str]) -> list[Future]:
        """Queue `texts`; one future per text, resolved by the worker."""
        if self._closed:
            raise RewardModelError(f"reward model pool `{self.path}` is closed")
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("score() takes a list of strings")
        items = [_Item(t) for t in texts]
        with self._stats_lock:
            self.requests += 1
            self.texts += len(items)
        for it in items:
            self._queue.put(it)
        return [it.future for it in items]

    async def score(self, texts: list[str]) -> list[float]:
        """Scores of `texts`, in order; concurrent calls share forward passes."""
        if not texts:
            return []
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in self.submit(texts))))

    def score_sync(self, texts: list[str], timeout_s: float | None = None) -> list[float]:
        """`score` for a thread without an event loop."""
        futures = self.submit(texts)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return [f.result(None if deadline is None else max(0.0, deadline - time.monotonic())) for f in futures]

    def render(self, completion: str, prompt: str | None = None, prompt_messages: list | None = None) -> str:
        return render(self.tokenizer, completion, prompt, prompt_messages)

    # -- the worker ---------------------------------------------------------------------------
    def _next_batch(self) -> list[_Item] | None:
        first = self._queue.get()
        if first is _STOP:
            return None
        batch = [first]
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                self._queue.put(_STOP)  # finish this batch, stop at the next
                break
            batch.append(item)
        # A caller that gave up (cancelled) is dropped before the forward pass.
        return [it for it in batch if it.future.set_running_or_notify_cancel()]

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            if not batch:
                continue
            try:
                scores = self.forward([it.text for it in batch])
            except Exception as e:  # noqa: BLE001 - every caller of the batch gets the failure, named
                err = RewardModelError(f"reward model `{self.path}` failed on a batch of {len(batch)}: "
                                       f"{type(e).__name__}: {e}")
                for it in batch:
                    _resolve(it.future, exception=err)
                continue
            for it, s in zip(batch, scores):
                _resolve(it.future, result=s)
        # Closed: whatever is still queued fails instead of waiting forever.
        while True:
            try:
                it = self._queue.get_nowait()
            except queue.Empty:
                break
            if it is not _STOP and it.future.set_running_or_notify_cancel():
                _resolve(it.future, exception=RewardModelError(f"reward model pool `{self.path}` was closed"))

    # -- bookkeeping --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            passes = sum(self.histogram.values())
            scored = sum(k * v for k, v in self.histogram.items())
            return {"requests": self.requests, "texts": self.texts, "forward_passes": passes,
                    "mean_batch_size": scored / passes if passes else 0.0,
                    "batch_size_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
                    "truncated": self.truncated, "forward_s": round(self.forward_s, 4)}

    def reset_stats(self) -> None:
        with self._stats_lock:
            self.histogram.clear()
            self.texts = self.requests = self.truncated = 0
            self.forward_s = 0.0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout=30)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _resolve(f: Future, result: Any = None, exception: BaseException | None = None) -> None:
    try:
        if exception is not None:
            f.set_exception(exception)
        else:
            f.set_result(result)
    except InvalidStateError:  # cancelled by its caller meanwhile
        pass


def transform_scores(scores: list[float], transform: Transform, meta: dict[str, Any]) -> list[float]:
    """raw: the logit; sigmoid: σ(logit) in (0, 1), the Bradley–Terry probability of beating
    a text scored 0; standard: (logit − mean) / std with the mean and std of the model's
    scores on its held-out pairs (from tidal_rm.json)."""
    if transform == "raw":
        return scores
    if transform == "sigmoid":
        return [1.0 / (1.0 + math.exp(-s)) if s >= 0 else math.exp(s) / (1.0 + math.exp(s)) for s in scores]
    if transform == "standard":
        st = meta.get("score_stats")
        if not st:
            raise RewardModelError(f"transform 'standard' needs `score_stats` in {META_FILE} (written by tidal train-rm)")
        return [(s - st["mean"]) / st["std"] for s in scores]
    raise ValueError(f"transform must be raw, sigmoid or standard, got {transform!r}")


class RewardModelReward:
    """A reward model as a task reward (tidal's per-sample async form):

        task.rewards: [{fn: tidal.rewards.rm:RewardModelReward, args: {path: runs/rm/model}}]

    `await fn(completion, prompt=..., prompt_messages=...)` returns `{part: score}` where
    the text scored is `prompt + completion` (prompt rendered by the chat template when
    only `prompt_messages` is given). `transform`: raw (the logit, default), sigmoid, or
    standard (see `transform_scores`). The pool is built on the first call, in that
    process; concurrent calls of one process share forward passes; `threads`: torch threads
    of that process (None: leave them as they are). `actor`: the name of a
    `RewardModelActor` (a Ray actor) to score with instead of a pool of this process's own.
    """

    def __init__(self, path: str, max_batch_size: int = 32, max_wait_ms: float = 5.0, device: str = "cpu",
                 dtype: str = "float32", transform: Transform = "raw", part: str = "rm", actor: str | None = None,
                 actor_namespace: str | None = None, max_length: int | None = None, threads: int | None = None):
        if transform not in ("raw", "sigmoid", "standard"):
            raise ValueError(f"RewardModelReward: transform must be raw, sigmoid or standard, got {transform!r}")
        if actor is None and not (Path(path) / "config.json").is_file():
            raise ValueError(f"RewardModelReward: `{path}` is not a reward model directory (no config.json); "
                             "build one with `tidal train-rm --out DIR`")
        self.path, self.transform, self.part = str(path), transform, part
        self.actor, self.actor_namespace = actor, actor_namespace
        self.pool_args = {"max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms, "device": device,
                          "dtype": dtype, "max_length": max_length, "threads": threads}
        self.__tidal_name__ = f"RewardModelReward({self.path})"
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._pool: RewardModelPool | None = None
        self._handle = None
        self._tokenizer = None
        self._meta: dict[str, Any] = {}
        self._lock = threading.Lock()

    _RUNTIME = ("_pool", "_handle", "_tokenizer", "_meta", "_lock")

    def __getstate__(self) -> dict[str, Any]:  # crosses processes without its model
        return {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def _ensure(self) -> None:
        with self._lock:
            if self._pool is not None or self._handle is not None:
                return
            if self.actor is None:
                self._pool = RewardModelPool(self.path, **self.pool_args)
                self._tokenizer, self._meta = self._pool.tokenizer, self._pool.meta
                return
            from transformers import AutoTokenizer

            self._handle = named_actor(self.actor, namespace=self.actor_namespace)
            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            meta = Path(self.path) / META_FILE
            self._meta = json.loads(meta.read_text()) if meta.is_file() else {}

    @property
    def pool(self) -> RewardModelPool | None:
        return self._pool

    async def __call__(self, completion: str, prompt: str | None = None, prompt_messages: list | None = None,
                       **columns) -> dict[str, float]:
        if self._tokenizer is None:
            await asyncio.to_thread(self._ensure)  # loading does not block the caller's event loop
        text = render(self._tokenizer, completion, prompt, prompt_messages)
        if self._pool is not None:
            scores = await self._pool.score([text])
        else:
            scores = await self._handle.score.remote([text])
        return {self.part: transform_scores(scores, self.transform, self._meta)[0]}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


class RewardModelActor:
    """The pool as a Ray actor: `ray.remote(RewardModelActor).options(num_cpus=..., num_gpus=...,
    name=..., max_concurrency=...)`. Its methods are async, so Ray runs them on the actor's
    event loop, concurrently, and concurrent calls share forward passes."""

    def __init__(self, path: str, max_batch_size: int = 32, max_wait_ms: float = 5.0, device: str = "cpu",
                 dtype: str = "float32", max_length: int | None = None, num_cpus: float = 0.0):
        if num_cpus:
            torch.set_num_threads(max(1, round(num_cpus)))  # the cores it reserved, not the node's
        self.pool = RewardModelPool(path, max_batch_size, max_wait_ms, device, dtype, max_length)

    async def score(self, texts: list[str]) -> list[float]:
        return await self.pool.score(texts)

    async def stats(self) -> dict[str, Any]:
        return self.pool.stats()

    async def ready(self) -> bool:
        return True
