"""Math answers checked with math-verify: is the completion's final answer equal to the row's?

    task.reward: tidal.rewards.math:score
    task.rewards: [{fn: tidal.rewards.math:MathReward, args: {answer_column: solution_answer}}]

The choice: the answer must be *given as an answer*, must name *one* value, and every answer
given must be right. The final answers are the completion's `\\boxed{...}` (and `\\fbox{...}`)
contents, its `<answer>...</answer>` tags, and a final-answer phrase on its last non-empty line
("The answer is X", "Final answer: X", "Answer: X", "#### X"); a final answer *stated*
anywhere else ("the answer is $5$") must agree with them. No number is fished out of free
text, which is what math-verify's own `parse` does with a whole completion (the last number
wins): a completion that only scatters numbers through a ramble has no answer and scores 0.

math-verify is lenient by design, and a reward-maximizing policy turns leniency into hedges,
so each answer goes through tidal's own steps around it, each refusal recorded in the
metrics as `math/refused/<reason>`: split into candidates and units (math_forms.py: several
values in one box, a relation chain, `\\pm`, prose in `\\text{...}`, a command math-verify
would drop, a unit other than the reference's); parsed as a whole (a text math-verify reads
only in part is refused); bounded in cost from the unevaluated parse (math_exact.py); compared
exactly where both are numbers (math_exact.py), else by math-verify with a float rounding as
tight as `rel_tol`. Several different final answers score 0, as do an empty answer and one that
is too costly to check.

Parts: `correct` (1 or 0) and `format` (`format_weight`, 0.1 by default, as the
arithmetic task's exact-match reward gives: the comparison of the two on that task is
fair): the completion has exactly one final answer, math-verify can parse it, and the
completion ends with it. Metrics (not reward): `math/no_answer`, `math/several_answers`,
`math/refused/<reason>`.

Bounds, before each step runs: an answer longer than `max_answer_chars` or nesting brackets
deeper than `max_nesting` (the LaTeX parser's time grows steeply with depth) is wrong
unparsed; a parsed answer over the cost bounds is wrong before any evaluation. In a process's
main thread the parse and comparison are also bounded by `timeout_s` (math_deadline.py); in
another thread (tidal's reward workers run synchronous rewards in a thread of their own)
math-verify cannot be interrupted, and the bounds, then the reward pool's hard per-call
timeout (`reward.timeout_s`), are the guard.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidal.rewards.contract import RewardParts
from tidal.rewards.math_deadline import OutOfTime, deadline
from tidal.rewards.math_exact import Bounds, cost_refusal, numbers_equal, plain_number
from tidal.rewards.math_forms import RELATION, SPLIT, candidates, honest_forms, is_unit, split_top, unit_of

# (Importing this module binds it as `tidal.rewards.math`: the package's __init__ imports no
# `math` of its own, so nothing there is shadowed.)
EXTRACTORS = ("boxed", "answer_tag", "final_line")
BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# On the last non-empty line: "the (final) answer is X", "answer: X", "#### X" (GSM8K); the
# last such phrase of the line counts ("Final Answer: the final answer is 5").
# Markdown emphasis around the phrase or the answer ("**Final Answer:** 5") is not part of it.
FINAL_PHRASE_RE = re.compile(r"\banswer\b[*_]*\s*(?:is\b|:|=)[*_]*|^\s*####", re.IGNORECASE)
INTEGER_RE = re.compile(r"[+-]?\d+")
BOX_UNIT_RE = re.compile(r"[ \t$]*(?:\\[,;: ])*\s*(?:\\(?:text|mathrm|mbox)\{([^{}]{1,30})\}|([A-Za-z][A-Za-z/]{0,20}))")
# After a final answer the completion may close its math and emphasis, and end its sentence.
TRAILER_RE = re.compile(r"(?:\s|\$|\\\]|\\\)|\.|\*|_)*")


@dataclass(frozen=True)
class Answer:
    """One final answer found in a completion: how it was given, its text, where it is."""

    kind: str  # "boxed", "answer_tag" or "final_line"
    text: str
    start: int
    end: int  # index just past its closing brace / tag / line


def _braced(text: str, open_brace: int) -> int | None:
    """Index of the brace closing the one at `open_brace` (escaped braces skipped), or None."""
    depth = 0
    i = open_brace
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def find_answers(completion: str, extract: Sequence[str] = EXTRACTORS) -> list[Answer]:
    """Every final answer of `completion` in the places `extract` names, in text order."""
    found: list[Answer] = []
    if "boxed" in extract:
        for m in BOXED_RE.finditer(completion):
            close = _braced(completion, m.end() - 1)
            if close is not None and not any(a.start < m.start() < a.end for a in found):  # not a nested box
                # A unit written just after the box (`\\boxed{2} minutes`) is part of the answer.
                unit = BOX_UNIT_RE.match(completion, close + 1)
                word = unit and (unit.group(1) or unit.group(2))
                text = completion[m.end():close] + (f" \\text{{{word}}}" if word and is_unit(word) else "")
                found.append(Answer("boxed", text, m.start(), close + 1))
    if "answer_tag" in extract:
        found += [Answer("answer_tag", m.group(1), m.start(), m.end()) for m in TAG_RE.finditer(completion)]
    if "final_line" in extract:
        stripped = completion.rstrip()
        line_start = stripped.rfind("\n") + 1
        line = stripped[line_start:]
        # A box or tag on that line is already an answer of its own.
        phrases = list(FINAL_PHRASE_RE.finditer(line)) if line and not BOXED_RE.search(line) \
            and not TAG_RE.search(line) else []
        if phrases:
            rest = line[phrases[-1].end():]
            start = line_start + phrases[-1].end() + len(rest) - len(rest.lstrip())
            text = re.split(r"\.\s", rest.strip(), maxsplit=1)[0]  # the sentence that gives it
            emphasis = len(text) - len(text.lstrip("*_"))
            start += emphasis
            text = text.strip("*_").rstrip(".").strip("*_")
            found.append(Answer("final_line", text, start, start + len(text)))
    return sorted(found, key=lambda a: a.start)


def _unwrap(text: str) -> str:
    """The answer without the math delimiters and final period around it."""
    text = text.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right) and len(text) >= len(left) + len(right):
            text = text[len(left):len(text) - len(right)].strip()
    return text


def _nesting(text: str) -> int:
    """Deepest nesting of (), [] and {} in `text` (unbalanced closers ignored)."""
    depth = deepest = 0
    for c in text:
        if c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth = max(0, depth - 1)
    return deepest


# A final answer stated in prose anywhere ("the answer is $5$", "Final answer: 5"): it must agree
# with the box. Its value: a math span, or a number (with a unit word) that ends the clause.
STATEMENT_RE = re.compile(r"(?:\banswer\b[*_]*\s*(?:is\b|:|=)|^[ \t>*_]*####)[*_]*\s*:?\s*", re.IGNORECASE | re.MULTILINE)
STATED_VALUE_RE = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]|"
                             r"([-+\u2212]?\d[\d,]*(?:\.\d+)?(?:/\d+)?(?:\s*\\?%)?(?:\s+[A-Za-z]{1,12})?)"
                             r"(?=\s*(?:[.,;!)]|\n|$))", re.DOTALL)
HYPOTHETICAL_RE = re.compile(r"\b(?:if|suppose|supposing|assume|assuming|whether|check|not|guess|could|might|would|"
                             r"claim|claimed|expected|tempting|wrong|incorrect)\b[^.\n]*$", re.IGNORECASE)


def find_statements(completion: str, answers: list[Answer]) -> list[Answer]:
    """Final answers stated in prose outside the answers already found (a box, a tag, the
    last line's phrase), in text order; hypotheticals ("if the answer is 5") are not answers."""
    out = []
    for m in STATEMENT_RE.finditer(completion):
        v = STATED_VALUE_RE.match(completion, m.end())
        if v is None or completion.startswith(("\\boxed", "\\fbox"), m.end()):
            continue
        sentence = completion[max(0, m.start() - 80):m.start()].rsplit(".", 1)[-1]
        if HYPOTHETICAL_RE.search(sentence):
            continue
        group = next(i for i in range(1, 6) if v.group(i) is not None)
        start, end = v.start(group), v.end(group)
        if any(a.start <= end and start <= a.end for a in answers) or "\\boxed" in v.group(group):
            continue
        out.append(Answer("statement", v.group(group), start, end))
    return out


@dataclass(frozen=True)
class Reference:
    """A reference answer as the comparison needs it (computed once per reference)."""

    parsed: list[Any]
    unit: str | None
    is_list: bool  # a tuple, set, interval or several values: list connectives make one list
    is_equation: bool
    has_pm: bool
    decimals: int | None  # written as a decimal with this many places
    brackets: tuple[str, str]  # around a list reference: a list answer is read inside them


@dataclass(frozen=True)
class Check:
    """One final answer checked: equal to the reference, parsed at all, and why it was
    refused ("" when it was compared)."""

    equal: bool
    parsed: bool
    refused: str = ""


class MathReward:
    """`reward(completion, **columns)` -> {"correct": 0 or 1, "format": 0 or format_weight}.

    answer_column: the row's reference answer (LaTeX or plain: "-36", "\\frac{1}{2}").
    solution_column: used when the row has no answer column: a worked solution whose last
        `\\boxed{}` is the reference (the MATH dataset's form).
    extract: where final answers are looked for, a subset of ("boxed", "answer_tag", "final_line").
    format_weight: the `format` part (0 leaves the part out).
    timeout_s: math-verify's bound on each parse and comparison, in whole seconds (main thread only).
    max_answers / max_answer_chars / max_nesting: more final answers, a longer one, or one
        nesting brackets deeper, score 0 unparsed.
    rel_tol: how far (relative) a decimal answer may be from an exact reference (1e-9: nine
        significant digits); exact values are compared exactly (tidal/rewards/math_exact.py).
    max_digits / max_nodes / max_symbolic_exponent / max_terms: the cost bounds checked on the
        unevaluated parse before any comparison (math_exact.Bounds).
    """

    def __init__(self, answer_column: str = "answer", extract: Sequence[str] = EXTRACTORS, *,
                 solution_column: str | None = "solution", format_weight: float = 0.1, timeout_s: int = 5,
                 max_answers: int = 8, max_answer_chars: int = 400, max_nesting: int = 10, rel_tol: float = 1e-9,
                 max_digits: float = 10_000, max_nodes: int = 2000, max_symbolic_exponent: int = 1000,
                 max_terms: int = 10_000):
        unknown = [e for e in extract if e not in EXTRACTORS]
        if unknown or not extract:
            raise ValueError(f"MathReward(extract={list(extract)!r}): choose from {list(EXTRACTORS)}")
        if int(timeout_s) != timeout_s or timeout_s < 1:
            raise ValueError(f"MathReward(timeout_s={timeout_s!r}): math-verify takes whole seconds, at least 1")
        if not 0 <= rel_tol < 1:
            raise ValueError(f"MathReward(rel_tol={rel_tol!r}): a relative tolerance in [0, 1)")
        self.answer_column = answer_column
        self.solution_column = solution_column
        self.extract = tuple(extract)
        self.format_weight = float(format_weight)
        self.timeout_s = int(timeout_s)
        self.max_answers = max_answers
        self.max_answer_chars = max_answer_chars
        self.max_nesting = max_nesting
        self.rel_tol = float(rel_tol)
        self.bounds = Bounds(max_nodes, max_digits, max_symbolic_exponent, max_terms)
        # For what math-verify still compares (containers): its rounding as tight as rel_tol.
        self.float_rounding = max(6, round(-math.log10(rel_tol))) if rel_tol > 0 else 15

    def __call__(self, completion: str, **columns: Any) -> RewardParts:
        reference = self.reference(columns)
        answers = find_answers(completion, self.extract)
        statements = find_statements(completion, answers) if answers else []
        given = answers + statements
        checks = [self.check(reference, a.text) for a in given] if len(given) <= self.max_answers else []
        parts = {"correct": float(bool(checks) and all(c.equal for c in checks))}
        if self.format_weight:
            well_formed = self.well_formatted(completion, answers) and checks[0].parsed
            parts["format"] = self.format_weight * float(well_formed)
        # Per episode, summed into the step's metrics: how often completions give no answer
        # or several (a policy drifting towards hedging shows here first), and why answers were refused.
        metrics = {"math/no_answer": float(not answers), "math/several_answers": float(len(answers) > 1)}
        if len(given) > self.max_answers:
            metrics["math/refused/too_many_answers"] = 1.0
        for c in checks:
            if c.refused:
                metrics[f"math/refused/{c.refused.split(':')[0]}"] = 1.0
        if checks and all(c.equal for c in checks[:len(answers)]) and not all(c.equal for c in checks[len(answers):]):
            metrics["math/refused/statement_disagrees"] = 1.0
        return RewardParts(parts, metrics)

    def reference(self, columns: dict[str, Any]) -> str:
        """The row's reference answer text (raises naming the columns when there is none)."""
        if self.answer_column in columns and columns[self.answer_column] is not None:
            value = columns[self.answer_column]
            return value if isinstance(value, str) else str(value)
        if self.solution_column and isinstance(columns.get(self.solution_column), str):
            boxed = [a for a in find_answers(columns[self.solution_column], ("boxed",))]
            if boxed:
                return boxed[-1].text
            raise ValueError(f"MathReward: column `{self.solution_column}` has no \\boxed{{}} answer, and the row "
                             f"has no `{self.answer_column}` column")
        raise ValueError(f"MathReward: the row has no column `{self.answer_column}`"
                         f"{f' nor `{self.solution_column}`' if self.solution_column else ''} "
                         f"(columns: {', '.join(sorted(columns)) or 'none'}); set answer_column")

    def well_formatted(self, completion: str, answers: list[Answer]) -> bool:
        """Exactly one final answer, non-empty, and nothing after it (after a box or a final
        line, closing math or emphasis and a period may follow). The format part also needs
        the answer to parse (`check`)."""
        if len(answers) != 1 or not _unwrap(answers[0].text):
            return False
        if answers[0].kind == "answer_tag":  # as the arithmetic reward: nothing after the tag
            return not completion[answers[0].end:].strip()
        return TRAILER_RE.fullmatch(completion, answers[0].end) is not None

    def equal(self, reference: str, given: str) -> bool:
        """Whether the answer text `given` equals `reference`."""
        return self.check(reference, given).equal

    def _fits(self, text: str) -> str:
        if not text:
            return "empty"
        if len(text) > self.max_answer_chars:
            return f"too_long: over max_answer_chars={self.max_answer_chars}"
        if _nesting(text) > self.max_nesting:
            return f"too_nested: brackets deeper than max_nesting={self.max_nesting}"
        return ""

    def check(self, reference: str, given: str) -> Check:
        """The answer text `given` against `reference`: split into candidates, units compared,
        each candidate bounded, parsed and compared; refused (not equal) with a reason when it
        names several values, a unit other than the reference's, or costs too much."""
        given = _unwrap(given)
        why = self._fits(given)
        if why:
            return Check(False, False, why)
        while (inner := find_answers(given, ("boxed",))) and inner[0].start == 0 and inner[0].end == len(given):
            given = _unwrap(inner[0].text)  # `\boxed{\boxed{7}}` is 7
        if BOXED_RE.search(given):  # a box beside other text inside a box: math-verify would read the inner one
            return Check(False, True, "nested_box")
        ref_text = reference.strip()
        if INTEGER_RE.fullmatch(given) and INTEGER_RE.fullmatch(ref_text):
            return Check(int(given) == int(ref_text), True)  # the arithmetic task's case, without sympy
        ref = self._reference(reference)
        split = candidates(honest_forms(given, single=not ref.is_list), list_reference=ref.is_list,
                           equation_reference=ref.is_equation, pm_reference=ref.has_pm)
        if split.refused:
            return Check(False, True, split.refused)
        sides: list[str] = []
        for piece in split.pieces:
            for side in piece:
                value, unit = unit_of(side)
                if ref.unit is not None and unit is not None and unit != ref.unit:
                    return Check(False, True, f"unit_mismatch: {unit} for {ref.unit} (conversions are not credited)")
                sides.append(value)
        if ref.is_list and len(split.pieces) > 1:
            if any(len(p) > 1 for p in split.pieces):
                return Check(False, True, "relation_chain")
            sides = [ref.brackets[0] + ", ".join(sides) + ref.brackets[1]]
        parsed_any = False
        for side in sides:
            result = self._compare(ref, side)
            parsed_any = parsed_any or result.parsed
            if not result.equal:
                # A chain (`5 = 6`) names each side as an answer: one side unequal, the chain is a hedge.
                return Check(False, parsed_any, result.refused or ("relation_chain" if len(sides) > 1 else ""))
        return Check(True, True)

    def _compare(self, ref: Reference, text: str) -> Check:
        why = self._fits(text)
        if why:
            return Check(False, False, why)
        from math_verify import verify

        try:
            with deadline(self._timeout()):
                target = self._parse(text)
                exprs = [t for t in target if not isinstance(t, str)]
                if not exprs and self._partial(text):
                    return Check(False, True, f"partial_parse: math-verify would read only {self._partial(text)!r}")
                why = next((r for r in (cost_refusal(t, self.bounds) for t in exprs) if r), "")
                if not target or why:
                    return Check(False, False, why or "unparsed")
                gold = ref.parsed[0]
                if exprs and plain_number(gold) and plain_number(exprs[0]):
                    try:
                        equal = numbers_equal(gold, exprs[0], self.rel_tol, ref.decimals)
                    except (ArithmeticError, ValueError, TypeError, RecursionError) as e:
                        return Check(False, True, f"unevaluable: {type(e).__name__}")
                else:
                    equal = bool(verify(ref.parsed, target, float_rounding=self.float_rounding, numeric_precision=60,
                                        timeout_seconds=None))
                    if equal and exprs and _set_vs_interval(gold, exprs[0]):
                        return Check(False, True, "set_for_interval")
        except OutOfTime:
            return Check(False, False, "timeout")  # too costly to compare
        # Only math-verify's string fallback (`>`): not a formula, unless it is the reference.
        return Check(equal, equal or bool(exprs))

    def _timeout(self) -> int | None:
        # The deadline is SIGALRM: only the main thread may set it.
        return self.timeout_s if threading.current_thread() is threading.main_thread() else None

    def _parse(self, text: str) -> list[Any]:
        """The whole text as one formula (never searched for numbers): LaTeX first, else a plain
        expression (`1/2`, `2*x`) only when math-verify's expression reading takes all of it."""
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

        latex = parse(f"${text}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
        if any(not isinstance(t, str) for t in latex):
            return latex
        plain = parse(text, extraction_config=[ExprExtractionConfig()], parsing_timeout=None)
        whole = len(plain) == 2 and isinstance(plain[1], str) and plain[1].replace(" ", "") == text.replace(" ", "")
        return plain if whole else latex

    def _partial(self, text: str) -> str:
        """What math-verify's plain-expression reading would take from a text its LaTeX reading
        cannot parse ("" if nothing): it picks the last number (`5 | 6` reads as 6), which
        would make any notation it does not know a way to write two values and be read as one."""
        from math_verify import ExprExtractionConfig, parse

        plain = parse(text, extraction_config=[ExprExtractionConfig()], parsing_timeout=None)
        return plain[1] if len(plain) == 2 and isinstance(plain[1], str) else ""

    @functools.lru_cache(maxsize=4096)  # noqa: B019 — one reward object per run; references repeat
    def _reference(self, reference: str) -> Reference:
        import sympy

        text = _unwrap(reference)
        is_list = len(split_top(text, SPLIT)) > 1
        value, unit = unit_of(honest_forms(text, single=not is_list))
        try:
            with deadline(self._timeout()):
                parsed = self._parse(value)
        except OutOfTime:
            raise ValueError(f"MathReward: math-verify did not parse the reference answer {reference[:200]!r} within "
                             f"timeout_s={self.timeout_s} (column `{self.answer_column}`)") from None
        if not parsed:
            raise ValueError(f"MathReward: math-verify cannot parse the reference answer {reference[:200]!r} "
                             f"(column `{self.answer_column}`)")
        first = parsed[0]
        is_list = is_list or isinstance(first, (sympy.FiniteSet, sympy.Tuple, sympy.Interval, sympy.Union))
        decimals = re.fullmatch(r"[-+]?\d*\.(\d+)", value.strip())
        brackets = next(((a, b) for a, b in (("(", ")"), ("\\{", "\\}"), ("[", "]"), ("\\left(", "\\right)"))
                         if value.strip().startswith(a) and value.strip().endswith(b)), ("", ""))
        return Reference(parsed, unit, is_list, bool(split_top(text, RELATION)[1:]) and not is_list,
                         bool(re.search(r"\\(?:pm|mp)\b", text)), len(decimals.group(1)) if decimals else None,
                         brackets)


def _set_vs_interval(gold: Any, given: Any) -> bool:
    """A finite set is not an interval, nor the other way round (math-verify credits `(1, 2)`
    for `\\{1, 2\\}`)."""
    import sympy

    kinds = {isinstance(x, sympy.FiniteSet) and "set" or isinstance(x, (sympy.Interval, sympy.Union)) and "interval"
             for x in (gold, given)}
    return kinds == {"set", "interval"}


score = MathReward()
