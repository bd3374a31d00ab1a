"""The LLM judge's HTTP client (tidal/rewards/judge.py): one OpenAI-compatible endpoint and model,
requests with retries and backoff under a concurrency limit, a content-addressed cache of parsed
verdicts with in-flight sharing, and the errors a judge call ends with."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import Counter, OrderedDict
from typing import Any

import httpx

RETRYABLE_STATUS = frozenset({408, 409, 425, 429})  # and every 5xx


class JudgeError(RuntimeError):
    """A judge call failed; the message names the judge (model and URL) and what happened."""


class JudgeVerdictError(JudgeError):
    """The judge's replies did not contain a verdict of the expected form after every retry."""

    def __init__(self, message: str, raw: str):
        super().__init__(message)
        self.raw = raw


class JudgeRequestError(JudgeError):
    """The endpoint gave no usable answer: a non-retryable HTTP status, or retries ran out."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class MalformedVerdict(ValueError):
    """A reply without a verdict of the expected form (retried, then JudgeVerdictError).
    `raw`: the answer's text when it is not the reply being parsed (a body that is not JSON)."""

    def __init__(self, message: str, raw: str | None = None):
        super().__init__(message)
        self.raw = raw


def _chat_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def _reply_text(body: Any) -> str:
    try:
        msg = body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise MalformedVerdict("the answer is not an OpenAI chat completion", raw=json.dumps(body)) from None
    content = msg.get("content") if isinstance(msg, dict) else None
    if not content and isinstance(msg, dict):
        content = msg.get("reasoning_content")  # reasoning models that put everything there
    return content if isinstance(content, str) else ""


