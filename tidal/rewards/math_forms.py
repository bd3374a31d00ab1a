"""What a math answer says, before math-verify reads it: honest notations rewritten into LaTeX
that math-verify parses, the candidates a box names, and the unit it is given in.

The choice: math-verify is lenient by design (it drops unknown operators and `\\text{...}`, takes
the last side of `5 = 6` and of `5 \\lor 6`, strips units), which a policy turns into hedges:
two guesses in one box. So a box is split here into its candidates first, with the
connectives that join them (`,` `;` `or` `and` `\\lor` `\\vee` `\\Rightarrow` `\\quad` ...), the sides
of a relation chain (`=`, `\\approx`), a `\\pm`, and prose in `\\text{...}`; the reward then
credits an answer only when it names one value (or, where the reference is a list, one list).
This is a detector around math-verify, not a LaTeX parser: it splits only at top level
(outside every bracket) and hands each piece to math-verify.

Honest forms rewritten: Unicode superscripts (`4²`, `x³`), vulgar fractions (`½`, `1½`),
`√`, `π`, `−`, `×`, `÷`, `·`, `∞`, `°`; repeating decimals (`0.\\overline{3}`, `0.1\\dot{6}`)
as exact fractions; thousands separators (`1,000`, `1{,}000`, `1\\,000`) where the reference
is one number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿⁱ", "0123456789+-=()ni")
_SUBSCRIPTS = str.maketrans("₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎", "0123456789+-=()")
_SUP_RUN = re.compile("[⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿⁱ]+")
_SUB_RUN = re.compile("[₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎]+")
_VULGAR = {"½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅕": (1, 5), "⅖": (2, 5),
           "⅗": (3, 5), "⅘": (4, 5), "⅙": (1, 6), "⅚": (5, 6), "⅐": (1, 7), "⅛": (1, 8), "⅜": (3, 8),
           "⅝": (5, 8), "⅞": (7, 8), "⅑": (1, 9), "⅒": (1, 10), "↉": (0, 3)}
_VULGAR_RE = re.compile(r"(\d*)\s*([" + "".join(_VULGAR) + "])")
_SYMBOLS = {"−": "-", "–": "-", "×": r"\times ", "÷": r"\div ", "·": r"\cdot ", "⋅": r"\cdot ", "π": r"\pi ",
            "∞": r"\infty ", "≤": r"\le ", "≥": r"\ge ", "≠": r"\ne ", "≈": r"\approx ", "±": r"\pm ",
            "∓": r"\mp ", "°": r"^\circ ", "∨": r"\lor ", "∧": r"\land ", "⇒": r"\Rightarrow ", "→": r"\to ",
            "∪": r"\cup ", "∩": r"\cap ", "∈": r"\in ", "θ": r"\theta ", "α": r"\alpha ", "β": r"\beta "}
_SQRT_RE = re.compile(r"√\s*(\d+(?:\.\d+)?|[a-zA-Z]|\([^()]*\)|\{[^{}]*\})")
# A repeating decimal: 0.\overline{3}, 1.2\overline{45}, 0.1\dot{6} (one repeating digit).
_REPEATING = re.compile(r"(-?)(\d*)\.(\d*)\s*\\(?:overline|bar|dot)\s*\{\s*(\d+)\s*\}")
_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:(?:,|\{,\}|\\,|\\ |\\!)\d{3})+(?![\d,])")
_THOUSANDS_EXPLICIT = re.compile(r"(?<=\d)(?:\{,\}|\\,|\\!)(?=\d{3})")


def honest_forms(text: str, *, single: bool) -> str:
    """`text` with the honest notations above rewritten into LaTeX math-verify reads.
    `single`: the reference is one value, so `1,000` is a thousands separator (in a list
    reference it separates two values)."""
    text = _SUP_RUN.sub(lambda m: "^{" + m.group(0).translate(_SUPERSCRIPTS) + "}", text)
    text = _SUB_RUN.sub(lambda m: "_{" + m.group(0).translate(_SUBSCRIPTS) + "}", text)

    def vulgar(m: re.Match) -> str:
        n, d = _VULGAR[m.group(2)]
        return (f"\\frac{{{int(m.group(1)) * d + n}}}{{{d}}}" if m.group(1) else f"\\frac{{{n}}}{{{d}}}")

    text = _VULGAR_RE.sub(vulgar, text)
    text = _SQRT_RE.sub(lambda m: "\\sqrt{" + m.group(1).strip("(){}") + "}", text)
    text = text.replace("⁄", "/")  # the fraction slash
    for k, v in _SYMBOLS.items():
        text = text.replace(k, v)
    text = _REPEATING.sub(_repeating_fraction, text)
    text = _THOUSANDS_EXPLICIT.sub("", text)
    if single:
        text = _THOUSANDS.sub(lambda m: re.sub(r"\D", "", m.group(0)), text)
    return text


def _repeating_fraction(m: re.Match) -> str:
    sign, whole, fixed, rep = m.groups()
    value = Fraction(int(whole or "0")) + Fraction(int(fixed or "0"), 10 ** len(fixed)) + \
        Fraction(int(rep), (10 ** len(rep) - 1) * 10 ** len(fixed))
    return f"{sign}\\frac{{{value.numerator}}}{{{value.denominator}}}"


# -- candidates ------------------------------------------------------------------------------
# Connectives that join candidates: a list where the reference is a list, a hedge otherwise.
_LIST_JOINS = (r"(?<!\\),|(?<!\\);|\\lor\b|\\vee\b|\\land\b|\\wedge\b|\\quad\b|\\qquad\b|\\\\|(?<![\\A-Za-z])(?:or|and)(?![A-Za-z])")
# Connectives that are never a list: a derivation or a hedge either way.
_STEP_JOINS = (r"\\(?:mid|sim|cong|propto|parallel|perp|vert|Vert|"
               r"Rightarrow|Longrightarrow|implies|rightarrow|longrightarrow|to|iff|Leftrightarrow|"
               r"Longleftrightarrow|therefore|because)\b")
SPLIT = re.compile(rf"(?P<list>{_LIST_JOINS})|(?P<step>{_STEP_JOINS})")
RELATION = re.compile(r"(?<![<>!\\])=|\\approx\b|\\simeq\b|\\equiv\b")
_TEXT = re.compile(r"\\(?:text|textrm|textbf|textit|mbox|mathrm|operatorname)\s*\{([^{}]*)\}")
_HEDGE_WORDS = re.compile(r"\b(?:or|and|either|maybe|perhaps|possibly|probably|likely|approx\w*|about|around|"
                          r"roughly|nearly|almost|guess|unsure|sure|if|unless|otherwise|else|alternatively|"
                          r"depending|depends|whichever|nor|but|instead|rather|wait|actually|answer|correct|"
                          r"wrong|either|not|also|plus|minus|then|so|which|could|might|should|would)\b")
# A name on the left of `=`: x, a_1, f(3), P(A), \theta, m\angle ABC, AB.
_NAME = re.compile(r"\s*(?:m\s*)?(?:\\angle\s*[A-Z]{1,3}|[A-Z]{2,3}|(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{[^{}]*\}|_\w)?"
                   r"'*(?:\^\{?\\prime\}?)?(?:\s*\([^()]*\))?)\s*")


# The commands an answer may use. math-verify drops a command it does not know and keeps what
# follows (`2 \\uparrow\\uparrow 5` reads as 5): an unknown command is refused instead.
KNOWN_COMMANDS = frozenset(re.findall(r"\w+", """
frac dfrac tfrac cfrac sqrt cdot times div pm mp pi infty le leq ge geq ne neq approx left right boxed text textrm
textbf textit mbox mathrm mathbf mathit operatorname sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log
ln lg exp lim sum prod binom dbinom tbinom choose circ degree cup cap emptyset varnothing in notin subset subseteq
mathbb lfloor rfloor lceil rceil displaystyle textstyle quad qquad lvert rvert vert mid cdots ldots dots angle prime
begin end pmatrix bmatrix matrix vmatrix cases lt gt equiv sim simeq propto cong parallel perp triangle overline
overrightarrow vec hat bar dot ddot tilde widehat max min gcd lcm deg det dim mod bmod pmod neg lor vee land wedge
Rightarrow Longrightarrow implies rightarrow longrightarrow to iff Leftrightarrow therefore because setminus
alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi omicron rho varrho sigma
tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Pi Sigma Upsilon Phi Psi Omega ell hbar imath
jmath i e big Big bigg Bigg bigl bigr Bigl Bigr biggl biggr Biggl Biggr mathcal mathrm dfrac tfrac
"""))
_COMMAND = re.compile(r"\\([A-Za-z]+)")


@dataclass(frozen=True)
class Split:
    """A box read as candidates: `pieces` (each a list of relation sides, the name on the left
    dropped), `refused` (why it is not one answer, "" when it is)."""

    pieces: list[list[str]]
    refused: str = ""


_ENV = re.compile(r"\\(begin|end)\s*\{[^{}]*\}")


def top_level(text: str) -> list[tuple[int, int]]:
    """Spans of `text` outside every bracket ((), [], {}, \\{ \\}, \\left ... \\right)."""
    spans, depth, start, i = [], 0, 0, 0
    while i < len(text):
        env = _ENV.match(text, i)  # \begin{pmatrix} ... \end{pmatrix} holds its `\\` and `&`
        if env:
            if env.group(1) == "begin":
                if depth == 0 and i > start:
                    spans.append((start, i))
                depth += 1
            else:
                depth = max(0, depth - 1)
                if depth == 0:
                    start = env.end()
            i = env.end()
            continue
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            c = text[i + 1]
            i += 1
        if c in "([{":
            if depth == 0 and i > start:
                spans.append((start, i))
            depth += 1
        elif c in ")]}":
            depth = max(0, depth - 1)
            if depth == 0:
                start = i + 1
        i += 1
    if depth == 0 and start < len(text):
        spans.append((start, len(text)))
    return spans


def split_top(text: str, rx: re.Pattern) -> list[tuple[str, re.Match | None]]:
    """`text` cut at the matches of `rx` that lie outside every bracket: [(piece, the match
    before it)]."""
    cuts: list[re.Match] = []
    for a, b in top_level(text):
        cuts += [m for m in rx.finditer(text, a, b)]
    # `\text{ or }` spans braces: look for it on the whole text, outside brackets opened before it.
    out, pos, prev = [], 0, None
    for m in sorted(cuts, key=lambda m: m.start()):
        out.append((text[pos:m.start()], prev))
        pos, prev = m.end(), m
    out.append((text[pos:], prev))
    return out


def text_hedge(text: str) -> str:
    """Why the `\\text{...}` in `text` is a hedge ("" when it is a unit or a label): it holds a
    digit (a second value) or a hedging word, or more than three words of prose."""
    for m in _TEXT.finditer(text):
        inner = m.group(1).strip().lower()
        if re.fullmatch(r"[\s,;]*(?:or|and)?[\s,;]*", inner):
            continue  # a connective: a candidate separator, judged as such
        if re.search(r"\d", inner):
            return "text_with_a_value"
        if _HEDGE_WORDS.search(inner):
            return "text_hedge"
        if len(re.findall(r"[a-z]+", inner)) > 3:
            return "text_in_box"
    return ""


def candidates(text: str, *, list_reference: bool, equation_reference: bool, pm_reference: bool) -> Split:
    """The candidates `text` (one answer) names. A list reference (a tuple, set, several
    solutions) takes the list connectives as one list; any other reference takes one value."""
    whole = re.fullmatch(r"\s*\\(?:text|textrm|mbox|mathrm)\s*\{([^{}]*)\}\s*", text)
    if whole and re.fullmatch(r"\s*[-+]?[\d.,/]+\s*", whole.group(1)):  # `\text{6}`: a number written as text
        text = whole.group(1)
    # `\text{ or }` and friends are connectives written in prose: made plain before the split.
    text = re.sub(r"\\(?:text|textrm|mbox)\s*\{\s*,?\s*(or|and|,|;)?\s*,?\s*\}", lambda m: f" {m.group(1) or ','} ", text)
    why = text_hedge(text)
    if why:
        return Split([], why)
    unknown = sorted({c for c in _COMMAND.findall(_TEXT.sub(" ", text)) if c not in KNOWN_COMMANDS})
    if unknown:
        return Split([], f"unknown_command: \\{unknown[0]} (math-verify would drop it)")
    if not pm_reference and re.search(r"\\(?:pm|mp)\b", text) and not list_reference:
        return Split([], "plus_minus")
    parts = split_top(text, SPLIT)
    if any(m is not None and m.group("step") for _, m in parts):
        return Split([], "connective")
    # A bar pairs as |x|; a lone one (`5 | 6`) joins two values, and math-verify keeps the last.
    if sum(text[a:b].replace("\\|", "").count("|") for a, b in top_level(text)) % 2:
        return Split([], "connective")
    pieces = [p.strip() for p, _ in parts]
    if any(not p for p in pieces):
        pieces = [p for p in pieces if p]
        if not pieces:
            return Split([], "empty")
    if len(pieces) > 1 and not list_reference:
        return Split([], "several_candidates")
    out = []
    for piece in pieces:
        if equation_reference:
            out.append([piece])
            continue
        sides = [s for s, _ in split_top(piece, RELATION)]
        seps = [m.group(0) for _, m in split_top(piece, RELATION) if m is not None]
        if len(sides) > 1 and _NAME.fullmatch(sides[0]):
            sides, seps = sides[1:], seps[1:]
        # After an exact value, `\approx ...` is a gloss: dropped (it can only make the answer wrong, not right).
        exact = [sides[0]]
        for sep, side in zip(seps, sides[1:]):
            if sep != "=":
                break
            exact.append(side)
        sides = [s.strip() for s in exact]
        if any(not s for s in sides):
            return Split([], "empty")
        out.append(sides)
    return Split(out)


# -- units -------------------------------------------------------------------------------------
_UNIT_ALIASES = {
    "second": "s sec secs second seconds", "minute": "min mins minute minutes", "hour": "h hr hrs hour hours",
    "day": "day days d", "week": "week weeks wk", "month": "month months", "year": "year years yr yrs",
    "millimeter": "mm millimeter millimeters millimetre millimetres", "centimeter": "cm centimeter centimeters "
    "centimetre centimetres", "meter": "m meter meters metre metres", "kilometer": "km kilometer kilometers "
    "kilometre kilometres", "inch": "in inch inches", "foot": "ft foot feet", "yard": "yd yard yards",
    "mile": "mi mile miles", "gram": "g gram grams", "kilogram": "kg kilogram kilograms kilo kilos",
    "milligram": "mg milligram milligrams", "pound": "lb lbs pound pounds", "ounce": "oz ounce ounces",
    "ton": "ton tons tonne tonnes", "liter": "l liter liters litre litres", "milliliter": "ml milliliter "
    "milliliters millilitre millilitres", "gallon": "gal gallon gallons", "dollar": "dollar dollars usd $",
    "cent": "cent cents ¢", "euro": "euro euros €", "degree": "degree degrees deg ^\\circ \\circ \\degree",
    "radian": "rad radian radians", "percent": "percent % \\%", "mph": "mph", "kmh": "km/h kph",
    "mps": "m/s", "unit": "unit units", "square unit": "square units sq units units^2",
}
_UNITS = {alias: canon for canon, aliases in _UNIT_ALIASES.items() for alias in aliases.split()}
_UNIT_TEXT = re.compile(r"\\(?:text|textrm|mbox|mathrm|textit|textbf)\s*\{([^{}]*)\}(\s*\^\s*\{?\d\}?)?")
_CURRENCY = re.compile(r"^\s*\\?\$\s*|\\(?:text)?dollar\s*|€|£")
_DEGREE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ\b|\\degree\b")
_TRAILING_WORDS = re.compile(r"(?<=[\d})\s])\s*([A-Za-z][A-Za-z/ ]{0,30}?)\s*(\^\s*\{?\d\}?)?\s*$")


def is_unit(word: str) -> bool:
    """Whether `word` names a known unit (an alias in the table above)."""
    w = " ".join(word.lower().split())
    return w in _UNITS or w.rstrip("s") in _UNITS


def unit_of(text: str) -> tuple[str, str | None]:
    """(the value's text, its unit in canonical form or None). A unit is the `\\text{...}`
    (`\\mathrm`, `\\mbox`) words after the value, trailing plain words, `^\\circ`, or a currency
    sign; unknown words count as a unit of their own ("apples"), compared by their singular."""
    unit = None
    if _CURRENCY.search(text):
        unit, text = "dollar", _CURRENCY.sub("", text)
    if _DEGREE.search(text):
        unit, text = "degree", _DEGREE.sub("", text)
    words = [(m.group(1).strip(), m.group(2)) for m in _UNIT_TEXT.finditer(text) if m.group(1).strip()]
    if words and _UNIT_TEXT.sub(" ", text).strip():  # `\text{(B)}` alone is the answer, not a unit
        text = _UNIT_TEXT.sub(" ", text)
        unit = _canonical(" ".join(w for w, _ in words), words[-1][1])
    else:
        m = _TRAILING_WORDS.search(text)
        word = m.group(1).strip() if m else ""
        # `2x`, `3ab` are not units: a unit is a known one or a word of three letters or more after a space.
        if m and (word.lower() in _UNITS or (len(word) >= 3 and text[m.start(1) - 1:m.start(1)].isspace())):
            unit, text = _canonical(m.group(1), m.group(2)), text[:m.start()]
    text = re.sub(r"(?<!\\)\\[,;:! ]", " ", text).strip()
    return text, unit


def _canonical(words: str, power: str | None) -> str:
    w = " ".join(words.lower().replace("\\", "").split())
    w = _UNITS.get(w, _UNITS.get(w.rstrip("s"), w.rstrip("s") if len(w) > 3 else w))
    return w + (("^" + re.sub(r"\D", "", power)) if power else "")
