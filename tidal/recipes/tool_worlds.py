"""Generated tool worlds: random tools, a question that needs one of them, the answer.

The general tiny tool model (tidal/recipes/general_tool_model.py) is warm-started on these worlds
so that it learns tool use, not one tool: read the schemas in the system turn,
pick the tool the question is about, fill its arguments from the question, call it, answer
from its result. Each world has 1 to 3 tools with generated names (`verb_topic`, `topic`,
`verb`; most words coined, `COINED`, so that names are copied rather than remembered),
descriptions, 1 to 3 arguments of generated names and types (string, integer,
number, enum, and optional booleans and integers with defaults that a call may leave out),
and a result kind: a number, a decimal, a word, a list of words (the answer is its first
item) or an error (the tool raises; the answer is `none`).

The choice this makes: questions name the values in the order of the tool's arguments
(`Convert 12 meters to feet` for `convert(value, from_unit, to_unit)`), joined by varied
connectives, and name the tool's topic or verb, so the model can learn a rule a 1M-parameter
network can follow: take the tool whose name the question mentions and copy the question's
values into its arguments in schema order. Every final answer is `<answer>X</answer>`.

*Wide* worlds (`wide=True`, the second build phase's) name tools and ask for them in more
ways (tidal/recipes/world_phrasing.py) and add tools that return coined names, clock times and
lists of them, answers of several tokens.

Worlds come from a seed; a world is held out when a hash of its target tool's name falls in
one bucket of ten, so held-out worlds call tools never seen in training. `RESERVED_NAMES` are
names the unseen-tool examples (examples/envs/unit_convert.py, examples/envs/train_lookup.py)
use: no generated tool or argument has one (tests/test_tool_worlds.py checks it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tidal.envs.tool_env import ToolEnv
from tidal.envs.tools import Tool
from tidal.recipes.world_phrasing import wide_name, wide_question

VERBS = ("get", "find", "lookup", "fetch", "compute", "check", "search", "count", "estimate", "measure", "rate",
         "score", "translate", "resolve", "locate", "predict", "rank", "encode", "quote", "scan")
TOPICS = ("price", "weather", "color", "owner", "height", "speed", "code", "label", "population", "capital",
          "distance", "weight", "rating", "author", "score", "temperature", "address", "phone", "budget", "tax",
          "salary", "age", "size", "volume", "density", "balance", "status", "rank", "title", "genre", "flight",
          "stock", "recipe", "calories", "area", "depth", "elevation", "length", "timezone", "currency", "language",
          "symbol", "grade", "version", "license", "sport", "planet", "river", "mountain", "animal", "planet_mass",
          "zip_code", "country", "discount", "rent", "speed_limit", "voltage", "pressure", "humidity", "wind",
          "tide", "moon_phase", "opening_hours", "menu", "score_card", "team", "coach", "mayor", "founder")
ARG_WORDS = ("city", "name", "amount", "count", "year", "code", "color", "level", "source", "target", "start",
             "end", "query", "label", "item", "size", "region", "user", "value", "number", "word", "text",
             "country", "product", "person", "date", "day", "month", "team", "player", "book", "song", "street",
             "store", "account", "symbol", "limit", "offset", "factor", "rate", "degree", "angle", "language",
             "topic", "title", "key", "mode", "kind", "format", "station", "route", "model", "brand")
PREFIXES = ("", "", "", "from_", "to_", "max_", "min_", "new_", "base_")
VALUE_WORDS = ("Paris", "Tokyo", "Berlin", "Oslo", "Cairo", "Lima", "Rome", "Madrid", "Dublin", "Quito", "red",
               "green", "blue", "amber", "violet", "tiger", "otter", "falcon", "maple", "cedar", "Alice", "Bruno",
               "Chen", "Dara", "Emil", "Farah", "Goro", "Hana", "alpha", "delta", "sigma", "omega", "north", "south",
               "copper", "silver", "granite", "basalt", "jazz", "tango", "piano", "violin", "apple", "mango",
               "lemon", "river", "harbor", "meadow", "summit", "canyon", "kg", "km", "mile", "gram", "liter", "inch",
               "hour", "euro", "dollar", "yen", "small", "large", "fast", "slow", "hot", "cold")
LEADS = ("What is the", "Find the", "Get the", "Look up the", "Tell me the", "Give me the", "Which is the",
         "I need the", "Please find the", "Show the")
CONNECTIVES = ("of", "for", "with", "from", "to", "in", "at", "by", "on", "and", "into", ",", "")
SYSTEM_PROMPTS = (
    "Use the tools to answer. End with <answer>X</answer>.",
    "You can call tools. Give the final answer as <answer>X</answer>.",
    "Answer the question; call a tool when you need one. Finish with <answer>X</answer>.",
    "You are an assistant with tools. Reply with <answer>X</answer>.",
    "Call the right tool, then answer in <answer></answer> tags.",
)
RESULT_KINDS = ("number", "decimal", "word", "list", "error")
# Wide worlds' tools also return coined names (several tokens: the answer has to be copied to
# its end, not one token), clock times, and lists of either.
WIDE_RESULT_KINDS = RESULT_KINDS + ("name", "time", "names", "times")
RESERVED_NAMES = frozenset({"convert", "from_unit", "to_unit", "list_trains", "origin", "destination",
                            "weather_at", "unit"})
HELD_OUT_BUCKETS = 10
# The share of name words (tool verbs and topics, argument names) coined (`coined_word`: syllables
# or a word of the repository's docs) rather than drawn from the short lists above: a coined name
# cannot be remembered from training, only copied from the schema in the prompt. The first builds
# coined 0 to 0.3 of them, and the model remembered names instead of copying them.
COINED = 0.7


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # integer | number | string | enum | boolean
    description: str
    enum: tuple[str, ...] = ()
    optional: bool = False  # has a default; the question never names it and the call leaves it out


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    params: tuple[Param, ...]
    result: str  # one of WIDE_RESULT_KINDS (plain worlds: of RESULT_KINDS)
    verb: str
    topic: str

    def schema(self) -> dict[str, Any]:
        props: dict[str, Any] = {}
        for p in self.params:
            s: dict[str, Any] = {"type": "string" if p.type == "enum" else p.type, "description": p.description}
            if p.enum:
                s["enum"] = list(p.enum)
            if p.optional:
                s["default"] = False if p.type == "boolean" else 1
            props[p.name] = s
        return {"type": "object", "properties": props, "required": [p.name for p in self.params if not p.optional]}

    def tool(self) -> Tool:
        """The tool, run by the real `ToolEnv`: its result is a hash of its name and arguments."""
        spec = self

        def fn(**kwargs: Any) -> Any:
            return result_of(spec, kwargs)

        return Tool(self.name, self.description, self.schema(), fn)


def _digest(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()[:8], "big")


def result_of(spec: ToolSpec, args: dict[str, Any]) -> Any:
    """The tool's deterministic answer to `args`; raises ValueError for an `error` tool."""
    required = {k: v for k, v in args.items() if k in {p.name for p in spec.params if not p.optional}}
    h = _digest(spec.name, required)
    if spec.result == "number":
        return h % 10_000
    if spec.result == "decimal":
        return round((h % 100_000) / 100, 2)
    if spec.result == "word":
        return VALUE_WORDS[h % len(VALUE_WORDS)]
    if spec.result == "list":
        n = 2 + h % 3
        return [VALUE_WORDS[(h >> (8 * i)) % len(VALUE_WORDS)] for i in range(n)]
    if spec.result in ("name", "time", "names", "times"):  # "names"/"times": a list of 2-4
        rng = random.Random(h)
        one = _clock if spec.result.startswith("time") else _result_name
        return [one(rng) for _ in range(2 + h % 3)] if spec.result.endswith("s") else one(rng)
    if h % 2:  # an `error` tool fails on half of its inputs
        first = next(iter(required.values()), "")
        raise ValueError(f"no {spec.topic or spec.verb} known for {first}")
    return h % 1000


