"""The records that flow between roles: generation requests and results, episodes.

They are plain dataclasses of Python scalars and lists (no tensors), so that they cross a
process or a Ray actor boundary cheaply and can be written to Parquet as they are.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    """How an episode ended. Only OK and TRUNCATED episodes are trained on."""

    OK = "ok"
    TRUNCATED = "truncated"
    ENV_ERROR = "env_error"
    REWARD_ERROR = "reward_error"
    TIMEOUT = "timeout"
    ENGINE_ERROR = "engine_error"

    @property
    def trainable(self) -> bool:
        return self in (Status.OK, Status.TRUNCATED)


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples one request. temperature=0 means greedy."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    # Stop strings (e.g. "</tool_call>"): generation ends with the token that completes one;
    # that token is kept (finish_reason "stop"), so the tokens are exactly what was sampled.
    stop: tuple[str, ...] = ()


@dataclass
class GenerationRequest:
    """Token ids in. `request_id` is echoed back so callers can match results. `session_id`
    groups the turns of one episode: a router sends them to the same replica, whose prefix
    cache then holds the conversation so far ("" : the request is its own session)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    session_id: str = ""
    # A vision-language model's images (tidal.images.ImageBlob), one per run of image pads in
    # `prompt_ids`, in order: the prompt holds each image's placeholder already expanded to its
    # run (tidal/models/vision.py); an engine that expands placeholders itself collapses them.
    images: tuple[Any, ...] = ()


@dataclass
class GenerationResult:
    """Token ids and the behaviour log-prob of each sampled token out.

    `logprobs[i]` is log softmax(logits / temperature)[token_ids[i]] (temperature 1 when
    greedy), before top-k/top-p truncation: the same quantity the trainer computes, so the
    two can be compared token by token.

    Weight versions: `token_versions[i]` is the version of the weights whose forward pass
    produced the logits token i was sampled from. An engine that can take new weights in
    the middle of a request (partial rollout) fills it, the built-in torch engine always;
    None means every token was produced by `version`. `version` is the newest version that produced any
    token of this result. Read them through `versions_per_token()`.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token or stop string was produced) | "length"
    version: int  # newest weight version that produced a token of this result
    token_versions: list[int] | None = None  # per token; None: all tokens are `version`'s

    def versions_per_token(self) -> list[int]:
        """The weight version of each token in `token_ids`."""
        if self.token_versions is None:
            return [self.version] * len(self.token_ids)
        return list(self.token_versions)


@dataclass
class ToolCallRecord:
    """One tool call of a policy turn and its outcome. `status`: ok | parse (malformed call)
    | unknown (no such tool) | args (bad arguments) | timeout | raised (the tool raised) |
    limit (past the turn's max_calls_per_turn: not run)."""

    name: str
    arguments: str  # as the policy wrote them (JSON text)
    call_id: str = ""
    status: str = "ok"
    error: str = ""
    output_chars: int = 0  # length of the tool's answer before truncation
    duration_s: float = 0.0
    output: str = ""  # the answer's text as the policy got it (truncated as it was; an error's message)


@dataclass
class Turn:
    """One policy turn of an episode. `start:end` is the span of the turn's generated tokens
    in `Episode.tokens` (every token of the span is on the loss mask, unless a prefix break
    masked it: see `Episode.segments`); `obs_end` ends the observation tokens that followed
    it (tool results, a user reply; `obs_end == end` when nothing followed). `reward` is the
    per-turn reward the environment gave for it; it sits on the turn's last token."""

    index: int
    start: int
    end: int
    obs_end: int
    text: str = ""
    finish_reason: str = ""
    reward: float = 0.0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    version: int = -1  # newest weight version that produced a token of this turn


@dataclass
class Episode:
    """One rollout: the unit that goes to the trainer and to disk (docs/architecture.md, "Data")."""

    episode_id: str
    group_id: str
    task_id: str
    env: str
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 where loss_mask is False
    versions: list[int] = field(default_factory=list)  # -1 where loss_mask is False
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    status: Status = Status.OK
    error: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_len: int = 0
    step: int = 0
    seed: int = 0  # the environment's seed: same seed and same actions, same observations
    turns: list[Turn] = field(default_factory=list)
    # Start offsets in `tokens` of separately trained sequences (docs/architecture.md,
    # "Invariants": rollout.prefix_policy): [0] for an episode whose context grew by appending
    # only. A chat template that re-renders earlier turns differently starts a new segment
    # holding the re-rendered context.
    segments: list[int] = field(default_factory=lambda: [0])
    outcome_reward: float = 0.0  # the reward functions' share of `reward` (the rest: turn rewards)
    # Image ids (tidal.images: content hashes), one per run of image pads in `tokens`, in order;
    # the pictures are in `image_blobs` while the episode is in memory and under RUN/images/ on disk.
    images: list[str] = field(default_factory=list)
    image_blobs: dict[str, Any] = field(default_factory=dict, repr=False)  # id -> ImageBlob; not stored in Parquet
    # The task row's columns but the prompt (the reference answer, tests, metadata), as JSON, cut
    # at REFERENCE_CHARS: what the episode was judged against, beside it in the store.
    reference: str = ""

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    def segment_spans(self) -> list[tuple[int, int]]:
        """(start, end) of each separately trained token sequence."""
        bounds = [*self.segments, len(self.tokens)]
        return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]

    def image_list(self) -> list[Any]:
        """The episode's ImageBlobs in order (one per image run of `tokens`)."""
        return [self.image_blobs[i] for i in self.images]
