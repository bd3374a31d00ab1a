"""Rewards on the completion's text itself: a format pattern, a length penalty, a repetition penalty.

Each is a small class configured by `task.rewards[].args` and combined with a task's own
reward, each logged as a part under its spec's name:

    task.rewards:
      - {fn: tidal.rewards.math:score}
      - {fn: tidal.rewards.text:RegexReward, name: think_format, args: {pattern: "^<think>.*</think>", weight: 0.2}}
      - {fn: tidal.rewards.text:LengthPenalty, args: {target: 256, max_penalty: 0.5}}
      - {fn: tidal.rewards.text:RepetitionPenalty, args: {n: 4, weight: 1.0}}

They return a float (never a `correct` part: they are not what accuracy measures). Lengths
count tokens when the reward is given the completion's token ids, else characters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

Unit = Literal["auto", "tokens", "chars", "words"]
_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


class RegexReward:
    """`weight` when the completion matches `pattern`, else 0.

    mode: `search` (anywhere), `match` (at the start) or `fullmatch` (the whole completion,
    surrounding whitespace stripped when `strip`). flags: letters of i, m, s, x.
    """

    def __init__(self, pattern: str, weight: float = 1.0, *, mode: Literal["search", "match", "fullmatch"] = "search",
                 flags: str = "", strip: bool = True):
        if mode not in ("search", "match", "fullmatch"):
            raise ValueError(f"RegexReward(mode={mode!r}): choose search, match or fullmatch")
        unknown = set(flags) - set(_FLAGS)
        if unknown:
            raise ValueError(f"RegexReward(flags={flags!r}): unknown flag(s) {sorted(unknown)}; use {''.join(_FLAGS)}")
        try:
            self.regex = re.compile(pattern, sum((_FLAGS[f] for f in set(flags)), 0))
        except re.error as e:
            raise ValueError(f"RegexReward(pattern={pattern!r}) is not a regular expression: {e}") from None
        self.weight = float(weight)
        self.mode = mode
        self.strip = strip

    def __call__(self, completion: str) -> float:
        text = completion.strip() if self.strip else completion
        return self.weight * float(getattr(self.regex, self.mode)(text) is not None)


def _length(completion: str, completion_ids: Sequence[int] | None, unit: Unit) -> int:
    if unit == "tokens" and completion_ids is None:
        raise ValueError("unit='tokens' needs the completion's token ids (completion_ids), which were not given")
    if unit == "tokens" or (unit == "auto" and completion_ids is not None):
        return len(completion_ids)
    if unit == "words":
        return len(completion.split())
    return len(completion)


class LengthPenalty:
    """A penalty growing linearly past a length bound:

        penalty = -min(max_penalty, max(0, L - target) / scale)

    L is the completion's length in `unit`: tokens (`completion_ids`, every policy token of
    the episode) when given or asked for, else characters (`auto`); or `chars`, `words`.
    `scale` defaults to `target`: twice the target costs 1 (capped at `max_penalty`).
    Completions at or under `target` get 0.
    """

    def __init__(self, target: int, scale: float | None = None, max_penalty: float = 1.0, unit: Unit = "auto"):
        if target < 0:
            raise ValueError(f"LengthPenalty(target={target}) must be >= 0")
        if unit not in ("auto", "tokens", "chars", "words"):
            raise ValueError(f"LengthPenalty(unit={unit!r}): choose auto, tokens, chars or words")
        self.target = target
        self.scale = float(scale if scale is not None else max(target, 1))
        if self.scale <= 0:
            raise ValueError(f"LengthPenalty(scale={scale}) must be > 0")
        self.max_penalty = float(max_penalty)
        self.unit = unit

    def __call__(self, completion: str, completion_ids: Sequence[int] | None = None) -> float:
        excess = max(0, _length(completion, completion_ids, self.unit) - self.target)
        return -min(self.max_penalty, excess / self.scale)


def repetition_ratio(items: Sequence, n: int) -> float:
    """Share of the n-grams of `items` that repeat an earlier one: 1 - distinct / total
    (0 when there are fewer than n items)."""
    total = len(items) - n + 1
    if total <= 0:
        return 0.0
    distinct = len({tuple(items[i:i + n]) for i in range(total)})
    return 1.0 - distinct / total


class RepetitionPenalty:
    """penalty = -weight * repetition_ratio(units, n), the share of repeated n-grams.

    units: words (whitespace-split) by default; `tokens` uses `completion_ids` (or
    `auto`: tokens when given, else words); `chars` uses characters. A text that says
    one thing once gets 0; one line repeated k times approaches -weight * (1 - 1/k).
    """

    def __init__(self, n: int = 3, weight: float = 1.0, unit: Unit = "words"):
        if n < 1:
            raise ValueError(f"RepetitionPenalty(n={n}) must be >= 1")
        if unit not in ("auto", "tokens", "chars", "words"):
            raise ValueError(f"RepetitionPenalty(unit={unit!r}): choose auto, tokens, chars or words")
        self.n = n
        self.weight = float(weight)
        self.unit = unit

    def __call__(self, completion: str, completion_ids: Sequence[int] | None = None) -> float:
        if self.unit == "tokens" and completion_ids is None:
            raise ValueError("RepetitionPenalty(unit='tokens') needs completion_ids, which were not given")
        if self.unit == "tokens" or (self.unit == "auto" and completion_ids is not None):
            items: Sequence = list(completion_ids)
        elif self.unit == "chars":
            items = completion
        else:
            items = completion.split()
        return -self.weight * repetition_ratio(items, self.n)