def _clock(rng: random.Random) -> str:
    return f"{rng.randint(0, 23):02d}:{rng.choice((0, 15, 30, 45)):02d}"


def _result_name(rng: random.Random) -> str:
    word = coined_word(rng)
    return word.capitalize() if rng.random() < 0.5 else word


def answer_of(spec: ToolSpec, args: dict[str, Any]) -> str:
    """The final answer the question asks for: the result, a list's first item, `none` on error."""
    try:
        out = result_of(spec, args)
    except ValueError:
        return "none"
    return str(out[0] if isinstance(out, list) else out)


def _pseudo_word(rng: random.Random) -> str:
    syll = [rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 3))]
    return "".join(syll)


@functools.cache
def name_words() -> tuple[str, ...]:
    """~1,500 English words of this repository's docs (`name_words.txt`), read once."""
    text = (Path(__file__).parent / "name_words.txt").read_text()
    return tuple(w for w in text.split("\n") if w and not w.startswith("#"))


def coined_word(rng: random.Random) -> str:
    """A word no list above holds: one of `name_words()` or syllables (`bakotu`)."""
    return rng.choice(name_words()) if rng.random() < 0.5 else _pseudo_word(rng)


def _word(rng: random.Random, pool: tuple[str, ...], coined: float) -> str:
    return coined_word(rng) if rng.random() < coined else rng.choice(pool)


