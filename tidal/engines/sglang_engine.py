"""SGLang as a tidal rollout engine, through a supervised SGLang HTTP server.

**UNTESTED: no GPU was lent to the session that wrote it.** SGLang has no CPU kernels on
PyPI, so this engine has never run. It is written against sglang 0.5.23's server API, read
from its source: `sglang/srt/entrypoints/http_server.py` (routes `/health`, `/generate`,
`/update_weights_from_disk`, `/flush_cache`, `/abort_request`),
`sglang/srt/managers/io_struct.py` (`GenerateReqInput`, `UpdateWeightFromDiskReqInput`,
`AbortReq`), `sglang/api/v1/api_types.py` (the JSON contract `/generate` checks: unknown
sampling keys are refused), `sglang/srt/sampling/sampling_params.py`,
`sglang/srt/managers/tokenizer_manager.py` (the answer's `output_ids` and `meta_info`),
`sglang/srt/managers/schedule_batch.py` (finish reasons, stop tokens),
`sglang/srt/layers/sampler.py` and `sampling/sampling_batch_info.py` (log-probs, seeds),
`sglang/srt/arg_groups/fields/*.py` (server flags). docs/engines.md lists what a GPU
session must check (tests/test_sglang_engine.py, marked `gpu`, does it).

The server: `python -m sglang.launch_server` bound to 127.0.0.1 on a free port, in its own process group, health-checked at start, killed with its group on
close and at interpreter exit (the helpers of the vLLM server mode). One `generate` call is
one `POST /generate` with a batch: `input_ids` (one token-id list per request),
`sampling_params` (one dict each), `return_logprob: true`. Weights: tidal writes
`model.safetensors` (+ the model's config.json) into one fixed folder, then
`POST /update_weights_from_disk` and `POST /flush_cache`.

Log-probs (sampler.py, `Sampler.forward`): for sampled requests SGLang divides the logits by
the temperature and returns the log-softmax of that, computed before top-k/top-p — tidal's
convention, untruncated. Greedy requests (temperature 0 becomes temperature 1, top_k 1 in
SamplingParams.__post_init__) get log softmax(logits), T = 1, as tidal defines them. The
environment variable SGLANG_RETURN_ORIGINAL_LOGPROB would switch to raw log softmax(logits)
ignoring the temperature, which cannot be corrected per token afterwards (it needs
logsumexp(logits / T), i.e. the whole distribution), so the child's environment pins it off.

Seeds: SGLang applies a request's `sampling_seed` only with `--enable-deterministic-inference`
(sampling_batch_info.py builds the seed tensor only then; it also switches sampling to the
pytorch backend, since flashinfer's top-k/top-p kernel refuses seeds). tidal passes it.

Stop tokens: SGLang ends a request at its `stop_token_ids` *and* at the model's EOS ids
(config.json and generation_config.json), and `ignore_eos` switches off both
(`Req._check_token_based_finish`). tidal's contract is "only the request's own stop
tokens": when they include the model's EOS ids, they are sent as they are; otherwise the
request runs with `ignore_eos` and tidal cuts the answer at the first of its stop tokens.

Stop strings (`SamplingParams.stop`) go as SGLang's `stop`. SGLang matches them in its
scheduler by decoding the request's last tokens (`Req._check_str_based_finish`, a window
of the longest stop string's token count + 1), which needs its tokenizer: with
`--skip-tokenizer-init` it refuses any request with `stop` (`raise_if_tokenizer_required`
in sampling_params.py), so the server starts with its tokenizer (input ids still go in as
ids; the answer then carries `text` too, unused). `output_ids` run through the token that
completed the string (`Req.output_ids_through_stop`; only the text is trimmed), and
`finish_reason` is `{"type": "stop", "matched": "<the string>"}`. One difference from the
torch engine and vLLM: SGLang decodes that window with special tokens kept
(`tokenizer.decode` defaults), so a special token between the characters of a stop string
breaks the match there and not in the other engines. `ignore_eos` does not switch stop
strings off.

Versions: as in the vLLM engine, an update waits for the generate calls in flight and holds
new ones back. The server is started with `--weight-version 0` and each update sets
`weight_version`, so every answer's `meta_info.weight_version` is checked against the
version tidal expects.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import torch

from tidal.engines.served import ServedEngine, http_call, server_workspace, stop_process_group, tail, wait_healthy
from tidal.engines.stop_strings import check_stop_strings
from tidal.models import context_length, load_tokenizer
from tidal.types import GenerationRequest, SamplingParams

log = logging.getLogger("tidal")

SGLANG_VERSION = "0.5.23"  # the version whose source this engine was written against
Completion = tuple[list[int], list[float], str]  # token ids, their log-probs, finish reason


class SGLangEngineError(RuntimeError):
    """An SGLang engine call failed; the message names the engine, the call and the request."""


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None and torch.cuda.is_available()


# -- pure mapping between tidal and SGLang's /generate ------------------------------------------
# Turn-final tokens SGLang's tokenizer loader adds to every request's stop set when the
# vocabulary has them (utils/hf_transformers/common.py, attach_additional_stop_token_ids).
SGLANG_EXTRA_STOP_TEXTS = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")


def model_eos_ids(model_dir: str | Path, tokenizer=None) -> frozenset[int]:
    """The token ids at which SGLang ends every request unless `ignore_eos`: config.json's
    eos_token_id ∪ generation_config.json's (ModelConfig._get_hf_eos_token_id) and, since the
    server runs with its tokenizer, the tokenizer's EOS and its additional stop tokens
    (Req._check_token_based_finish)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= {eos} if isinstance(eos, int) else set(eos or ())
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        added = tokenizer.get_added_vocab()
        ids |= {added[t] for t in SGLANG_EXTRA_STOP_TEXTS if t in added}
    return frozenset(ids)


