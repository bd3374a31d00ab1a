"""Two things math-verify does not do safely for a reward: bound what a parsed answer costs
before anything evaluates it, and compare exact numbers exactly.

**Cost, before it runs.** `cost_refusal(expr, bounds)` walks math-verify's unevaluated parse
(it never calls `abs`, `evalf` or a comparison on a node: those evaluate, and on a tower like
`9^{9^{9^9}}` that is what hung) and estimates from the literals alone an upper bound on the
digits of every number: an integer's from its bit length, `b^e` as digits(b) x value(e),
`n!` and `Gamma(n)` as n log10 n, `binomial(n, k)` as min(n log10 2, k log10 n), a sum or
product over a range as its length. A node count over `max_nodes`, a number over `max_digits`
digits, a symbolic power over `max_symbolic_exponent`, a sum or product over more than
`max_terms` terms, an integral or limit: refused with the reason, in microseconds.

**Exact numbers.** math-verify compares numbers with a float rounding (6 decimal places: it
credits 0.1234568 for 0.1234567) and an evalf of the difference chopped at 15 digits (it
credits 1/30! for 2/30!). `numbers_equal` decides instead, for two numbers without free
symbols: exact values (integers, rationals, radicals, pi, factorials) are equal only when their
difference is zero (rationals, factorials and powers evaluated exactly, which the cost bounds
keep cheap; irrationals: |a - b| <= 10^-40 min(1, |a|), evaluated with 60 digits more than the
numbers have); a decimal answer against an exact reference within `rel_tol` (relative); a
decimal reference with d decimal places is matched by an answer that rounds to it at d places.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

_INF = float("inf")


@dataclass(frozen=True)
class Bounds:
    """What a parsed answer may hold before its comparison is refused as too costly."""

    max_nodes: int = 2000
    max_digits: float = 10_000
    max_symbolic_exponent: int = 1000
    max_terms: int = 10_000


def cost_refusal(expr: Any, bounds: Bounds) -> str:
    """Why comparing `expr` would cost too much ("" when it would not)."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return ""
    for count, _ in enumerate(sympy.preorder_traversal(expr), 1):
        if count > bounds.max_nodes:
            return f"too_costly: more than {bounds.max_nodes} nodes"
    try:
        digits = _digits(expr, bounds)
    except _Refused as e:
        return f"too_costly: {e}"
    if digits > bounds.max_digits:
        return f"too_costly: a number of about {_fmt(digits)} digits (max_digits={bounds.max_digits:g})"
    return ""


class _Refused(Exception):
    pass


def _fmt(x: float) -> str:
    return "infinitely many" if x == _INF else f"{x:.3g}"


def _value(expr: Any, bounds: Bounds) -> float:
    """An upper bound on |expr| for a numeric node, as a float (inf when beyond 1e300)."""
    import sympy

    if isinstance(expr, sympy.Rational) and int(expr.p).bit_length() < 900 and int(expr.q).bit_length() < 900:
        return abs(int(expr.p)) / int(expr.q)  # 1/10^9 as an exponent is small, not nine digits
    d = _digits(expr, bounds)
    return _INF if d > 300 else 10.0 ** d


