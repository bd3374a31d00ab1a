"""The gateway: OpenAI's chat-completions and completions APIs over tidal's engines, with
every call of an episode's session recorded as the tokens the engine produced.

`Gateway` is the protocol: it turns a request body into token-id `GenerationRequest`s for the
engine (a `Router`, so every replica serves it and a session's calls stay on one replica), and
the results into OpenAI's response shapes. The HTTP server around it is
`tidal/runtime/gateway_http.py`.

Choices made here:

- **Sessions.** A call names its session by the URL prefix `/sessions/{id}~{secret}/v1/...`
  or the header `X-Tidal-Session` (the secret is made when the session opens and given to its
  agent only). A rollout opens the session of each agent episode; the calls are
  recorded in a `Session` (tidal/runtime/sessions.py), which continues earlier token contexts
  and records prefix breaks. Outside a session a call is served and forgotten.
- **The turn as generated.** An assistant message that the gateway itself returned in the
  session (same content, same tool calls) is rendered as the text the policy generated, not
  re-serialized by the chat template: an agent that appends the reply it got keeps the
  episode's token prefix. An edited message is rendered by the template (a prefix break).
- **Sampling in a training session is the run's.** The trainer scores tokens with the run's
  temperature (docs/architecture.md, "Data"), so a session's temperature, top_p and top_k are the rollout's; a
  request that asks for others is served with the run's and counted
  (`gateway/sampling_overridden`). Seeds come from the episode's seed and the call's index.
  `max_tokens` is capped by `rollout.max_new_tokens` and the episode's token budget.
- **Tool calls** are parsed from `<tool_call>{json}</tool_call>` blocks (tidal.envs.tools,
  the Hermes/Qwen form) when the request lists `tools`; `finish_reason` is then `tool_calls`.
  A malformed call stays in `content` as the text the policy wrote.
- **Stop strings** end generation with the token that completes them (the engine keeps that
  token, the record keeps every token); the returned text is cut before the stop string, as
  OpenAI does.
- **Streaming** sends the whole completion once the engine returns it (the engines return
  whole results): a role chunk, one content (or tool-call) chunk, the finish chunk, usage when
  asked, `[DONE]`.
- **Log-probs** are those of the sampled tokens (`top_logprobs` is refused: the engines
  return no alternatives).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Any

from tidal.envs.tools import parse_tool_calls
from tidal.runtime.rollout import BatchingClient, request_seed
from tidal.runtime.sessions import Call, Session, SessionLimit
from tidal.types import GenerationRequest, GenerationResult, SamplingParams, ToolCallRecord

log = logging.getLogger("tidal")

MAX_N = 64
SESSION_KEY_SEP = "~"  # between a session's id and its secret in `/sessions/{id}~{secret}/v1`


class GatewayError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _sampling_options(body: dict) -> dict[str, Any]:
    """The request's sampling fields, checked: n, max_tokens, temperature, top_p, stop, seed (the
    penalties, logit_bias and response_format, which tidal's engines do not do, refused)."""
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise _bad(f"`{key}` is not supported by tidal's engines (log-probs must stay those of plain "
                       "sampling)", key, "unsupported_parameter")
    if body.get("logit_bias"):
        raise _bad("`logit_bias` is not supported", "logit_bias", "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise _bad("`response_format` other than text is not supported", "response_format", "unsupported_parameter")
    n = _int(body, "n", 1, 1, MAX_N)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = None if max_tokens is None else _int({"max_tokens": max_tokens}, "max_tokens", 0, 1, None)
    temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _num(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise _bad("`top_p` must be in (0, 1]", "top_p")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in stop) \
            or len(stop) > 16:
        raise _bad("`stop` must be a string of 1 to 256 characters or a list of at most 16 of them", "stop")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise _bad("`seed` must be an integer", "seed")
    return {"n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "stop": stop, "seed": seed}


def _bad(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", param, code)


@dataclass
class Prepared:
    """A request checked and turned into what the engine takes."""

    kind: str  # "chat" | "completion"
    prompt_ids: list[int]
    params: list[SamplingParams]  # one per choice
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    logprobs: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    echo_text: str
    session: Session | None
    call: Call | None
    model: str


class Gateway:
    def __init__(self, engine, tokenizer, model_name: str, *, max_model_len: int, default_max_tokens: int = 256,
                 stop_token_ids: tuple[int, ...] = (), max_sessions: int = 100_000):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()
        self._clients: dict[int, BatchingClient] = {}  # one per event loop (the server's)
        self.stats = {"requests": 0, "errors": 0, "sessions": 0}

    # -- sessions ------------------------------------------------------------------------------
    def open_session(self, session_id: str, params: SamplingParams, *, seed: int = 0, max_calls: int | None = None,
                     max_total_tokens: int | None = None) -> Session:
        """A rollout's episode: calls under `session_id` are recorded; sampling is `params`."""
        if SESSION_KEY_SEP in session_id or "/" in session_id:
            raise ValueError(f"gateway: a session id may not hold {SESSION_KEY_SEP!r} or '/': {session_id!r}")
        session = Session(session_id, params, seed=seed, max_calls=max_calls, max_total_tokens=max_total_tokens)
        with self._lock:
            if session_id in self.sessions and self.sessions[session_id].open:
                raise ValueError(f"gateway: session `{session_id}` is already open")
            self.sessions[session_id] = session
            self.stats["sessions"] += 1
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return session

    def close_session(self, session_id: str) -> Session | None:
        """No further call is taken under `session_id`; the record is handed back (and forgotten)."""
        with self._lock:
            session = self.sessions.pop(session_id, None)
        if session is not None:
            with session.lock:
                session.open = False
        return session

    def session_key(self, session_id: str) -> str:
        """What names an open session in a URL or the header: its id and its secret. Episode ids
        are predictable; the secret keeps one agent (or anything else that can reach the
        gateway) from writing into another episode's record."""
        with self._lock:
            session = self.sessions[session_id]
        return f"{session_id}{SESSION_KEY_SEP}{session.secret}"

    def _session(self, key: str | None) -> Session | None:
        if not key:
            return None
        session_id, _, secret = key.partition(SESSION_KEY_SEP)
        with self._lock:
            session = self.sessions.get(session_id)
        if session is None or not session.open or not hmac.compare_digest(secret.encode(), session.secret.encode()):
            raise GatewayError(404, f"session `{session_id}` is not open on this gateway (sessions are opened by "
                                    "a rollout, one per episode, and named by the URL it gives the agent; without "
                                    "one, call /v1/... directly)", "invalid_request_error", None, "session_not_found")
        return session

    # -- the API -------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "tidal", "max_model_len": self.max_model_len}]}

    def prepare(self, kind: str, body: Any, session_id: str | None = None) -> Prepared:
        """A request (`kind` "chat" or "completion") checked field by field, in the order the API
        documents them, and turned into the prompt's token ids and one SamplingParams per choice."""
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        session = self._session(session_id)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _bad("you must provide a model parameter", "model")
        if session is None and model != self.model_name:
            raise GatewayError(404, f"the model `{model}` does not exist; this gateway serves `{self.model_name}`",
                               "invalid_request_error", "model", "model_not_found")
        o = _sampling_options(body)
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        return_ids = bool(body.get("return_token_ids", False))
        if kind == "chat":
            text, messages, tools, parse_tools, logprobs = self._chat_prompt(body, session)
            prompt_ids_given, echo = None, ""
        else:
            text, prompt_ids_given, logprobs, echo = self._completion_prompt(body, o["n"])
            messages, tools, parse_tools = None, None, False
        call, prompt_ids, params = self._params(kind, body, o, session, text, messages, prompt_ids_given)
        return Prepared(kind, list(prompt_ids), params, tools, parse_tools, logprobs, stream, include_usage,
                        return_ids, echo, session, call, model)

    def _chat_prompt(self, body: dict, session) -> tuple[str, list, list | None, bool, bool]:
        """(the rendered prompt, the messages, the tools, whether to parse tool calls, logprobs)."""
        if body.get("top_logprobs"):
            raise _bad("`top_logprobs` is not supported: tidal's engines return the sampled token's log-prob only",
                       "top_logprobs", "unsupported_parameter")
        logprobs = bool(body.get("logprobs", False))
        messages = _messages(body.get("messages"))
        tools = _tools(body.get("tools"))
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise _bad("`tool_choice` may be `auto` or `none` (tidal does not force a call)", "tool_choice",
                       "unsupported_parameter")
        render = self._render_messages(messages, session)
        try:
            text = self.tokenizer.apply_chat_template(render, add_generation_prompt=True, tokenize=False,
                                                      **({"tools": tools} if tools else {}))
        except Exception as e:  # noqa: BLE001 - a template error is the request's
            raise _bad(f"the chat template cannot render these messages: {type(e).__name__}({e})",
                       "messages") from None
        return text, messages, tools, bool(tools) and choice != "none", logprobs

    def _completion_prompt(self, body: dict, n: int) -> tuple[str, list[int] | None, bool, str]:
        """(the prompt's text, its token ids when given as ids, logprobs, the echo)."""
        logprobs_n = body.get("logprobs")
        if logprobs_n not in (None, 0, False, True) and not (isinstance(logprobs_n, int) and logprobs_n == 0):
            raise _bad("`logprobs` above 0 is not supported: tidal's engines return the sampled token's log-prob "
                       "only (use logprobs=0)", "logprobs", "unsupported_parameter")
        logprobs = logprobs_n is not None and logprobs_n is not False
        if body.get("suffix"):
            raise _bad("`suffix` is not supported", "suffix", "unsupported_parameter")
        if body.get("best_of") not in (None, 1, n):
            raise _bad("`best_of` is not supported", "best_of", "unsupported_parameter")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            text, prompt_ids_given = prompt, None
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            vocab = len(self.tokenizer)
            if any(t < 0 or t >= vocab for t in prompt):
                raise _bad(f"`prompt` holds token ids outside the vocabulary (0..{vocab - 1})", "prompt")
            prompt_ids_given = list(prompt)
            text = self.tokenizer.decode(prompt_ids_given, skip_special_tokens=False)
        else:
            raise _bad("`prompt` must be one non-empty string or one list of token ids (one prompt per request)",
                       "prompt")
        return text, prompt_ids_given, logprobs, text if body.get("echo") else ""

    def _params(self, kind: str, body: dict, o: dict, session, text: str, messages: list | None,
                prompt_ids_given: list[int] | None):
        """(the session's call or None, the prompt's token ids, one SamplingParams per choice). In a
        session the episode's sampling and token budget rule; outside one, the request's."""
        call = None
        max_tokens = o["max_tokens"]
        if session is not None:
            try:
                call, prompt_ids = session.begin_call(text, self._tokenize, messages, prompt_ids=prompt_ids_given)
            except SessionLimit as e:
                raise GatewayError(400, str(e), "invalid_request_error", None, f"session_{e.which}_limit") from None
            except KeyError as e:
                raise GatewayError(404, str(e.args[0]), "invalid_request_error", None, "session_not_found") from None
            run = session.params
            asked = (o["temperature"], o["top_p"])
            call.overridden = asked != (run.temperature, run.top_p) and ("temperature" in body or "top_p" in body)
            base = replace(run, stop=tuple(o["stop"]), stop_token_ids=run.stop_token_ids or self.stop_token_ids)
            cap = run.max_new_tokens
            room = session.room(call)
            if room is not None:
                cap = min(cap, room)
            seeds = [request_seed(session.seed, call.index, c) for c in range(o["n"])]
        else:
            prompt_ids = prompt_ids_given if prompt_ids_given is not None else self._tokenize(text)
            base = SamplingParams(temperature=o["temperature"], top_p=o["top_p"], stop=tuple(o["stop"]),
                                  stop_token_ids=self.stop_token_ids)
            cap = self.default_max_tokens if max_tokens is None else max_tokens
            root = o["seed"] if o["seed"] is not None else secrets.randbits(62)
            seeds = [request_seed(root, c) for c in range(o["n"])]
        if not prompt_ids:
            raise _bad("the prompt is empty", "messages" if kind == "chat" else "prompt")
        room_model = self.max_model_len - len(prompt_ids)
        if room_model <= 0:
            raise _bad(f"this model's maximum context length is {self.max_model_len} tokens; the prompt holds "
                       f"{len(prompt_ids)}", "messages" if kind == "chat" else "prompt", "context_length_exceeded")
        if max_tokens is not None:
            cap = min(cap, max_tokens)
        cap = min(cap, room_model)
        if cap <= 0:
            raise GatewayError(400, "no tokens are left in this episode's budget (rollout.max_total_tokens)",
                               "invalid_request_error", "max_tokens", "session_tokens_limit")
        return call, prompt_ids, [replace(base, max_new_tokens=cap, seed=s) for s in seeds]

    async def generate(self, prep: Prepared) -> list[GenerationResult]:
        sid = prep.session.id if prep.session is not None else ""
        rid = secrets.token_hex(6)
        reqs = [GenerationRequest(f"gw-{rid}-{c}", prep.prompt_ids, p, session_id=sid or f"gw-{rid}")
                for c, p in enumerate(prep.params)]
        t0 = time.perf_counter()
        try:
            results = await self._client().generate_many(reqs)
        except Exception as e:  # noqa: BLE001 - the engine's failure, in the API's shape
            raise GatewayError(503, f"the engine failed: {type(e).__name__}({e})", "server_error", None,
                               "engine_unavailable") from None
        if prep.session is not None:
            prep.session.generate_s += time.perf_counter() - t0
        return results

    def _client(self):
        loop = asyncio.get_running_loop()
        client = self._clients.get(id(loop))
        if client is None or client.loop is not loop:
            client = _LoopClient(self.engine, loop)
            self._clients = {id(loop): client}
        return client

    def respond(self, prep: Prepared, results: list[GenerationResult]) -> dict[str, Any]:
        """The response body; the session (if any) records each choice."""
        created = int(time.time())
        choices, completion_tokens = [], 0
        for c, res in enumerate(results):
            completion_tokens += len(res.token_ids)
            content, tool_calls, finish = self._choice(prep, c, res)
            if prep.kind == "chat":
                msg: dict[str, Any] = {"role": "assistant", "content": content}
                if tool_calls:
                    msg["tool_calls"] = tool_calls
                choice: dict[str, Any] = {"index": c, "message": msg, "finish_reason": finish,
                                          "logprobs": self._chat_logprobs(res) if prep.logprobs else None}
            else:
                choice = {"index": c, "text": prep.echo_text + (content or ""), "finish_reason": finish,
                          "logprobs": self._completion_logprobs(res, prep.echo_text) if prep.logprobs else None}
            if prep.return_token_ids:
                choice["token_ids"] = list(res.token_ids)
                choice["weight_versions"] = res.versions_per_token()
            choices.append(choice)
        body: dict[str, Any] = {
            "id": ("chatcmpl-" if prep.kind == "chat" else "cmpl-") + secrets.token_hex(12),
            "object": "chat.completion" if prep.kind == "chat" else "text_completion",
            "created": created, "model": prep.model, "choices": choices,
            "usage": {"prompt_tokens": len(prep.prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prep.prompt_ids) + completion_tokens},
            "system_fingerprint": f"tidal-v{max((r.version for r in results), default=-1)}",
        }
        if prep.return_token_ids:
            body["prompt_token_ids"] = list(prep.prompt_ids)
        return body

    def _choice(self, prep: Prepared, c: int, res: GenerationResult) -> tuple[str | None, list[dict], str]:
        raw = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        content = _cut_stop(raw, prep.params[c].stop) if res.finish_reason == "stop" else raw
        tool_calls: list[dict[str, Any]] = []
        records: list[ToolCallRecord] = []
        finish = "length" if res.finish_reason == "length" else "stop"
        out_content: str | None = content
        if prep.parse_tools:
            call_prefix = f"call_{prep.call.index}_{c}" if prep.call is not None else f"call_{secrets.token_hex(4)}"
            parsed = parse_tool_calls(content, id_prefix=call_prefix)
            good = [t for t in parsed.calls if not t.error]
            records = [ToolCallRecord(t.name, t.arguments_text, t.call_id, "parse" if t.error else "ok", t.error)
                       for t in parsed.calls]
            if good:
                tool_calls = [{"id": t.call_id, "type": "function",
                               "function": {"name": t.name, "arguments": t.arguments_text}} for t in good]
                out_content = parsed.content or None
                if finish == "stop":
                    finish = "tool_calls"
        if prep.session is not None and prep.call is not None:
            prep.session.add_completion(prep.call, c, res.token_ids, res.logprobs, res.versions_per_token(),
                                        res.finish_reason, self.tokenizer.decode(res.token_ids, skip_special_tokens=False),
                                        raw, records, res.version)
            if prep.kind == "chat":
                with prep.session.lock:
                    prep.session.returned[message_key(out_content, tool_calls)] = raw
        return out_content, tool_calls, finish

    def _chat_logprobs(self, res: GenerationResult) -> dict[str, Any]:
        items = []
        for t, lp in zip(res.token_ids, res.logprobs):
            s = self.tokenizer.decode([t], skip_special_tokens=False)
            items.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
        return {"content": items, "refusal": None}

    def _completion_logprobs(self, res: GenerationResult, echo: str) -> dict[str, Any]:
        tokens, offsets, pos = [], [], len(echo)
        for t in res.token_ids:
            s = self.tokenizer.decode([t], skip_special_tokens=False)
            tokens.append(s)
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": list(res.logprobs), "top_logprobs": None, "text_offset": offsets}

    def stream_chunks(self, body: dict[str, Any], prep: Prepared) -> list[dict[str, Any]]:
        """A whole response as the chunks of a stream (OpenAI's `chat.completion.chunk` or
        streamed `text_completion`)."""
        chunks = []
        base = {"id": body["id"], "created": body["created"], "model": body["model"],
                "system_fingerprint": body["system_fingerprint"]}
        if prep.kind == "chat":
            base["object"] = "chat.completion.chunk"
            for ch in body["choices"]:
                i, msg = ch["index"], ch["message"]
                chunks.append({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
                delta: dict[str, Any] = {}
                if msg.get("content"):
                    delta["content"] = msg["content"]
                if msg.get("tool_calls"):
                    delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(msg["tool_calls"])]
                if delta:
                    chunks.append({**base, "choices": [{"index": i, "delta": delta, "logprobs": ch["logprobs"],
                                                        "finish_reason": None}]})
                chunks.append({**base, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                    "finish_reason": ch["finish_reason"]}]})
        else:
            base["object"] = "text_completion"
            for ch in body["choices"]:
                chunks.append({**base, "choices": [{"index": ch["index"], "text": ch["text"], "logprobs": ch["logprobs"],
                                                    "finish_reason": None}]})
                chunks.append({**base, "choices": [{"index": ch["index"], "text": "", "logprobs": None,
                                                    "finish_reason": ch["finish_reason"]}]})
        if prep.include_usage:
            chunks.append({**base, "choices": [], "usage": body["usage"]})
        return chunks

    # -- helpers -------------------------------------------------------------------------------
    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _render_messages(self, messages: list[dict[str, Any]], session: Session | None) -> list[dict[str, Any]]:
        """Messages for the chat template: an assistant message this session's gateway returned
        becomes the text the policy generated; tool-call arguments become objects (the HF
        templates' convention)."""
        out = []
        for m in messages:
            if m["role"] == "assistant" and session is not None:
                with session.lock:
                    raw = session.returned.get(message_key(m.get("content"), m.get("tool_calls") or []))
                if raw is not None:
                    out.append({"role": "assistant", "content": raw})
                    continue
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [_decoded_call(tc) for tc in m["tool_calls"]]}
            out.append(m)
        return out


class _LoopClient(BatchingClient):
    """The requests of concurrent HTTP calls, batched per event-loop tick for the engine."""

    def __init__(self, engine, loop):
        super().__init__(engine)
        self.loop = loop
        self.batches = deque(maxlen=1024)  # type: ignore[assignment] - a server runs for long: recent sizes only

    async def generate_many(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))