def sampling_fields(p: SamplingParams, model_eos: frozenset[int]) -> dict[str, Any]:
    """tidal SamplingParams → one SGLang `sampling_params` dict (api/v1 SamplingParams keys)."""
    greedy = p.temperature <= 0
    stops = set(p.stop_token_ids)
    exact = bool(stops) and model_eos <= stops  # SGLang's own stop set is then the request's
    fields: dict[str, Any] = {
        "max_new_tokens": p.max_new_tokens,
        "temperature": 0.0 if greedy else p.temperature,
        "top_p": 1.0 if greedy else p.top_p,
        "top_k": -1 if greedy or p.top_k <= 0 else p.top_k,  # -1: whole vocabulary
        "sampling_seed": p.seed,
        "ignore_eos": not exact,  # also switches off stop_token_ids: tidal cuts at them instead
    }
    if exact:
        fields["stop_token_ids"] = sorted(stops)
    if p.stop:
        fields["stop"] = list(p.stop)
    return fields


def generate_payload(requests: list[GenerationRequest], rids: list[str], model_eos: frozenset[int]) -> dict[str, Any]:
    """The JSON body of one batched `POST /generate` (io_struct.GenerateReqInput)."""
    return {
        "rid": rids,
        "input_ids": [list(r.prompt_ids) for r in requests],
        "sampling_params": [sampling_fields(r.params, model_eos) for r in requests],
        "return_logprob": True,  # meta_info.output_token_logprobs: the sampled tokens' log-probs
        "stream": False,
    }


def parse_output(r: GenerationRequest, rid: str, out: dict[str, Any], version: int) -> Completion:
    """One element of `/generate`'s answer → (token ids, log-probs, "stop" | "length").

    `out` is tokenizer_manager's dict for a finished request (`text` too, unused):
    {"output_ids": [...], "meta_info": {"id": rid, "finish_reason": {"type": ..., ...},
    "weight_version": "...", "output_token_logprobs": [[logprob, token_id, None], ...], ...}}.
    """
    where = f"request {r.request_id}"
    meta = out.get("meta_info") or {}
    if meta.get("id", rid) != rid:
        raise SGLangEngineError(f"{where}: the answer is for SGLang request {meta.get('id')!r}, expected {rid!r}")
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        raise SGLangEngineError(f"{where}: SGLang aborted it: {reason.get('message')!r}")
    toks = [int(t) for t in out["output_ids"]]
    pairs = meta.get("output_token_logprobs") or []
    if [int(p[1]) for p in pairs] != toks:
        raise SGLangEngineError(f"{where}: {len(toks)} tokens but log-probs for {len(pairs)} tokens "
                                f"that do not match them (first ids {toks[:5]} vs {[p[1] for p in pairs[:5]]})")
    lps = [float(p[0]) for p in pairs]
    got = meta.get("weight_version")
    if got is not None and str(got) != str(version):
        raise SGLangEngineError(f"{where}: produced by SGLang weight version {got!r}, expected {version}")
    stops = set(r.params.stop_token_ids)
    cut = next((i for i, t in enumerate(toks) if t in stops), None)
    if cut is not None:
        return toks[:cut + 1], lps[:cut + 1], "stop"
    if kind == "length":
        return toks, lps, "length"
    matched = reason.get("matched") if isinstance(reason, dict) else None
    if kind == "stop" and isinstance(matched, str) and matched in r.params.stop:
        return toks, lps, "stop"  # output_ids end with the token that completed the string
    raise SGLangEngineError(f"{where}: SGLang finished it with {reason!r} on token {toks[-1] if toks else None}, "
                            f"which is not among the request's stop tokens {sorted(stops)} "
                            f"or stop strings {list(r.params.stop)}")