def _digits(expr: Any, bounds: Bounds) -> float:
    """An upper bound on the decimal digits (log10 of the size) of any number `expr` evaluates
    to, from its literals, without evaluating it. Symbols count as 1 digit."""
    import sympy

    if isinstance(expr, sympy.Integer):
        return max(1.0, int(expr).bit_length() * 0.30103)
    if isinstance(expr, sympy.Rational):
        return max(1.0, (int(expr.p).bit_length() + int(expr.q).bit_length()) * 0.30103)
    if isinstance(expr, sympy.Float):
        _, e = math.frexp(float(expr)) if math.isfinite(float(expr)) else (1.0, 0)
        return 1.0 + abs(e) * 0.30103 + expr._prec * 0.30103
    if isinstance(expr, (sympy.Symbol, sympy.NumberSymbol, sympy.core.numbers.ImaginaryUnit)) or not expr.args:
        return 1.0
    if isinstance(expr, (sympy.Integral, sympy.Limit, sympy.Derivative)):
        raise _Refused(f"an unevaluated {type(expr).__name__.lower()}")
    if isinstance(expr, sympy.Pow):
        base, exp = expr.args
        if exp.free_symbols:
            return _digits(base, bounds) + _digits(exp, bounds)
        e = _value(exp, bounds)
        if base.free_symbols:
            if e > bounds.max_symbolic_exponent:
                raise _Refused(f"a symbolic power above {bounds.max_symbolic_exponent} (max_symbolic_exponent)")
            return _digits(base, bounds) * max(1.0, e)
        return _digits(base, bounds) * max(1.0, e) if e != _INF else _INF
    if isinstance(expr, (sympy.exp, sympy.sinh, sympy.cosh)):  # e^x: x log10(e) digits
        (arg,) = expr.args
        return _digits(arg, bounds) if arg.free_symbols else max(1.0, _value(arg, bounds) * 0.4343)
    if isinstance(expr, (sympy.factorial, sympy.gamma, sympy.factorial2, sympy.RisingFactorial,
                         sympy.FallingFactorial, sympy.subfactorial)):
        n = max(_value(a, bounds) for a in expr.args)
        return _INF if n > 1e12 else max(1.0, n * math.log10(max(n, 2.0)))
    if isinstance(expr, sympy.binomial):
        n, k = (_value(a, bounds) for a in expr.args)
        return _INF if min(n, k) > 1e12 else max(1.0, min(n * 0.30103, k * math.log10(max(n, 2.0))))
    if isinstance(expr, (sympy.Sum, sympy.Product)):
        terms = 1.0
        for limit in expr.limits:
            if len(limit) == 3 and not (limit[1].free_symbols or limit[2].free_symbols):
                terms *= _value(limit[2], bounds) + _value(limit[1], bounds) + 1
        if terms > bounds.max_terms:
            raise _Refused(f"a {type(expr).__name__.lower()} of more than {bounds.max_terms} terms (max_terms)")
        inner = _digits(expr.function, bounds)
        return inner * terms if isinstance(expr, sympy.Product) else inner + math.log10(terms + 1)
    # Add, Mul, functions, containers, relations: at most the sum of their parts' digits.
    total = 0.0
    for a in expr.args:
        if isinstance(a, sympy.Basic):
            total += _digits(a, bounds)
            if total == _INF:
                return _INF
    return total


# -- exact comparison ------------------------------------------------------------------------
def plain_number(expr: Any) -> bool:
    """Whether `expr` is one number (no free symbols, no set, relation or container)."""
    import sympy

    return isinstance(expr, sympy.Expr) and not isinstance(expr, sympy.MatrixBase) and not expr.free_symbols \
        and expr.is_number is True


def has_float(expr: Any) -> bool:
    import sympy

    return any(isinstance(a, sympy.Float) for a in sympy.preorder_traversal(expr))


def numbers_equal(gold: Any, given: Any, rel_tol: float, gold_decimals: int | None) -> bool:
    """Whether two plain numbers (see `plain_number`) are equal under the rules above.
    `gold_decimals`: the decimal places of a reference written as a decimal (None otherwise)."""
    import sympy

    given = _percent(given)
    gold = _percent(gold)
    if gold_decimals is not None:
        g = sympy.N(given, 60)
        if not g.is_real:
            return False
        q = Decimal(1).scaleb(-gold_decimals)
        return Decimal(str(g)).quantize(q, ROUND_HALF_EVEN) == Decimal(str(sympy.N(gold, 60))).quantize(
            q, ROUND_HALF_EVEN)
    if has_float(given) or has_float(gold):
        a, b = sympy.N(gold, 30), sympy.N(given, 30)
        return bool(abs(a - b) <= rel_tol * max(abs(a), abs(b)))
    # Bounded by cost_refusal: at most max_digits digits, so evaluating exactly is cheap.
    gold, given = gold.doit(), given.doit()
    if gold.is_finite is False or given.is_finite is False:  # oo, -oo, zoo: equal only as themselves
        return bool(gold == given)
    if isinstance(gold, sympy.Rational) and isinstance(given, sympy.Rational):
        return bool(gold == given)
    # Irrational: the difference to 40 digits past the decimal point (or, below 1, 40 significant
    # digits), evaluated with as many digits as the numbers have plus 60.
    size = sympy.N(sympy.Max(sympy.Abs(gold), sympy.Abs(given)), 15)
    if not size.is_finite:
        return False
    digits = 60 + max(0, int(sympy.log(size, 10).evalf(15)) + 1 if size > 1 else 0)
    diff = sympy.N(gold - given, digits)
    try:
        return bool(abs(diff) <= sympy.Float(10, digits) ** -40 * min(1, size))
    except TypeError:  # a complex difference that did not resolve
        return False


def _percent(expr: Any) -> Any:
    """math-verify reads `50\\%` as 50 times an unevaluated 1/100: evaluated here."""
    import sympy

    return expr.replace(lambda e: isinstance(e, sympy.UnevaluatedExpr), lambda e: e.args[0]) \
        if isinstance(expr, sympy.Basic) else expr
