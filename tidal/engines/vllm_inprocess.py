"""vLLM's synchronous `LLMEngine` in tidal's process, owned by one worker thread: the
`in_process` mode of tidal/engines/vllm_engine.py (whose docstring says why this shape).

`generate` hands requests to the thread, which keeps stepping the engine while any are
unfinished (continuous batching across concurrent calls) and resolves each request's future
when it finishes; weight loads and vLLM's worker calls (`transfer`) run on the same thread
between steps. At `tensor_parallel_size` > 1 only the engine core is here; vLLM's workers
are child processes.

Partial rollout (`partial`, engine.partial_rollout): because an update runs between two engine
steps on this thread, requests in flight need not wait for it. Right after new weights are in,
each unfinished request's count of sampled tokens is recorded with the new version, and the
prefix cache is reset with `reset_running_requests=True`: vLLM preempts the running requests
and recomputes their KV (prompt and tokens so far) with the new weights before they sample on.
So every token after the switch comes from the new weights over a cache they computed, and each
result carries the version of every token (`token_versions`). vLLM's own `pause(mode="keep")`
is AsyncLLM's (engine core in a child process); tidal drives the synchronous LLMEngine and needs
no pause. Measured here: seeded and unseeded requests continue after the preemption; with the
running requests' old KV kept instead (no preemption), the tokens after the switch differ from
what the new weights give over the same text (tests/test_vllm_shard.py fails).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import random
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tidal.engines.vllm_requests import Completion, VLLMEngineError, completion, vllm_prompt, vllm_sampling_fields
from tidal.types import GenerationRequest

if TYPE_CHECKING:
    from tidal.models.vision import Vision

log = logging.getLogger("tidal")


class InProcessVLLM:
    """vLLM's LLMEngine in this process, owned by one worker thread."""

    def __init__(self, model_dir: Path, engine_args: dict[str, Any], env: dict[str, str], multimodal: bool = False):
        self.multimodal = multimodal
        os.environ.update(env)  # read by vLLM at import and start
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines would bury tidal's progress
        # vLLM's CPU worker sets torch to 1 thread for serving and replaces torch.set_num_threads
        # with a stub; in this process the trainer shares torch, so both are put back.
        # It also seeds the global RNGs (random, numpy, torch) with the engine seed; they are
        # restored, so the trainer's random state does not depend on the engine kind.
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        rng = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        try:
            from vllm import LLM

            self.llm = LLM(model=str(model_dir), **engine_args)
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            random.setstate(rng[0])
            np.random.set_state(rng[1])
            torch.random.set_rng_state(rng[2])
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self._inbox: collections.deque = collections.deque()  # callables run by the worker thread
        self._cv = threading.Condition()
        self._futures: dict[str, concurrent.futures.Future] = {}  # vLLM request id → result (worker thread only)
        self.partial = False  # partial rollout: updates land between steps, requests in flight go on (docstring)
        self.loaded_version = 0  # the weights' version now (worker thread)
        self._internal: dict[str, str] = {}  # request id → vLLM's internal id (its output state's key)
        self._born: dict[str, int] = {}  # request id → the version its first token is sampled with
        self._switches: dict[str, list[tuple[int, int]]] = {}  # request id → (tokens sampled before, new version)
        self._ids = itertools.count()
        self._stop = False
        self._error: BaseException | None = None
        self._threads = threads
        self._thread = threading.Thread(target=self._loop, name="tidal-vllm", daemon=True)
        self._thread.start()

    def describe(self) -> str:
        tp = self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
        return "in-process" if tp == 1 else f"in-process, TP {tp}: one worker process per rank"

    def dead(self) -> str:
        if self._error is not None:
            return f"Its worker thread failed: {type(self._error).__name__}: {self._error}"
        return "" if self._thread.is_alive() else "Its worker thread has stopped."

    def _loop(self) -> None:
        engine = self.llm.llm_engine
        # OpenMP's thread count is per thread. torch sets this thread's on its first parallel op
        # (to the last torch.set_num_threads of any thread); vLLM's CPU attention builds its
        # schedule with the count at build time and refuses a kernel run with another
        # ("Check failed: input->metadata->thread_num == thread_num"). Measured: with the caller at
        # 1 thread, the first step built its schedule for 2 (OpenMP's default) and ran on 1.
        # get_num_threads does torch's one-time set-up now; then the count is fixed here.
        torch.get_num_threads()
        torch.set_num_threads(self._threads)
        try:
            while True:
                with self._cv:
                    while not self._inbox and not self._futures and not self._stop:
                        self._cv.wait()
                    if self._stop:
                        break
                    work, self._inbox = self._inbox, collections.deque()
                for fn in work:
                    fn()
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            fut = self._futures.pop(out.request_id, None)
                            if fut is not None and not fut.done():
                                fut.set_result(out)
                elif self._futures:  # never expected; without it this loop would spin
                    lost = VLLMEngineError(f"vLLM dropped {len(self._futures)} requests without finishing them "
                                           f"(first {next(iter(self._futures))})")
                    for fut in self._futures.values():
                        fut.set_exception(lost)
                    self._futures.clear()
        except BaseException as e:  # every waiting caller learns of it
            self._error = e
            log.exception("vLLM in-process worker thread failed")
        finally:
            err = VLLMEngineError(self.dead() or "the engine was closed")
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(err)
            self._futures.clear()
            with self._cv:
                pending, self._inbox = self._inbox, collections.deque()
            for fn in pending:  # each queued call fails its own future
                fn(err)

    def _run(self, fn) -> concurrent.futures.Future:
        """Run fn() on the worker thread; its return value or exception lands in the future.
        If the thread is gone before it runs, fn is called with the error instead."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def call(err: BaseException | None = None) -> None:
            if err is not None:
                fut.set_exception(err)
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001
                fut.set_exception(e)

        with self._cv:
            if self._stop or not self._thread.is_alive():
                call(VLLMEngineError(self.dead() or "the engine was closed"))
                return fut
            self._inbox.append(call)
            self._cv.notify()
        return fut

    async def generate(self, requests: list[GenerationRequest], timeout_s: float, vision: Vision | None = None,
                       banned: tuple[str, ...] = ()) -> list[Completion]:
        from vllm import SamplingParams as VParams
        from vllm.sampling_params import RequestOutputKind

        prompts = [vllm_prompt(r, vision) for r in requests]
        # Text only where stop strings need it (vLLM matches them in its detokenizer).
        params = [VParams(**vllm_sampling_fields(r.params, banned), detokenize=bool(r.params.stop),
                          output_kind=RequestOutputKind.FINAL_ONLY) for r in requests]
        results = [concurrent.futures.Future() for _ in requests]
        ids: list[str] = []

        def add() -> None:
            engine = self.llm.llm_engine
            try:
                for r, prompt, p, fut in zip(requests, engine.renderer.render_cmpl(prompts), params, results):
                    rid = f"{next(self._ids)}:{r.request_id}"  # unique even if a caller reuses a request id
                    self._internal[rid] = engine.add_request(rid, prompt, p)
                    self._born[rid] = self.loaded_version
                    ids.append(rid)
                    self._futures[rid] = fut
            except BaseException:
                self._abort(ids)  # all of the call's requests or none
                raise

        await asyncio.wrap_future(self._run(add))
        try:
            outs = await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in results)), timeout_s)
        except BaseException:
            if ids:  # timed out or cancelled: the engine drops the requests
                self._run(lambda: self._abort(ids))
            raise
        parsed = []
        for r, out, rid in zip(requests, outs, ids):
            c = out.outputs[0]
            lps = c.logprobs  # per token {token id: Logprob}; the sampled token's own, when one per token
            if lps is not None and len(lps) == len(c.token_ids):
                lps = [d[t].logprob for d, t in zip(lps, c.token_ids)]
            toks, lps, reason = completion(r, c.token_ids, lps, c.finish_reason, vision, out.prompt_token_ids)
            versions = token_versions(len(toks), self._born.pop(rid), self._switches.pop(rid, []))
            self._internal.pop(rid, None)
            parsed.append((toks, lps, reason, versions))
        return parsed

    def _abort(self, ids: list[str]) -> None:
        for i in ids:
            self._futures.pop(i, None)
            self._internal.pop(i, None)
            self._born.pop(i, None)
            self._switches.pop(i, None)
        self.llm.llm_engine.abort_request(ids)

    def _after_update(self, version: int | None) -> None:
        """On the worker thread, new weights just in: no cache computed by the old ones is reused
        (with partial rollout the running requests' own KV included: they are preempted and
        recomputed, each request's switch recorded), and the loaded version moves on."""
        engine = self.llm.llm_engine
        if self.partial and version is not None:
            states = engine.output_processor.request_states
            for rid in self._futures:
                state = states.get(self._internal.get(rid, ""))
                if state is not None:
                    self._switches.setdefault(rid, []).append((state.detokenizer.num_output_tokens(), version))
        if not engine.reset_prefix_cache(reset_running_requests=self.partial and bool(self._futures)):
            log.warning("vLLM kept its prefix cache after a weight update: blocks were in use")
        if self.multimodal:  # image embeddings of the old vision tower ("Encoder cache miss" otherwise)
            engine.reset_encoder_cache()
        if version is not None:
            self.loaded_version = version

    def tokens_in_flight(self) -> dict[str, int]:
        """Tokens sampled so far by each unfinished request (request id → count), read between two
        steps: what a partial-rollout update would record now."""
        def count() -> dict[str, int]:
            states = self.llm.llm_engine.output_processor.request_states
            return {rid.split(":", 1)[1]: states[self._internal[rid]].detokenizer.num_output_tokens()
                    for rid in self._futures if self._internal.get(rid) in states}
        return self._run(count).result(60)

    def load_weights(self, named: dict[str, torch.Tensor], timeout_s: float, version: int | None = None) -> None:
        weights = [(k, v.detach()) for k, v in named.items()]

        def load() -> None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self._after_update(version)

        try:
            self._run(load).result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise VLLMEngineError(f"reload_weights did not finish within {timeout_s:g} s") from None

    def transfer(self, calls: list[tuple[str, dict]], timeout_s: float) -> list:
        """Run worker methods in order through collective_rpc on the worker thread; the last
        one's per-rank results, after a prefix-cache reset. Each call is bounded: the workers'
        own timeouts (the slice group's) fire first and name what they waited for."""
        def run() -> list:
            out: list = []
            for method, kwargs in calls:
                out = self.llm.collective_rpc(method, timeout=timeout_s + 30, kwargs=kwargs)
            if calls[-1][0] == "tidal_sync_report":  # a receive: the ranks report the version they took
                versions = {r.get("version") for r in out}
                self._after_update(versions.pop() if len(versions) == 1 else None)
            return out

        try:
            return self._run(run).result(len(calls) * (timeout_s + 60))
        except concurrent.futures.TimeoutError:
            raise VLLMEngineError(f"{calls[-1][0]} did not finish within {timeout_s:g} s") from None

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        try:  # closing is best effort; the second call frees vLLM's process-wide state so that
            # another in-process engine can start later
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            self.llm.llm_engine.engine_core.shutdown()
            cleanup_dist_env_and_memory()
        except Exception as e:  # noqa: BLE001
            log.debug("closing the in-process vLLM engine: %s", e)


def token_versions(n: int, born: int, switches: list[tuple[int, int]]) -> list[int]:
    """Each of a request's `n` tokens' weight version: `born` until the first switch, then each
    switch's version from the count of tokens sampled before it on."""
    out = [born] * n
    for before, version in switches:
        out[before:] = [version] * (n - min(before, n))
    return out