def server_command(model_dir: str | Path, host: str, port: int, *, dtype: str, seed: int, max_batch_size: int,
                   mem_fraction_static: float, tp_size: int = 1) -> list[str]:
    """`python -m sglang.launch_server` with tidal's flags (arg_groups/fields/*.py spell them)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
            "--host", host, "--port", str(port),  # with its tokenizer: stop strings need it
            "--dtype", dtype, "--random-seed", str(seed),
            "--max-running-requests", str(max_batch_size),
            "--mem-fraction-static", f"{mem_fraction_static:g}",
            "--tp-size", str(tp_size),  # engine.tensor_parallel: SGLang spawns one scheduler per GPU rank
            "--enable-deterministic-inference",  # per-request sampling_seed takes effect only with it
            "--sampling-defaults", "openai",  # no sampling defaults from the model's generation_config.json
            "--weight-version", "0"]


SGLANG_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}  # log-probs after temperature (sampler.py)


# -- the engine --------------------------------------------------------------------------------
class SGLangEngine(ServedEngine):
    """The Engine protocol over a supervised SGLang server (see the module docstring)."""

    error = SGLangEngineError

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_batch_size: int = 512,
        gpu_memory_utilization: float = 0.5,
        start_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        log_dir: str | Path | None = None,
        tensor_parallel: int = 1,
    ):
        self.model_dir = Path(model_dir)
        self.request_timeout_s = request_timeout_s
        self._start_serving()
        cfg = json.loads((self.model_dir / "config.json").read_text())
        self._tied = bool(cfg.get("tie_word_embeddings", False))
        self.max_model_len = context_length(cfg) or 0  # 0: unknown, not checked

        self._eos = model_eos_ids(self.model_dir, load_tokenizer(self.model_dir))
        self._ids = itertools.count()

        self.host = "127.0.0.1"
        self.port, self._tmp, self.weights_dir, self.log_path = server_workspace("sglang", log_dir)
        self.url = f"http://{self.host}:{self.port}"
        cmd = server_command(self.model_dir, self.host, self.port, dtype=dtype, seed=seed,
                             max_batch_size=max_batch_size, mem_fraction_static=gpu_memory_utilization,
                             tp_size=tensor_parallel)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the server writes to it until close()
        self.proc = subprocess.Popen(cmd, env={**os.environ, **SGLANG_ENV}, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        # Close on interpreter exit: no server process outlives tidal.
        self._finalizer = weakref.finalize(self, _close_server, self.proc, self._log, self._tmp, self.log_path)
        try:
            wait_healthy(self.proc, self.url + "/health", start_timeout_s, "SGLang server", self.log_path,
                          SGLangEngineError, "engine.vllm_start_timeout_s")
        except BaseException:
            self.close()
            raise

    # -- the Engine protocol (the rest is ServedEngine's) ----------------------------------------
    @property
    def name(self) -> str:
        return f"SGLang engine (server pid {self.proc.pid} on {self.url}, log {self.log_path})"

    async def _generate(self, requests: list[GenerationRequest], what: str,
                        version: int) -> list[tuple[list[int], list[float], str]]:
        rids = [f"{next(self._ids)}:{r.request_id}" for r in requests]  # unique even if a caller reuses ids
        body = generate_payload(requests, rids, self._eos)
        try:
            text = await asyncio.wait_for(asyncio.to_thread(self._http, "POST", "/generate", body,
                                                            self.request_timeout_s), self.request_timeout_s)
            outs = json.loads(text)
            if not isinstance(outs, list) or len(outs) != len(requests):
                raise SGLangEngineError(f"/generate answered {type(outs).__name__} of "
                                        f"{len(outs) if isinstance(outs, list) else '?'} items for "
                                        f"{len(requests)} requests: {text[:300]}")
            return [parse_output(r, rid, o, version) for r, rid, o in zip(requests, rids, outs)]
        except SGLangEngineError as e:
            raise SGLangEngineError(f"{self.name}: {what}: {e}") from e
        except (TimeoutError, asyncio.CancelledError) as e:
            await asyncio.shield(asyncio.to_thread(self._abort, rids))
            if isinstance(e, asyncio.CancelledError):
                raise
            raise SGLangEngineError(f"{self.name}: {what} did not finish within {self.request_timeout_s:g} s "
                                    "(engine.request_timeout_s)") from None
        except Exception as e:
            raise SGLangEngineError(f"{self.name}: {what} failed: {type(e).__name__}: {e}") from e

    # -- helpers ---------------------------------------------------------------------------
    def dead(self) -> str:
        code = self.proc.poll()
        if code is None:
            return ""
        return f"The server exited with code {code}; last lines of {self.log_path}:\n{tail(self.log_path)}"

    def _http(self, method: str, path: str, body: dict | None, timeout_s: float) -> str:
        return http_call(self.url, method, path, body, timeout_s, SGLangEngineError, self.dead)

    def _load_weights(self, named: dict[str, torch.Tensor], version: int) -> None:
        from safetensors.torch import save_file

        self.weights_dir.mkdir(exist_ok=True)
        shutil.copy(self.model_dir / "config.json", self.weights_dir / "config.json")
        tmp = self.weights_dir / "model.safetensors.tmp"  # not *.safetensors: SGLang's loader globs those
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in named.items()}, str(tmp))
        tmp.replace(self.weights_dir / "model.safetensors")
        body = {"model_path": str(self.weights_dir), "weight_version": str(version), "flush_cache": True}
        answer = json.loads(self._http("POST", "/update_weights_from_disk", body, self.request_timeout_s))
        if not answer.get("success"):
            raise SGLangEngineError(f"/update_weights_from_disk refused: {answer.get('message')!r}")
        self._http("POST", "/flush_cache", None, 60)  # 400 if requests were running: none are (the gate)

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:  # best effort: the server may be gone
            try:
                self._http("POST", "/abort_request", {"rid": rid}, 10)
            except SGLangEngineError as e:
                log.debug("%s: aborting %s: %s", self.name, rid, e)

    def _validate(self, r: GenerationRequest) -> None:
        if not r.prompt_ids:
            raise SGLangEngineError(f"{self.name}: request {r.request_id} has an empty prompt")
        if r.images:  # never dropped silently: a text-only generation of an image prompt is another policy
            raise SGLangEngineError(f"{self.name}: request {r.request_id} has {len(r.images)} image(s); tidal's SGLang "
                                    "engine takes no images yet (engine.kind=torch or vllm runs vision-language models)")
        if r.params.stop:
            try:
                check_stop_strings(r.params.stop, f"request {r.request_id}")
            except (TypeError, ValueError) as e:
                raise SGLangEngineError(f"{self.name}: {e}") from None
        total = len(r.prompt_ids) + r.params.max_new_tokens
        if self.max_model_len and total > self.max_model_len:
            raise SGLangEngineError(
                f"{self.name}: request {r.request_id}: prompt of {len(r.prompt_ids)} tokens + max_new_tokens "
                f"{r.params.max_new_tokens} exceeds the model's max_position_embeddings {self.max_model_len}")


def _close_server(proc: subprocess.Popen, log_file, tmp: Path, log_path: Path) -> None:
    stop_process_group(proc)
    log_file.close()
    shutil.rmtree(tmp / "weights", ignore_errors=True)
    if log_path.parent != tmp:
        shutil.rmtree(tmp, ignore_errors=True)