def make_tool(rng: random.Random, taken: set[str], coined: float = COINED, wide: bool = False) -> ToolSpec:
    """One generated tool whose name, topic and verb differ from those in `taken`; each word of
    its name and of its arguments' names is coined with probability `coined`; `wide`: named in
    the wide styles (`world_phrasing.wide_name`)."""
    while True:
        verb, topic = _word(rng, VERBS, coined), _word(rng, TOPICS, coined)
        if wide:
            name, topic = wide_name(rng, verb, topic)
        else:
            style = rng.random()
            name = f"{verb}_{topic}" if style < 0.55 else topic if style < 0.8 else verb
            if style >= 0.8:
                topic = ""  # a verb-only tool: the question leads with its verb
        if name in RESERVED_NAMES or {name, verb, topic} & taken:
            continue
        break
    params: list[Param] = []
    used: set[str] = set()
    for _ in range(rng.choice((1, 1, 2, 2, 3))):
        while True:
            pname = rng.choice(PREFIXES) + _word(rng, ARG_WORDS, coined)
            if pname not in used and pname not in RESERVED_NAMES:
                break
        used.add(pname)
        kind = rng.choice(("string", "string", "integer", "number", "enum"))
        enum = tuple(rng.sample(VALUE_WORDS, rng.randint(2, 4))) if kind == "enum" else ()
        desc = rng.choice(("the {}", "which {} to use", "{} to look up", "a {}")).format(pname.replace("_", " "))
        params.append(Param(pname, kind, desc, enum))
    if rng.random() < 0.25:  # an optional argument the call leaves at its default
        oname = rng.choice(("verbose", "exact", "strict", "limit", "page", "cached"))
        if oname not in used:
            otype = "boolean" if oname in ("verbose", "exact", "strict", "cached") else "integer"
            params.append(Param(oname, otype, f"optional {oname}", optional=True))
    what = topic.replace("_", " ") or verb
    first = params[0].name.replace("_", " ")
    desc = rng.choice((f"{verb.capitalize()} the {what}.", f"Returns the {what}.", f"The {what} of a {first}.",
                       f"Look up {what} by {first}."))
    if wide:
        result = rng.choices(WIDE_RESULT_KINDS, (3, 2, 2, 1, 1, 2, 2, 2, 2))[0]
    else:
        result = rng.choices(RESULT_KINDS, (3, 2, 3, 2, 1))[0]
    return ToolSpec(name, desc, tuple(params), result, verb, topic)


def draw_value(rng: random.Random, p: Param) -> Any:
    if p.type == "integer":
        return rng.randint(1, 10 ** rng.randint(1, 4) - 1)
    if p.type == "number":
        return round(rng.randint(1, 9999) / rng.choice((10, 100)), 2)
    if p.type == "enum":
        return rng.choice(p.enum)
    word = rng.choice(VALUE_WORDS) if rng.random() < 0.4 else coined_word(rng)
    return word.capitalize() if rng.random() < 0.5 else word