def message_key(content: Any, tool_calls: list[Any]) -> str:
    """What identifies an assistant message the gateway returned: its text and its calls
    (arguments compared as JSON values, so re-serialized arguments still match)."""
    calls = []
    for tc in tool_calls or []:
        tc = tc if isinstance(tc, dict) else {}
        f = tc.get("function") or {}
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append([f.get("name"), args])
    return json.dumps([_text(content), calls], sort_keys=True, ensure_ascii=False)


def _decoded_call(tc: Any) -> Any:
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        return tc
    f = tc["function"]
    if isinstance(f.get("arguments"), str):
        try:
            return {**tc, "function": {**f, "arguments": json.loads(f["arguments"])}}
        except json.JSONDecodeError:
            return tc
    return tc


def _text(content: Any) -> str:
    """Message content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            elif isinstance(p, dict) and p.get("type") in ("image_url", "image", "input_audio", "file"):
                raise _bad(f"content parts of type `{p['type']}` are not supported by this model", "messages")
            else:
                raise _bad("a content part must be {\"type\": \"text\", \"text\": ...}", "messages")
        return "".join(parts)
    raise _bad("message content must be a string, null or a list of text parts", "messages")


ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("`messages` must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}] must be an object with a role among {', '.join(ROLES)}", f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"))}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      and isinstance(c["function"].get("name"), str) for c in calls):
                raise _bad(f"messages[{i}].tool_calls must be a list of {{\"id\", \"type\": \"function\", "
                           "\"function\": {\"name\", \"arguments\"}}", f"messages[{i}].tool_calls")
            msg["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                                  "function": {"name": c["function"]["name"],
                                               "arguments": c["function"].get("arguments", "{}")}} for c in calls]
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id", "")
            if m.get("name"):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                              and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in value):
        raise _bad("`tools` must be a list of {\"type\": \"function\", \"function\": {\"name\", \"description\", "
                   "\"parameters\"}}", "tools")
    return value or None


def _int(body: dict, key: str, default: int, lo: int, hi: int | None) -> int:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        raise _bad(f"`{key}` must be an integer in [{lo}, {hi if hi is not None else '∞'}], got {v!r}", key)
    return v


def _num(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise _bad(f"`{key}` must be a number in [{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _cut_stop(text: str, stops: tuple[str, ...]) -> str:
    """The text before the first stop string it contains (OpenAI leaves the stop string out)."""
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i >= 0:
            cut = min(cut, i)
    return text[:cut]
