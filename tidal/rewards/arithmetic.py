"""Reward of the arithmetic task: exact answer plus a small part for the format."""

from __future__ import annotations

import re

ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
STRICT_RE = re.compile(r"^[^<]*<answer>-?\d+</answer>\s*$")
FORMAT_WEIGHT = 0.1


def extract_answer(completion: str) -> str | None:
    m = ANSWER_RE.search(completion)
    return m.group(1) if m else None


def score(completion: str, answer: str) -> dict[str, float]:
    """correct: 1 when the tagged integer equals `answer`; format: 0.1 when the completion
    ends with its one `<answer>N</answer>` (working may come before it, nothing after)."""
    got = extract_answer(completion)
    correct = got is not None and int(got) == int(answer)
    return {"correct": float(correct), "format": FORMAT_WEIGHT * float(bool(STRICT_RE.match(completion)))}
