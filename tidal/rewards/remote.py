"""A remote reward-model server as a reward source, over OpenRLHF's protocol.

`RemoteRewardModel(url)` is a per-sample async reward (tidal's form): each call contributes
one query, concurrent calls of one event loop are gathered (up to `max_batch_size`, waiting
at most `max_wait_ms`) into one `POST {url}` with `{"query": [prompt + completion, ...],
"prompts": [...], "labels": [...]}`, and each caller gets its own entry of the answer's
`rewards`. That is the request OpenRLHF's trainer sends to `--reward.remote_url`, so the source
can be `tidal serve-rm` (its `/get_reward`) or any server written for OpenRLHF.

Every request is bounded by `timeout_s` (retries of a refused connection included); every
failure raises `RemoteRewardError` naming the URL and what went wrong, so the episode ends
`reward_error`/`timeout` with a message, never a silent 0.
"""

from __future__ import annotations

import asyncio
import math
import os
import weakref
from typing import Any
from urllib.parse import urlsplit, urlunsplit


class RemoteRewardError(RuntimeError):
    pass


def endpoint(url: str) -> str:
    """`url` as the endpoint to POST to: a bare server address gets OpenRLHF's `/get_reward`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"remote reward model url must be http(s)://host:port[/path], got {url!r}")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/get_reward")
    return urlunsplit(parts)


class _LoopState:
    """Batching state of one event loop (an httpx client and pending calls belong to one loop)."""

    def __init__(self, client):
        self.client = client
        self.pending: list[tuple[str, str, Any, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.tasks: set[asyncio.Task] = set()


class RemoteRewardModel:
    """`task.rewards: [{fn: tidal.rewards.remote:RemoteRewardModel, args: {url: http://127.0.0.1:5000}}]`

    url: the server (its `/get_reward` is used) or the full endpoint. token: sent as
    `Authorization: Bearer`; token_env: the name of an environment variable holding it
    (read once, here, so the token need not be written into a config). label_column: the
    dataset column sent as the query's label (OpenRLHF's `--data.label_key`); None sends null.
    tokenizer: a tokenizer directory to render `prompt_messages` when no rendered `prompt`
    is given. Returns `{part: reward}`.
    """

    def __init__(self, url: str, token: str | None = None, token_env: str | None = None, timeout_s: float = 30.0,
                 max_batch_size: int = 32, max_wait_ms: float = 5.0, part: str = "rm",
                 label_column: str | None = None, retries: int = 2, tokenizer: str | None = None):
        if timeout_s <= 0 or max_batch_size < 1 or max_wait_ms < 0 or retries < 0:
            raise ValueError(f"RemoteRewardModel({url!r}): timeout_s must be > 0, max_batch_size >= 1, "
                             f"max_wait_ms >= 0 and retries >= 0")
        self.url = endpoint(url)
        if token is None and token_env is not None:
            token = os.environ.get(token_env)
            if not token:
                raise ValueError(f"RemoteRewardModel({self.url}): the environment variable `{token_env}` "
                                 "named by token_env is not set")
        self.token, self.timeout_s, self.retries = token, float(timeout_s), retries
        self.max_batch_size, self.max_wait_s = max_batch_size, max_wait_ms / 1000.0
        self.part, self.label_column, self.tokenizer_path = part, label_column, tokenizer
        self.__tidal_name__ = f"RemoteRewardModel({self.url})"
        self._init_runtime()

    _RUNTIME = ("_loops", "_tokenizer")

    def _init_runtime(self) -> None:
        self._loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._tokenizer = None

    def __getstate__(self) -> dict[str, Any]:  # crosses processes without its connections
        return {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def _state(self) -> _LoopState:
        import httpx

        loop = asyncio.get_running_loop()
        st = self._loops.get(loop)
        if st is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            st = _LoopState(httpx.AsyncClient(timeout=self.timeout_s, headers=headers))
            self._loops[loop] = st
        return st

    def _render_prompt(self, prompt: str | None, prompt_messages: list | None) -> str:
        if prompt is not None:
            return prompt
        if prompt_messages and self.tokenizer_path:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            return self._tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=False)
        raise ValueError(f"{self.__tidal_name__} needs the rendered `prompt` (or `prompt_messages` and a `tokenizer` "
                         "directory to render them)")

    async def __call__(self, completion: str, prompt: str | None = None, prompt_messages: list | None = None,
                       **columns) -> dict[str, float]:
        rendered = self._render_prompt(prompt, prompt_messages)
        label = columns.get(self.label_column) if self.label_column else None
        st = self._state()
        fut = asyncio.get_running_loop().create_future()
        st.pending.append((rendered + completion, rendered, label, fut))
        if len(st.pending) >= self.max_batch_size:
            self._flush(st)
        elif st.timer is None:
            st.timer = asyncio.get_running_loop().call_later(self.max_wait_s, self._flush, st)
        # The request is bounded by timeout_s; this bound only guards against a bug here.
        reward = await asyncio.wait_for(fut, self.max_wait_s + self.timeout_s + 5.0)
        return {self.part: reward}

    def _flush(self, st: _LoopState) -> None:
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        while st.pending:
            batch, st.pending = st.pending[: self.max_batch_size], st.pending[self.max_batch_size :]
            task = asyncio.get_running_loop().create_task(self._send(st, batch))
            st.tasks.add(task)
            task.add_done_callback(st.tasks.discard)

    async def _send(self, st: _LoopState, batch: list) -> None:
        try:
            rewards = await self._post(st, [b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])
        except Exception as e:  # noqa: BLE001 - every caller of the request gets its failure
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (*_, fut), r in zip(batch, rewards):
            if not fut.done():
                fut.set_result(r)

    async def score(self, queries: list[str], prompts: list[str] | None = None,
                    labels: list | None = None) -> list[float]:
        """One OpenRLHF request: the rewards of `queries` (full texts), in order."""
        return await self._post(self._state(), queries, prompts, labels)

    async def _post(self, st: _LoopState, queries: list[str], prompts: list[str] | None,
                    labels: list | None) -> list[float]:
        import httpx

        body = {"query": queries, "prompts": prompts if prompts is not None else [""] * len(queries),
                "labels": labels if labels is not None else [None] * len(queries)}
        try:
            async with asyncio.timeout(self.timeout_s):
                for attempt in range(self.retries + 1):
                    try:
                        resp = await st.client.post(self.url, json=body)
                        break
                    except (httpx.ConnectError, httpx.RemoteProtocolError) as e:
                        if attempt == self.retries:
                            raise RemoteRewardError(f"remote reward model {self.url}: cannot connect after "
                                                    f"{attempt + 1} attempts: {type(e).__name__}: {e}") from e
                        await asyncio.sleep(0.2 * 2**attempt)
        except (TimeoutError, httpx.TimeoutException) as e:
            raise RemoteRewardError(f"remote reward model {self.url}: no answer within {self.timeout_s:g} s "
                                    f"({len(queries)} queries)") from e
        except httpx.HTTPError as e:
            raise RemoteRewardError(f"remote reward model {self.url}: {type(e).__name__}: {e}") from e
        return self._rewards(resp, len(queries))

    def _rewards(self, resp, n: int) -> list[float]:
        if resp.status_code != 200:
            try:
                detail = resp.json()
                detail = detail.get("error", {}).get("message") or detail
            except ValueError:
                detail = resp.text[:300]
            raise RemoteRewardError(f"remote reward model {self.url}: HTTP {resp.status_code}: {detail}")
        try:
            data = resp.json()
        except ValueError as e:
            raise RemoteRewardError(f"remote reward model {self.url}: the answer is not JSON: {resp.text[:200]!r}") from e
        rewards = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(rewards, list):
            raise RemoteRewardError(f"remote reward model {self.url}: the answer has no `rewards` list "
                                    f"(keys: {sorted(data) if isinstance(data, dict) else type(data).__name__})")
        if len(rewards) != n:
            raise RemoteRewardError(f"remote reward model {self.url}: {len(rewards)} rewards for {n} queries")
        out = []
        for i, r in enumerate(rewards):
            if isinstance(r, list) and len(r) == 1:  # some OpenRLHF servers answer [[r], ...]
                r = r[0]
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise RemoteRewardError(f"remote reward model {self.url}: reward {i} is {r!r}, not a finite number")
            out.append(float(r))
        return out

    async def aclose(self) -> None:
        """Close this event loop's connections."""
        st = self._loops.pop(asyncio.get_running_loop(), None)
        if st is not None:
            if st.pending:
                self._flush(st)
            if st.tasks:
                await asyncio.gather(*st.tasks, return_exceptions=True)
            await st.client.aclose()
