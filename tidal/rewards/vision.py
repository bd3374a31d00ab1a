"""Reward of the image tasks (tidal/envs/image_tasks.py): the exact answer plus a small part for
the format, in the convention of tidal/rewards/arithmetic.py.

The answer is a word or a number in `<answer>...</answer>`; it is compared case-insensitively
after trimming spaces, so `<answer> Red </answer>` is red. The last answer tag counts (a
multi-turn task scores its final turn).
"""

from __future__ import annotations

import re

ANSWER_RE = re.compile(r"<answer>\s*([^<]*?)\s*</answer>")
STRICT_RE = re.compile(r"^[^<]*<answer>[^<\s][^<]*</answer>\s*$")
FORMAT_WEIGHT = 0.1


def extract_answer(completion: str) -> str | None:
    """The text of the last `<answer>` tag, trimmed and lower-cased; None without one."""
    found = ANSWER_RE.findall(completion)
    return found[-1].strip().lower() if found else None


def score(completion: str, answer: str | int) -> dict[str, float]:
    """correct: 1 when the last tagged answer equals `answer` (case and surrounding spaces
    aside); format: 0.1 when the completion ends with its one `<answer>...</answer>` and holds no
    other tag (no leftover tool call)."""
    got = extract_answer(completion)
    correct = got is not None and got == str(answer).strip().lower()
    return {"correct": float(correct), "format": FORMAT_WEIGHT * float(bool(STRICT_RE.match(completion)))}