def make_question(rng: random.Random, spec: ToolSpec, args: dict[str, Any]) -> str:
    """The question naming the tool's topic (or verb) and its values in argument order."""
    values = [str(v) for v in args.values()]
    if rng.random() < 0.2:  # explicit: argument names next to their values
        body = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in args.items())
        lead = f"{rng.choice(LEADS)} {spec.topic.replace('_', ' ')}" if spec.topic else spec.verb.capitalize()
        return f"{lead} with {body}{rng.choice('?.')}"
    if spec.topic and (not spec.name.startswith(spec.verb) or rng.random() < 0.6):
        lead = f"{rng.choice(LEADS)} {spec.topic.replace('_', ' ')}"
        first = rng.choice(("of", "for", "with", "from", "in", "at"))
    else:
        lead = spec.verb.capitalize() + (f" the {spec.topic.replace('_', ' ')}" if spec.topic else "")
        first = rng.choice(("", "", "for", "of"))
    out = f"{lead} {first} {values[0]}" if first else f"{lead} {values[0]}"
    for v in values[1:]:
        c = rng.choice(CONNECTIVES)
        out += f", {v}" if c == "," else f" {c} {v}" if c else f" {v}"
    return out + rng.choice("?.")


def is_held_out(spec: ToolSpec) -> bool:
    return hashlib.sha256(spec.name.encode()).digest()[0] % HELD_OUT_BUCKETS == 0


@dataclass(frozen=True)
class World:
    tools: tuple[ToolSpec, ...]
    target: int  # index of the tool the question needs
    args: dict[str, Any]  # the right call's arguments (required ones, in schema order)
    question: str
    system_prompt: str

    @property
    def answer(self) -> str:
        return answer_of(self.tools[self.target], self.args)

    def row(self) -> dict[str, Any]:
        return {"prompt": [{"role": "user", "content": self.question}], "answer": self.answer, "world": self}


def make_world(rng: random.Random, held_out: bool = False, coined: float = COINED, wide: bool = False) -> World:
    """A world whose target tool is held out (`held_out`) or not; the other tools are any.
    `wide`: tools named and questions asked in the wide styles (tidal/recipes/world_phrasing.py;
    a third of the questions plain)."""
    while True:
        taken: set[str] = set()
        tools = []
        for _ in range(rng.choice((1, 1, 2, 2, 3))):
            t = make_tool(rng, taken, coined, wide)
            taken |= {t.name, t.verb, t.topic} - {""}
            tools.append(t)
        target = rng.randrange(len(tools))
        if is_held_out(tools[target]) == held_out:
            break
    spec = tools[target]
    args = {p.name: draw_value(rng, p) for p in spec.params if not p.optional}
    if wide and rng.random() < 2 / 3:
        question = wide_question(rng, spec.topic, spec.verb, [str(v) for v in args.values()])
    else:
        question = make_question(rng, spec, args)
    return World(tuple(tools), target, args, question, rng.choice(SYSTEM_PROMPTS))


def make_worlds(split: str, n: int, seed: int, coined: float = COINED, wide: bool = False) -> list[World]:
    """`n` worlds of `split` ("train" or "test"), `coined` as `make_tool`'s, `wide` as `make_world`'s."""
    if split not in ("train", "test"):
        raise ValueError(f"tool worlds: split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"tool-worlds-{split}-{seed}")
    return [make_world(rng, held_out=split == "test", coined=coined, wide=wide) for _ in range(n)]


ANSWER_RE = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def score(completion: str, answer: str) -> dict[str, float]:
    """correct: 1 when the last `<answer>X</answer>` of the final turn is `answer` (case aside)."""
    found = ANSWER_RE.findall(completion)
    return {"correct": float(bool(found) and found[-1].strip().lower() == str(answer).strip().lower())}


class WorldEnv(ToolEnv):
    """A generated world as an environment: the row's `world` gives the tools and system prompt."""

    name: ClassVar[str] = "tool_world"
    default_reward: ClassVar[str] = "tidal.recipes.tool_worlds:score"

    def __init__(self, row: dict[str, Any], seed: int = 0, **env_args: Any):
        world: World = row["world"]
        super().__init__(row, seed, tools=[t.tool() for t in world.tools], system_prompt=world.system_prompt,
                         **env_args)
