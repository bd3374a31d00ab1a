"""The built-in torch engine: batched sampling with a KV cache on any HF causal LM.

It is the embedded default and the reference for correctness. Prompts are left-padded
and share one preallocated KV cache; decode steps of Llama-family models run the lean step
of lean_decode.py (other models: their own forward over the same cache). Continuous
batching: a row that finishes (stop token, stop string or its own max_new_tokens) leaves
the batch at once, so the others stop paying for it, and waiting requests join the
running batch (prefilled, then their cache is merged in) as soon as enough rows have
left, so the batch stays full. A prefill takes up to a batch of waiting requests; those
that do not fit yet wait prefilled and join as rows leave. Sampling noise is a
function of (request seed, position, token), so a request's tokens do not depend on which
requests it shares a batch with (up to float rounding of padded attention).

One scheduler per engine. Every `generate` call puts its requests in the engine's queue;
one background thread (started when work arrives, gone when the engine is idle) runs the
decode loop, and queued requests join the running batch between two decode steps. So the
next turn of an episode whose tool just answered joins the requests already decoding
instead of waiting for them or running a second loop that contends with the first; a
call returns when all of its own requests have finished.

New weights during generation (the asynchronous loop calls `update_weights` from another
thread while the engine decodes). With `partial_rollout=True` (the default) the update
lands between two decode steps: each step holds the weights lock shared, an update takes
it exclusive and goes first once it waits, so decoding cannot starve it; the running batch
then continues on the new weights with its KV cache as computed so far. Every token
records the version of the weights whose forward pass gave the logits it was sampled from
(`GenerationResult.token_versions`): the token sampled right after an update still comes
from logits the old weights computed. With `partial_rollout=False` the requests in flight
hold the lock until the last of them finishes: an update waits for them, and requests
queued while it waits start after it (what vLLM and SGLang do), so each result has one
version.

Prefix cache across turns. When a request with a `session_id` (the rollout sets the episode
id) finishes, the KV cache of its prompt and generation is kept, bounded by
`prefix_cache_bytes` (least recently used first out); the session's next request, whose
prompt extends those tokens, prefills only the rest (the environment's answer and the next
generation prompt) on top of it. Rows that join together with different cached lengths
re-feed up to the longest new part of the group, so every row's cache stays one contiguous
run after its left padding. A weight update (and `sleep`) empties it: a kept cache is only
used with the weights that computed it. Without it every turn re-prefills the whole
conversation, which costs more than its decoding once conversations grow.

Images (a vision-language model of the Qwen2-VL family: `TorchEngine(..., vision=Vision)`,
tidal/models/vision.py). A request's prompt holds each image's run of pads already expanded
and `images` one picture per run. The prefill feeds input embeddings: the token embeddings
with each fed image pad replaced by its row of the image's features, which the vision tower
computes once per image id and `FeatureCache` keeps (emptied with the prefix cache on a weight
update or sleep, so a picture seen again after an update is encoded by the new weights); the
model never runs its vision tower itself. Positions are mRoPE [3, rows, fed tokens] from
`Vision.positions` of the whole prompt (the fed part's columns; left padding is masked), and a
row's decode positions continue from its prompt's largest position + 1, which after an image
is less than its token count. A decode token's three components are equal, so decode steps
are 1-D RoPE steps: the lean step runs them (lean_decode.py). The vision special tokens
(`Vision.banned_token_ids`) are outside the policy: their logits are masked (`mask_banned`)
before sampling, so they are never drawn and the log-probs are those of the masked
distribution, as the trainer computes them. A session's next turn reuses its prefix KV only if
its images begin with the ones that prefix saw (image pads are one token id for every picture).

Mixture of experts (a model with top-k routers, e.g. Qwen3-MoE): its routers are tidal's
(tidal/models/moe.py: float32, as the trainer's) and record the experts each decode step
chose; every fed generated token's choice (per layer, top-k) comes back in
`GenerationResult.routed_experts`, for rollout routing replay (docs/moe.md). Prompt tokens
are not recorded (the trainer routes them itself), nor the last sampled token, never fed.

Stop strings (`SamplingParams.stop`) need the tokenizer (`TorchEngine(..., tokenizer=)`):
the row's newest tokens are decoded in a short window after each step
(`stop_strings.py`); the token that completes a stop string ends the request and is kept.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

import torch

from tidal.engines.base import EngineBase
from tidal.engines.lean_decode import KVCache, LeanDecoder, model_decode
from tidal.engines.prefix_cache import FeatureCache, Prefix, PrefixCache
from tidal.engines.sampling import sample
from tidal.engines.stop_strings import StopStringMatcher, check_stop_strings
from tidal.engines.torch_batch import Call, Rows, Seq, Waiting, calls_of, fail_calls, image_ids, shared_prompts
from tidal.engines.torch_prefill import PromptForward
from tidal.engines.weights_lock import WeightsLock
from tidal.models.moe import install_routers, recorded, routing_dtype
from tidal.models.vision import Vision, mask_banned
from tidal.types import GenerationRequest, GenerationResult

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30  # KV kept for sessions' next turns (1 GiB)
# Image features kept by image id (a VLM): Qwen2-VL-7B's 3584-wide bfloat16 features are ~7 KiB
# a token, so 256 MiB holds ~36 images of 1000 tokens, or thousands of the small ones RL tasks use.
DEFAULT_IMAGE_CACHE_BYTES = 1 << 28

# Most generate calls waiting on the scheduler at once, each on its own thread (the default
# executor has min(32, cores + 4) threads: too few for an agent's concurrent turns).
_MAX_WAITING_CALLS = 1024
_SETTLE_QUIET_S = 0.001  # see TorchEngine._settle
_SETTLE_MAX_S = 0.02


class EngineClosed(RuntimeError):
    """The engine was closed and serves no more calls."""


class WeightUpdateTimeout(TimeoutError):
    """A weight update waited longer than `update_timeout_s` for generation to make room."""


class TorchEngine(PromptForward, EngineBase):
    def __init__(self, model, pad_token_id: int, max_batch_size: int = 512, *, partial_rollout: bool = True,
                 update_timeout_s: float = 600.0, tokenizer=None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, lean_decode: bool = True,
                 vision: Vision | None = None, image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES):
        self.model = model.eval()
        # A vision-language model's images, positions and banned tokens (module docstring); None:
        # a text model, whose requests may not carry images.
        self.vision = vision
        self._banned = None if vision is None else torch.tensor(vision.banned_token_ids, dtype=torch.long)
        self.features = FeatureCache(image_cache_bytes)
        self.images_encoded = 0  # images run through the vision tower (a feature-cache hit runs none)
        # Decode steps of Llama-family models run as plain tensor ops (lean_decode.py); other
        # models, and lean_decode=False, run the model's own forward over the same cache.
        # Chosen at the first decode step, on the thread that decodes: its probe run on the
        # caller's thread would give that thread an OpenMP team of its own (docs/engines.md).
        self._lean_wanted = lean_decode
        self._decode_step: Callable | None = None
        # A mixture of experts: routers that record each decode step's experts (module docstring).
        self._routers = install_routers(self.model)
        for r in self._routers:
            r.record = True
        if self._routers:  # generation computes no balancing loss (transformers' would, from its config)
            self.model.config.output_router_logits = False
        self._routing_dtype = routing_dtype(self._routers[0].num_experts) if self._routers else None
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.partial_rollout = partial_rollout
        self.update_timeout_s = update_timeout_s
        self.tokenizer = tokenizer
        self._stops = StopStringMatcher(tokenizer) if tokenizer is not None else None
        self.decode_steps = 0  # sampling steps run so far (all calls): lets a watcher see progress
        self.sampled_tokens = 0  # tokens sampled so far: sampled_tokens / decode_steps is the mean batch
        self.prefill_tokens = 0  # prompt tokens fed through the model (a prefix-cache hit feeds only the rest)
        self.prefixes = PrefixCache(prefix_cache_bytes)
        self._weights = WeightsLock()
        self._version = 0
        self._running = threading.Event()
        self._running.set()
        self._awake = threading.Event()  # cleared while asleep: the scheduler does not decode then
        self._awake.set()
        self._closed = False
        self._home: torch.device | None = None  # where the weights live while asleep on the host
        self._cv = threading.Condition()  # guards the queue and the scheduler thread
        self._queue: deque[Call] = deque()
        self._scheduler: threading.Thread | None = None
        self._callers: concurrent.futures.ThreadPoolExecutor | None = None

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

    can_sleep = True

    def sleep(self) -> None:
        """Give the accelerator memory back while a colocated trainer trains: new generate
        calls wait until `wake_up()`, and on a GPU the weights move to host memory (requests
        in flight stop decoding until then). On CPU only the pause remains."""
        self.pause()
        if self.device.type == "cuda" and self._home is None:
            with self._weights.exclusive(self.update_timeout_s, lambda n: WeightUpdateTimeout(
                    f"torch engine: sleep waited {self.update_timeout_s:g} s for {n} generate steps")):
                self._awake.clear()
                self.prefixes.clear()
                self.features.clear()
                self._home = self.device
                self.model.to("cpu")
                torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self._home is not None:
            self.model.to(self._home)
            self._home = None
            self._awake.set()
        self.resume()

    def close(self) -> None:
        """Stop serving: later calls raise EngineClosed (a replica that was shut down), and so
        do the calls in flight, after the decode step in progress."""
        self._closed = True
        self._running.set()  # wake anything waiting on pause(), so it can fail
        self._awake.set()
        with self._cv:
            self._cv.notify_all()
            if self._scheduler is None:  # nothing runs: fail what is queued here
                self._fail_queued(EngineClosed("torch engine: closed before the call ran"))

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
        waits_for = "a decode step" if self.partial_rollout else "the requests in flight (engine.partial_rollout=false)"
        too_slow = lambda n: WeightUpdateTimeout(
            f"torch engine: update_weights v{version} waited {self.update_timeout_s:g} s for {waits_for} to finish "
            f"({n} holding the weights; is update_weights called from the thread that runs generate?)")
        with self._weights.exclusive(self.update_timeout_s, too_slow), torch.no_grad():
            self.prefixes.clear()  # computed by the old weights
            self.features.clear()
            for name, t in tensors.items():
                params[name].copy_(t)
            self._version = version

    @contextlib.contextmanager
    def peer_weights(self):
        """The parameters as they are, for a new replica to take (tidal/weightsync/peer.py): held
        shared like a decode step, so no update lands while a peer reads them (decoding goes on)."""
        self._check_open("peer_weights")
        with self._weights.shared():
            yield self._version, {n: p.detach() for n, p in self.model.named_parameters()}

    # -- generate ------------------------------------------------------------------------------
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        self._check_open(f"generate ({len(requests)} requests)")
        if not self._running.is_set():
            await asyncio.to_thread(self._running.wait)
        # A thread of the engine's own pool waits for the scheduler, so any number of calls
        # can be in flight at once (and join one batch).
        if self._callers is None:
            self._callers = concurrent.futures.ThreadPoolExecutor(_MAX_WAITING_CALLS, "tidal-torch-call")
        return await asyncio.get_running_loop().run_in_executor(self._callers, self.generate_sync, requests)

    def generate_sync(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        self._check_open(f"generate ({len(requests)} requests)")
        for r in requests:
            self._validate(r)
        if not requests:
            return []
        call = Call(requests)
        with self._cv:
            self._check_open(f"generate ({len(requests)} requests)")
            self._queue.append(call)
            if self._scheduler is None:
                # Not a daemon: at interpreter exit Python joins it (it ends once idle) instead of
                # freezing it inside torch, which can abort the process.
                self._scheduler = threading.Thread(target=self._schedule, name="tidal-torch-engine")
                self._scheduler.start()
            else:
                self._cv.notify_all()
        try:
            return call.future.result()
        except BaseException:
            call.future.cancel()  # interrupted: its rows leave the batch at the next step
            raise

    def _validate(self, r: GenerationRequest) -> None:
        if not r.prompt_ids:
            raise ValueError(f"request {r.request_id} has an empty prompt")
        if r.params.stop:
            check_stop_strings(r.params.stop, f"request {r.request_id}")
            if self._stops is None:
                raise ValueError(f"request {r.request_id} has stop strings {tuple(r.params.stop)!r} but the torch "
                                 "engine has no tokenizer to see text: TorchEngine(..., tokenizer=...) "
                                 "(build_engine passes the model's)")
        if r.images and self.vision is None:
            raise ValueError(f"request {r.request_id} carries {len(r.images)} image(s) but the torch engine's model is "
                             "text-only (TorchEngine was built without `vision`): use a vision-language model "
                             "(Qwen2-VL family; build_engine passes Vision.load(model_dir)) or send no images")
        if self.vision is not None:
            self.vision.check_expanded(r.prompt_ids, r.images, f"request {r.request_id}")

    def _schedule(self) -> None:
        """The scheduler thread: admit queued calls between decode steps, decode, resolve
        each call as its last request finishes; exit once nothing is queued or in flight."""
        waiting = Waiting()
        rows: Rows | None = None
        holding = False  # partial_rollout=False: the lock is held while requests are in flight
        try:
            with torch.inference_mode():
                while True:
                    if self._closed:
                        raise EngineClosed("torch engine: closed with the call in flight")
                    idle = rows is None and waiting.empty
                    if idle and holding:  # nothing in flight: a waiting update may go now
                        self._weights.release_shared()
                        holding = False
                    with self._cv:
                        if idle and not self._queue:
                            self._scheduler = None
                            return
                    if idle and not self.partial_rollout:
                        self._weights.acquire_shared()  # after an update that runs or waits
                        holding = True
                    with self._cv:
                        # Without partial rollouts an update that waits holds new requests back.
                        if self.partial_rollout or not self._weights.updates_waiting:
                            if rows is None and waiting.empty and self._queue:
                                self._settle()
                            while self._queue:
                                waiting.extend(self._queue.popleft().seqs())
                    if rows is None and waiting.empty:
                        continue
                    with self._weights.shared() if self.partial_rollout else contextlib.nullcontext():
                        asleep = not self._awake.is_set()  # sleep() moved the weights: no decoding
                        if not asleep:
                            try:
                                rows = self._step(waiting, rows)
                            except Exception as e:  # noqa: BLE001 - the calls in flight fail; later ones are served
                                fail_calls(calls_of(waiting, rows), e)
                                waiting.clear()
                                rows = None
                    if asleep:
                        self._awake.wait()
        except BaseException as e:  # closed, or the thread itself failed: nobody may wait forever
            err = e if isinstance(e, EngineClosed) else EngineClosed(
                f"torch engine: the scheduler thread failed: {type(e).__name__}: {e}")
            fail_calls(calls_of(waiting, rows), err)
            with self._cv:
                self._scheduler = None
                self._fail_queued(err)
            if not isinstance(e, Exception):
                raise
        finally:
            if holding:
                self._weights.release_shared()

    def _settle(self) -> None:
        """From idle, let a burst of calls finish arriving before the first prefill (holding
        self._cv): a rollout's episodes each send their own call, and those that arrive while
        the first rows decode would join one decode step at a time, a prefill and a cache merge
        each. Waits while calls keep arriving, _SETTLE_QUIET_S apart at most, for _SETTLE_MAX_S
        at most: a lone call waits one quiet interval."""
        deadline = time.monotonic() + _SETTLE_MAX_S
        n = len(self._queue)
        while not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(min(_SETTLE_QUIET_S, left))
            if len(self._queue) == n:
                return
            n = len(self._queue)

    def _fail_queued(self, error: BaseException) -> None:
        """Fail every queued call (holding self._cv)."""
        while self._queue:
            call = self._queue.popleft()
            if not call.future.done():
                call.future.set_exception(error)

    def _step(self, waiting: Waiting, rows: Rows | None) -> Rows | None:
        """One iteration: waiting requests join, every row samples a token, finished rows
        leave, the others are decoded. Returns the running batch (None when empty)."""
        while waiting and waiting[0].call.future.cancelled():
            waiting.popleft()
        free = self.max_batch_size - (len(rows) if rows is not None else 0)
        # A prefill takes up to a batch of waiting requests, shortest prompts first (rows that
        # join together pad little): one prefill of many prompts costs far less per prompt
        # than several small ones. Those beyond the free rows wait prefilled (`waiting.ready`)
        # and join as rows leave, without a prefill each time. A new prefill runs when a
        # worthwhile number of rows is free, or when every waiting request fits.
        if (waiting and waiting.ready is None and free > 0
                and (rows is None or free >= min(len(waiting), self._join_at))):
            take: list[Seq] = []
            while waiting and len(take) < self.max_batch_size:
                s = waiting.popleft()
                if not s.call.future.cancelled():
                    take.append(s)
            take.sort(key=lambda s: len(s.request.prompt_ids))
            if take:
                try:
                    waiting.ready = self._prefill(take)
                except BaseException:  # back in the queue, so the caller fails their calls too
                    waiting.extendleft(reversed(take))
                    raise
        ready = waiting.ready
        if ready is not None and free > 0:
            live = [i for i, s in enumerate(ready.seqs) if not s.call.future.cancelled()]
            if not live:  # their callers are gone
                waiting.ready = None
            else:
                if len(live) < len(ready):
                    ready.select(live)
                new = ready if len(ready) <= free else ready.split(free)
                waiting.ready = None if new is ready else ready
                try:
                    rows = new if rows is None else rows.merge(new)
                except BaseException:  # as for a failed prefill
                    waiting.extendleft(reversed(new.seqs))
                    raise
        if rows is None:
            return None
        logits = rows.logits
        if self._banned is not None:  # the vision special tokens are outside the policy (module docstring)
            if self._banned.device != logits.device:
                self._banned = self._banned.to(logits.device)
            logits = mask_banned(logits, self._banned)
        tok, lp = sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.seeds, rows.steps)
        self.decode_steps += 1
        self.sampled_tokens += len(rows)
        keep = []
        # A token's version is that of the logits it was sampled from (prefill or last decode).
        for row, (seq, t, lpv, v) in enumerate(zip(rows.seqs, tok.tolist(), lp.tolist(), rows.versions.tolist())):
            if seq.call.future.cancelled():
                continue  # its caller is gone: the row leaves
            seq.tokens.append(t)
            seq.logprobs.append(lpv)
            seq.versions.append(v)
            params = seq.request.params
            stop = t in params.stop_token_ids or (bool(params.stop) and self._stops.completes(seq.tokens, params.stop))
            if stop or len(seq.tokens) >= params.max_new_tokens:
                if self.prefixes.max_bytes > 0:  # kept before the caller hears: its next turn finds it
                    self._keep_prefix(rows, row)
                seq.finish("stop" if stop else "length")
            else:
                keep.append(row)
        if not keep:
            return None
        if len(keep) < len(rows):  # finished rows leave the batch and the cache
            tok = tok[rows.select(keep)]
        rows.decode(self._decoder(), tok, self._version)
        if self._routers:  # the experts each row's fed token went to: [layers, rows, k] -> per row
            chosen = recorded(self._routers).permute(1, 0, 2).to("cpu", torch.int16).numpy().astype(self._routing_dtype)
            for seq, experts in zip(rows.seqs, chosen):
                seq.routed.append(experts)
        return rows

    def _decoder(self):
        """The decode step: the lean one where the model supports it (built, and probed, once)."""
        if self._decode_step is None:
            lean = LeanDecoder.build(self.model) if self._lean_wanted else None
            self._decode_step = lean or self._model_decode
        return self._decode_step

    @property
    def lean(self) -> bool | None:
        """Whether decode steps run the lean step (None: no step has run yet)."""
        return None if self._decode_step is None else self._decode_step != self._model_decode

    def _model_decode(self, tok: torch.Tensor, pos: torch.Tensor, kv: KVCache) -> torch.Tensor:
        return model_decode(self.model, tok, pos, kv)

    @property
    def _join_at(self) -> int:
        return max(1, self.max_batch_size // 8)

    def _keep_prefix(self, rows: Rows, row: int) -> None:
        """Keep a finished row's KV cache (prompt + generation but its last token, which was
        never fed) for its session's next request, if all of it came from today's weights."""
        seq = rows.seqs[row]
        req = seq.request
        if not req.session_id or any(v != self._version for v in seq.versions):
            return
        tokens = list(req.prompt_ids) + seq.tokens[:-1]
        n = int(rows.cache.attn[row].sum())
        if n != len(tokens):  # never expected: the row's cache is its tokens after its left padding
            return
        # Every image run lies in the prompt (image pads are never sampled): all of its images.
        self.prefixes.put(req.session_id, Prefix(tokens, *rows.cache.row(row, n), images=image_ids(req)))

    def _prefill(self, seqs: list[Seq]) -> Rows:
        """Prefill joining requests; those that found their session's cache apart from the
        others (a cold row in their group would make them all re-feed its whole prompt)."""
        found = [self.prefixes.take(s.request.session_id, s.request.prompt_ids, image_ids(s.request)) for s in seqs]
        cold = [s for s, h in zip(seqs, found) if h is None]
        warm = [(s, h) for s, h in zip(seqs, found) if h is not None]
        rows = self._prefill_group(cold, [None] * len(cold)) if cold else None
        if warm:
            new = self._prefill_group([s for s, _ in warm], [h for _, h in warm])
            rows = new if rows is None else rows.merge(new)
        return rows

    def _prefill_group(self, seqs: list[Seq], hits: list[Prefix | None]) -> Rows:
        reqs = [s.request for s in seqs]
        dev = self.device
        # Requests with the same prompt (a GRPO group's samples) are computed once: the
        # prompt's keys, values and next-token logits are the same for each of them.
        index, computed = None, reqs
        if all(h is None for h in hits):
            distinct, same = shared_prompts(reqs)
            if len(distinct) < len(reqs):
                computed, hits = distinct, [None] * len(distinct)
                index = torch.tensor(same, dtype=torch.long, device=dev)  # each request's row among them
        cache, attn, next_pos, logits = self._forward_prompts(computed, hits)
        if index is not None:
            attn, next_pos, logits = attn[index], next_pos[index], logits[index]
        # Room for the longest budget (up to 256 tokens; beyond, the cache doubles when full).
        reserve = min(max(r.params.max_new_tokens for r in reqs), 256)
        B = len(reqs)
        return Rows(
            seqs=list(seqs), cache=KVCache.from_dynamic(cache, attn, reserve, rows=index), next_pos=next_pos,
            logits=logits,
            temperature=torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=dev),
            top_k=torch.tensor([r.params.top_k for r in reqs], dtype=torch.long, device=dev),
            top_p=torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32, device=dev),
            seeds=torch.tensor([r.params.seed for r in reqs], dtype=torch.long, device=dev),
            steps=torch.zeros(B, dtype=torch.long, device=dev),
            versions=torch.full((B,), self._version, dtype=torch.long, device=dev),
        )