class JudgeClient:
    """One endpoint and model: requests with retries and backoff under a concurrency limit,
    and a content-addressed cache of parsed verdicts with in-flight sharing."""

    def __init__(self, base_url: str, model: str, api_key: str | None, temperature: float, max_tokens: int,
                 max_retries: int, backoff_s: float, max_backoff_s: float, max_concurrency: int, timeout_s: float,
                 cache: bool, cache_size: int, extra_body: dict[str, Any] | None):
        if max_retries < 0 or max_concurrency < 1 or timeout_s <= 0 or backoff_s < 0 or max_tokens < 1:
            raise ValueError("judge: max_retries >= 0, max_concurrency >= 1, timeout_s > 0, backoff_s >= 0 and "
                             f"max_tokens >= 1 are required (got {max_retries}, {max_concurrency}, {timeout_s}, "
                             f"{backoff_s}, {max_tokens})")
        self.url = _chat_url(base_url)
        self.model = model
        self.api_key = api_key
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.cache_on = cache
        self.cache_size = cache_size
        self.extra_body = dict(extra_body or {})
        self.stats: Counter[str] = Counter()
        self._cache: OrderedDict[str, tuple[Any, str]] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._inflight: dict[str, asyncio.Future] = {}

    @property
    def who(self) -> str:
        return f"judge `{self.model}` at {self.url}"

    def worst_case_s(self) -> float:
        """Longest a call can take: every attempt timing out, every backoff at its cap."""
        waits = sum(min(self.backoff_s * 2 ** k, self.max_backoff_s) for k in range(self.max_retries))
        return (1 + self.max_retries) * self.timeout_s + waits

    def __getstate__(self) -> dict[str, Any]:  # crosses processes without its loop-bound parts
        state = dict(self.__dict__)
        state.update(_loop=None, _http=None, _sem=None, _inflight={})
        return state

    def _bind(self) -> None:
        """The HTTP client, semaphore and in-flight table belong to one event loop; a caller
        on another loop (a new asyncio.run) gets fresh ones."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            # Plain http has no certificates to check: skip loading the CA bundle (0.1-0.3 s per client).
            verify = not self.url.startswith("http://")
            self._http = httpx.AsyncClient(verify=verify)  # the semaphore is the concurrency limit
            self._sem = asyncio.Semaphore(self.max_concurrency)
            self._inflight = {}

    async def aclose(self) -> None:
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.aclose()
        self._http, self._loop = None, None

    def key(self, *parts: Any) -> str:
        blob = json.dumps([self.model, self.temperature, self.max_tokens, self.extra_body, *parts],
                          sort_keys=True, ensure_ascii=False, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    async def verdict(self, key: str, messages: list[dict[str, str]], parse, correction: str) -> tuple[Any, str, bool]:
        """(parsed verdict, raw reply, from cache). Identical keys in flight share one request."""
        self._bind()
        while True:
            if self.cache_on and key in self._cache:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                value, raw = self._cache[key]
                return value, raw, True
            pending = self._inflight.get(key)
            if pending is None:
                break
            try:
                value, raw = await asyncio.shield(pending)
            except asyncio.CancelledError:
                if pending.cancelled():  # its owner was cancelled, not us: ask ourselves
                    continue
                raise
            self.stats["shared"] += 1
            return value, raw, True
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            value, raw = await self._ask(messages, parse, correction)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # marked retrieved: nobody else may be waiting
            raise
        finally:
            self._inflight.pop(key, None)
        fut.set_result((value, raw))
        if self.cache_on:
            self._cache[key] = (value, raw)
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return value, raw, False

    async def _ask(self, messages: list[dict[str, str]], parse, correction: str) -> tuple[Any, str]:
        convo = list(messages)
        attempts = 1 + self.max_retries
        last_error, last_raw, last_status, malformed = "", "", None, False
        for attempt in range(attempts):
            retry_after = 0.0
            try:
                raw = await self._post(convo)
                return parse(raw), raw
            except _Retryable as e:
                last_error, last_status, malformed, retry_after = str(e), e.status, False, e.retry_after
                self.stats["http_retries" if e.status else "transport_retries"] += 1
            except MalformedVerdict as e:
                self.stats["malformed"] += 1
                last_raw = e.raw if e.raw is not None else raw
                last_error, last_status, malformed = str(e), None, True
                # Ask again with the reply and what was wrong with it (a greedy judge repeats itself otherwise).
                convo = [*messages, {"role": "assistant", "content": last_raw},
                         {"role": "user", "content": f"Your reply could not be read: {e}. {correction}"}]
            if attempt + 1 < attempts:
                wait = min(self.backoff_s * 2 ** attempt, self.max_backoff_s) * (0.5 + 0.5 * random.random())
                await asyncio.sleep(max(wait, min(retry_after, self.max_backoff_s)))
        if malformed:
            raise JudgeVerdictError(f"{self.who}: the verdict was malformed after {attempts} attempts: {last_error}; "
                                    f"last reply: {last_raw[:500]!r}", raw=last_raw)
        raise JudgeRequestError(f"{self.who}: no answer after {attempts} attempts; last: {last_error}",
                                status=last_status)

    async def _post(self, messages: list[dict[str, str]]) -> str:
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens, **self.extra_body}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        assert self._sem is not None and self._http is not None
        async with self._sem:
            self.stats["requests"] += 1
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(self.timeout_s):  # a total bound, not httpx's per-read one
                    resp = await self._http.post(self.url, json=body, headers=headers, timeout=self.timeout_s)
            except TimeoutError:
                raise _Retryable(f"timed out after {self.timeout_s:g} s (timeout_s)") from None
            except httpx.TimeoutException:
                raise _Retryable(f"timed out after {time.perf_counter() - t0:.1f} s") from None
            except httpx.TransportError as e:
                raise _Retryable(f"{type(e).__name__}: {e}") from None
        if resp.status_code == 200:
            try:
                return _reply_text(resp.json())
            except json.JSONDecodeError:
                raise MalformedVerdict("the answer is not JSON", raw=resp.text) from None
        detail = f"HTTP {resp.status_code}: {resp.text[:300]}"
        if resp.status_code in RETRYABLE_STATUS or resp.status_code >= 500:
            raise _Retryable(detail, resp.status_code, _retry_after(resp))
        raise JudgeRequestError(f"{self.who}: {detail} (not retried)", status=resp.status_code)


class _Retryable(Exception):
    def __init__(self, message: str, status: int | None = None, retry_after: float = 0.0):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def _retry_after(resp: httpx.Response) -> float:
    try:
        return max(0.0, float(resp.headers.get("retry-after", "0")))
    except ValueError:  # an HTTP date: not worth parsing for a judge
        return 0.0
