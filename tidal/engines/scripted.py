"""A scripted policy behind the Engine protocol: it answers each request with the token ids a
script gives.

It is the fast policy for tests and benchmarks that need every turn known in advance (an
environment driven end to end through a fixed sequence of turns; a million episodes through
the real rollout at no model cost). It is not a model and never pretends to be one: it has
no weights, it reads the prompt only if the script does, and its log-probs are 0.0 (the script
is a deterministic policy: each of its tokens has probability 1 under it).

The script is either a function `policy(request) -> list[int]`, or a list of turns (token-id
lists): the i-th request of a session (`GenerationRequest.session_id`, one per episode in the
rollout; a request without one is its own session) gets turn i. A request past the end of the
script fails with an error naming the session. Memory stays bounded however many episodes
run: at most `max_sessions` sessions in progress are remembered (the one served longest ago
goes first: an episode that ended before the script did) and `max_sessions` finished ones (to
recognise a session that asks again).

Like every engine it honours the request's sampling limits: a turn ends at its first stop
token (kept; finish "stop"), at the token that completes a stop string (`SamplingParams.stop`,
searched in the text with special tokens skipped; needs `tokenizer`, and a request with stop strings but no tokenizer is refused rather than
silently ignored), or after `max_new_tokens` (finish "length"). A script turn that ends on
none of them finishes "length" too: the policy stopped without a stop token. Every token
carries the engine's `version`, which `update_weights` sets (the tensors are not used: the
script is the policy); `pause()` holds new calls until `resume()`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from tidal.engines.base import EngineBase
from tidal.types import GenerationRequest, GenerationResult, SamplingParams

Policy = Callable[[GenerationRequest], Sequence[int]]


class ScriptExhausted(RuntimeError):
    """A session asked for more turns than the script has."""


class ScriptedEngine(EngineBase):
    def __init__(self, policy: Policy | Sequence[Sequence[int]], *, tokenizer=None, latency_s: float = 0.0,
                 max_sessions: int = 1 << 14):
        if callable(policy):
            self._policy: Policy | None = policy
            self._turns: list[list[int]] = []
        else:
            self._policy = None
            self._turns = [[int(t) for t in turn] for turn in policy]
            if not self._turns:
                raise ValueError("ScriptedEngine: the script has no turns")
        if latency_s < 0 or max_sessions < 1:
            raise ValueError(f"ScriptedEngine: latency_s must be >= 0 and max_sessions >= 1 "
                             f"(got {latency_s}, {max_sessions})")
        self.tokenizer = tokenizer
        self.latency_s = latency_s  # awaited once per generate call: a stand-in for generation time
        self.max_sessions = max_sessions
        self._version = 0
        self._sessions: OrderedDict[str, int] = OrderedDict()  # in progress: session → turns served so far
        self._finished: OrderedDict[str, None] = OrderedDict()  # had the script's last turn
        self._running = threading.Event()
        self._running.set()
        self.calls = 0  # generate calls served
        self.requests = 0  # requests answered

    @classmethod
    def from_texts(cls, tokenizer, turns: Sequence[str], stop_token_id: int | None = None, **kw) -> ScriptedEngine:
        """A script of text turns, each tokenized (no special tokens added) and, when
        `stop_token_id` is given, ended with it (the end-of-turn token a model would write)."""
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + ([stop_token_id] if stop_token_id is not None
                                                                      else []) for t in turns]
        return cls(ids, tokenizer=tokenizer, **kw)

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, version: int, tensors: Mapping) -> None:
        """Take the version (later tokens carry it); the script itself does not change."""
        self._version = version

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if not self._running.is_set():
            await asyncio.to_thread(self._running.wait)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        self.calls += 1
        self.requests += len(requests)
        return [self._answer(r) for r in requests]

    def _script_turn(self, r: GenerationRequest) -> list[int]:
        if self._policy is not None:
            return [int(t) for t in self._policy(r)]
        session = r.session_id or r.request_id
        if session in self._finished:
            raise ScriptExhausted(f"scripted engine: request {r.request_id} asks session `{session}` for a turn "
                                  f"after its last: the script has {len(self._turns)} turns")
        turn = self._sessions.pop(session, 0)
        _remember(self._sessions if turn + 1 < len(self._turns) else self._finished, session, turn + 1,
                  self.max_sessions)
        return self._turns[turn]

    def _answer(self, r: GenerationRequest) -> GenerationResult:
        p = r.params
        if p.stop and self.tokenizer is None:
            raise ValueError(f"scripted engine: request {r.request_id} asks for stop strings {list(p.stop)} "
                             "but the engine has no tokenizer to find them (ScriptedEngine(..., tokenizer=))")
        tokens = _cut(self._script_turn(r), p, self.tokenizer)
        stopped = bool(tokens) and (tokens[-1] in p.stop_token_ids or _has_stop_string(tokens, p, self.tokenizer))
        return GenerationResult(r.request_id, tokens, [0.0] * len(tokens), "stop" if stopped else "length",
                                self._version)


def _remember(d: OrderedDict, key: str, value, cap: int) -> None:
    d[key] = value  # newest last; beyond the cap the oldest go first
    while len(d) > cap:
        d.popitem(last=False)


def _cut(tokens: list[int], p: SamplingParams, tokenizer) -> list[int]:
    """The script's turn as an engine would end it: first stop token, first completed stop
    string, or max_new_tokens, whichever comes first."""
    tokens = tokens[: max(p.max_new_tokens, 0)]
    for i, t in enumerate(tokens):
        if t in p.stop_token_ids:
            tokens = tokens[: i + 1]
            break
    if p.stop and _has_stop_string(tokens, p, tokenizer):
        for i in range(1, len(tokens) + 1):  # the shortest prefix that completes a stop string
            if _has_stop_string(tokens[:i], p, tokenizer):
                return tokens[:i]
    return tokens


def _has_stop_string(tokens: list[int], p: SamplingParams, tokenizer) -> bool:
    """A stop string in the text of `tokens`, special tokens skipped (every engine's contract)."""
    if not p.stop:
        return False
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return any(s in text for s in p.stop)
