"""tool_arith: arithmetic too large to do in the head, with a `calculator` tool.

Problems are 3–4-digit multiplications and multi-step expressions (`(347 * 28) - 1592`,
`(512 + 389) * 47`): a tiny model cannot compute them token by token, but it can copy the
expression into a calculator call and the result into its answer. The final turn answers
`<answer>N</answer>`; `score` checks it.

Splits come from a seed, and a problem belongs to the held-out split when a hash of its text
falls in one bucket of ten (as tidal/envs/arithmetic.py does), so train and held-out never
share a problem whatever the seeds and sizes.

The calculator evaluates with `ast`, never `eval`: only integer literals, + - * /, unary
signs and parentheses, at most `MAX_EXPRESSION_CHARS` characters, every intermediate value
bounded by `MAX_ABS`; division is exact (fractions).
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from fractions import Fraction
from typing import Any, ClassVar

from tidal.envs.tool_env import ToolEnv

HELD_OUT_BUCKETS = 10
MAX_EXPRESSION_CHARS = 200
MAX_ABS = 10**30
KINDS = ("mul", "mul_sub", "mul_add", "add_mul")
SYSTEM_PROMPT = "Solve the problem. End with <answer>N</answer>."
FORMAT_WEIGHT = 0.1

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        value = -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.BinOp) and type(node.op) in (*_OPS, ast.Div):
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise ValueError("division by zero")
            value = a / b
        else:
            value = _OPS[type(node.op)](a, b)
    else:
        what = type(node).__name__
        if isinstance(node, ast.Constant):
            what = f"the literal {node.value!r}"
        raise ValueError(f"{what} is not allowed (only integers, + - * / and parentheses)")
    if abs(value) > MAX_ABS:
        raise ValueError(f"a value exceeds {MAX_ABS:.0e} in magnitude")
    return value


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ValueError when it is not one."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"not an arithmetic expression: {getattr(e, 'msg', e)}") from None
    return _eval(tree.body)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: integers with + - * / and parentheses, e.g. (12 + 3) * 4
    """
    value = evaluate(expression)
    if value.denominator == 1:
        return str(value.numerator)
    return format(float(value), ".10g")


def _is_held_out(text: str) -> bool:
    return hashlib.sha256(text.encode()).digest()[0] % HELD_OUT_BUCKETS == 0


def _num(rng: random.Random, lo_digits: int, hi_digits: int) -> int:
    d = rng.randint(lo_digits, hi_digits)
    return rng.randint(10 ** (d - 1), 10**d - 1)


def make_expression(rng: random.Random, kind: str) -> str:
    if kind == "mul":
        return f"{_num(rng, 3, 4)} * {_num(rng, 2, 3)}"
    if kind == "mul_sub":
        return f"({_num(rng, 3, 3)} * {_num(rng, 2, 2)}) - {_num(rng, 3, 4)}"
    if kind == "mul_add":
        return f"({_num(rng, 3, 3)} * {_num(rng, 2, 2)}) + {_num(rng, 3, 4)}"
    if kind == "add_mul":
        return f"({_num(rng, 3, 3)} + {_num(rng, 3, 3)}) * {_num(rng, 2, 2)}"
    raise ValueError(f"tool_arith: unknown problem kind {kind!r} (kinds: {', '.join(KINDS)})")


def question(expression: str) -> str:
    return f"What is {expression}?"


def make_rows(split: str, n: int, seed: int, kinds: tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
    """`n` distinct problems of `split` ("train" or "test"): prompt, answer, expression, kind, task_id."""
    if split not in ("train", "test"):
        raise ValueError(f"tool_arith: split must be 'train' or 'test', got {split!r}")
    for k in kinds:
        make_expression(random.Random(0), k)  # an unknown kind is named before any drawing
    rng = random.Random(f"tool-arith-{split}-{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(n * 50 + 10_000):
        if len(rows) == n:
            break
        kind = rng.choice(kinds)
        expr = make_expression(rng, kind)
        text = question(expr)
        if text in seen or _is_held_out(text) != (split == "test"):
            continue
        seen.add(text)
        value = evaluate(expr)
        rows.append({"prompt": [{"role": "user", "content": text}], "answer": str(value.numerator),
                     "expression": expr, "kind": kind,
                     "task_id": "toolarith-" + hashlib.sha256(text.encode()).hexdigest()[:12]})
    if len(rows) < n:
        raise ValueError(f"tool_arith: could only draw {len(rows)} distinct {split} problems of {n}")
    return rows


ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
STRICT_RE = re.compile(r"^[^<]*<answer>-?\d+</answer>\s*$")


def score(completion: str, answer: str | int) -> dict[str, float]:
    """correct: 1 when the last `<answer>N</answer>` of the final turn equals `answer`;
    format: 0.1 when the turn ends with its one answer tag and holds no other tag (no
    leftover tool call)."""
    found = ANSWER_RE.findall(completion)
    correct = bool(found) and int(found[-1]) == int(answer)
    return {"correct": float(correct), "format": FORMAT_WEIGHT * float(bool(STRICT_RE.match(completion)))}


class ToolArithEnv(ToolEnv):
    """`ToolArithEnv(row, seed, **env_args)`: the row's question, a calculator, until an answer."""

    name: ClassVar[str] = "tool_arith"
    tool_functions = (calculator,)
    default_system_prompt = SYSTEM_PROMPT
    default_reward: ClassVar[str] = "tidal.envs.tool_arith:score"

    @classmethod
    def rows(cls, split: str, n: int, seed: int, kinds: list[str] | tuple[str, ...] = KINDS) -> list[dict[str, Any]]:
        """The built-in task's rows (`env_args.kinds` picks problem kinds; the other env_args are
        ToolEnv's, given to the constructor: tidal/runtime/tasks.py splits them)."""
        return make_rows(split, n, seed, tuple(kinds))
