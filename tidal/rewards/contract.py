"""The reward contract: what a reward sees, how it is named in config, what comes back.

One contract, several adapters (`form`), chosen by config and never guessed from a
signature:

- `tidal`: `fn(completion, **columns) -> float | dict[str, float]` per sample; it may also
  accept `prompt`, `prompt_messages`, `completion_ids`, `messages`, `turns`, `episode_id`,
  `task_id` as keyword arguments (given when its signature names them or takes **kwargs);
- `trl`: `fn(prompts, completions, completion_ids, **columns) -> list[float | None]`, called
  once per group (the samples of one prompt), every column as a list (TRL's convention:
  conversational prompts are message lists and completions `[{"role": "assistant", ...}]`);
  None: no reward for that sample (the episode ends `reward_error`, it is not scored 0);
- `verl`: `compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict`
  per sample, `ground_truth` read from the row's `reward_model.ground_truth` (veRL parquet);
  a dict gives its `score`, its other numbers become metrics;
- each may be `async def`.

A reward returns a float or a dict of parts whose sum is the reward; a part named `correct`
defines accuracy. Several rewards combine with weights, each logged as a part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Form = Literal["tidal", "trl", "verl"]
OutcomeStatus = Literal["ok", "reward_error", "timeout"]


class RewardParts(dict):
    """A reward's parts (a dict, as a plain reward returns) that also carries `metrics`: how
    the reward was reached (a judge's injection flag, a cache hit). The metrics reach the
    episode's metrics; only the parts add up to the reward."""

    def __init__(self, parts: dict[str, float], metrics: dict[str, float] | None = None):
        super().__init__(parts)
        self.metrics = dict(metrics or {})

    def __reduce__(self):  # crosses process boundaries with its metrics
        return (RewardParts, (dict(self), self.metrics))


@dataclass
class RewardInput:
    """Everything a reward may look at, for one episode. Plain data: crosses processes."""

    episode_id: str
    group_id: str
    task_id: str
    step: int
    prompt: str  # the rendered prompt, as the policy saw it (special tokens included)
    prompt_messages: list[dict[str, Any]]
    completion: str  # the text of the last policy turn (special tokens skipped)
    completion_ids: list[int]  # every policy token of the episode, in order
    messages: list[dict[str, Any]]  # the whole conversation, the last policy turn included
    turns: list[dict[str, Any]]  # per turn: index, text, finish_reason, reward, tool_calls
    columns: dict[str, Any]  # the dataset row's columns other than `prompt`


@dataclass
class RewardOutcome:
    """The typed result of scoring one episode. `status` ok: `reward` is finite and equals
    the sum of `parts`; otherwise `reward` is NaN and `error` says what happened, naming the
    function and the episode."""

    status: OutcomeStatus
    reward: float = float("nan")
    parts: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""


class Scorer(Protocol):
    """Scores episodes with the configured rewards. `score` takes the inputs of one group
    (or one episode) and returns one outcome per input, in order; it never raises for a
    failure of user code (that is an outcome) and never waits past its timeout."""

    async def score(self, inputs: list[RewardInput]) -> list[RewardOutcome]: ...

    async def close(self) -> None: ...
