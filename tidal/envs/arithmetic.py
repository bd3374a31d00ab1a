"""The default verifiable task: multi-digit integer arithmetic.

Problems are drawn from a seed. The held-out split is a fixed slice of the problem space
(a problem belongs to it when a hash of its text falls in one bucket of ten), so train and
held-out never share a problem whatever the seeds and sizes.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

HELD_OUT_BUCKETS = 10


class ArithmeticConfig(BaseModel):
    """The problem distribution of the arithmetic task."""

    model_config = ConfigDict(extra="forbid")

    min_digits: int = Field(2, ge=1, le=9, description="Fewest digits of an operand.")
    max_digits: int = Field(2, ge=1, le=9, description="Most digits of an operand.")
    ops: str = Field("+-", pattern=r"^[+\-*]+$", description="Operators to draw from.")


def _is_held_out(text: str) -> bool:
    return hashlib.sha256(text.encode()).digest()[0] % HELD_OUT_BUCKETS == 0


def question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


def answer_text(value: int) -> str:
    return f"<answer>{value}</answer>"


def _operand(rng: random.Random, cfg: ArithmeticConfig) -> int:
    digits = rng.randint(cfg.min_digits, cfg.max_digits)
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def _digits(x: int, n: int) -> list[int]:
    return [(x // 10**i) % 10 for i in range(n)]


def buggy_answer(a: int, op: str, b: int) -> int:
    """The answer of a student with two classic bugs (Brown & Burton's BUGGY, 1978):
    addition that never carries (the leading column is written out whole), and
    subtraction that takes the smaller digit from the larger in every column — which
    never borrows and never gives a negative result. Used for imperfect warm-start
    demonstrations."""
    n = max(len(str(a)), len(str(b)))
    da, db = _digits(a, n), _digits(b, n)
    if op == "+":
        digits = [(x + y) % 10 for x, y in zip(da, db)]
        digits[-1] = da[-1] + db[-1]
    elif op == "-":
        digits = [abs(x - y) for x, y in zip(da, db)]
    else:
        return a * b
    return sum(d * 10**i for i, d in enumerate(digits))


def worked_answer(a: int, op: str, b: int) -> str:
    """A careful, worked answer by place value: 47 + 38 → `40+30+7+8=70+15=<answer>85</answer>`,
    38 - 52 → `30-50+8-2=-20+6=<answer>-14</answer>`."""
    ta, ua, tb, ub = a - a % 10, a % 10, b - b % 10, b % 10
    value = a + b if op == "+" else a - b if op == "-" else a * b
    if op == "+":
        work = f"{ta}+{tb}+{ua}+{ub}={ta + tb}+{ua + ub}="
    elif op == "-":
        work = f"{ta}-{tb}+{ua}-{ub}={ta - tb}{ua - ub:+d}="
    else:
        work = ""
    return work + answer_text(value)


def make_problems(cfg: ArithmeticConfig, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` distinct rows of `split` ("train" or "test"): prompt, answer, task_id."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if cfg.min_digits > cfg.max_digits:
        raise ValueError(f"min_digits ({cfg.min_digits}) > max_digits ({cfg.max_digits})")
    rng = random.Random(f"arith-{split}-{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(n * 50 + 10_000):
        if len(rows) == n:
            break
        a, b, op = _operand(rng, cfg), _operand(rng, cfg), rng.choice(cfg.ops)
        text = question(a, op, b)
        if text in seen or _is_held_out(text) != (split == "test"):
            continue
        seen.add(text)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        task_id = "arith-" + hashlib.sha256(text.encode()).hexdigest()[:12]
        rows.append({"prompt": [{"role": "user", "content": text}], "answer": str(value), "task_id": task_id})
    if len(rows) < n:
        raise ValueError(f"could only draw {len(rows)} distinct {split} problems of {n} from {cfg}")
    return rows
