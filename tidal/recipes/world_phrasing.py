"""Wide tool worlds: more ways to name a tool and to ask for it (tidal/recipes/tool_worlds.py).

The plain worlds name a tool `verb_topic`, `topic` or `verb` and ask `<lead> the <topic> <values>`
with ten fixed leads. A model warm-started on them alone learned the shortcut this allows: the
second word of a name is the word the question says. Given `weather_at` and "What is the weather
at Milan?" it wrote `weather_weather`; given "Which trains go from Milan to Genoa?" it took `go`
for a value (docs/agents.md, "Tools the model never saw"). Wide worlds break the shortcut:

- names put the topic first (`price_check`), end with a particle (`weather_at`, `price_of`) or
  stand alone, so the name has to be read from the schema, not assembled from the question;
- questions name the topic in its singular or plural (`a flight`, `the flights`), in some thirty
  frames (`Which <topics> ...`, `Is there a <topic> ...`, `When is there a <topic> ...`), with a
  word or two between the topic and the values (`go`, `are there`), or the values first.

The choice: these are generic English frames, not the questions of any one environment; a world
still names its topic (or verb) and its values in argument order, so the rule stays one a
1M-parameter network can follow. A third of wide questions are plain ones, so nothing the first
phase learned goes unexercised.
"""

from __future__ import annotations

import random

PARTICLES = ("at", "of", "for", "by", "in", "on", "now", "info", "data", "today", "list", "lookup")
# Frames name the topic as `{a}` (a/an + singular), `{the}` (the + topic as given), `{the_pl}`
# (the + plural) or `{pl}` (plural alone).
FRAMES = (
    "What is {the}", "What are {the_pl}", "Which {pl}", "Which {pl} are there", "Find {a}", "Find {the}",
    "Find me {the}", "Get {the}", "Get me {a}", "Look up {the}", "List {the_pl}", "List {pl}", "Show me {the_pl}",
    "Give me {the}", "Tell me {the}", "I need {the}", "I need {a}", "I want to know {the}", "Is there {a}",
    "When is there {a}", "How is {the}", "Can you find {the}", "Please check {the}", "Do you know {the}",
    "Search for {a}", "Any {pl}", "Check {the}", "Where can I find {the}", "Could you look up {the}",
    "Name {the}",
)
# Words between the topic and the values (`Which trains go from A to B?`).
MIDDLES = ("go", "run", "are there", "is there", "exist", "apply", "do you have", "is it", "please", "today")
FIRSTS = ("of", "for", "with", "from", "in", "at", "between", "about", "on", "")
ENDINGS = ("?", ".", "?", ".", " please.", ", thanks.", "!")


def plural(word: str) -> str:
    """`train` → `trains`, `city` → `cities`; a word ending in s is its own plural."""
    if word.endswith("s"):
        return word
    if word.endswith("y") and len(word) > 1 and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def singular(word: str) -> str:
    """`trains` → `train`, `cities` → `city`; `glass` and `bus` stay."""
    if word.endswith("ies") and len(word) > 3:
        return word[:-3] + "y"
    if word.endswith("s") and not word.endswith(("ss", "us", "is")) and len(word) > 2:
        return word[:-1]
    return word


def wide_name(rng: random.Random, verb: str, topic: str) -> tuple[str, str]:
    """A name of `verb` and `topic` in one of the wide styles, and the topic the question names
    (`""` for a verb-only name, whose question leads with the verb)."""
    style = rng.random()
    if style < 0.3:
        return f"{verb}_{topic}", topic
    if style < 0.45:
        return f"{topic}_{verb}", topic
    if style < 0.65:
        return f"{topic}_{rng.choice(PARTICLES)}", topic
    if style < 0.75:
        return f"{verb}_{topic}_{rng.choice(PARTICLES)}", topic
    if style < 0.9:
        return topic, topic
    return verb, ""


def wide_question(rng: random.Random, topic: str, verb: str, values: list[str]) -> str:
    """A question naming `topic` (or, when empty, `verb`) and then `values` in order."""
    if topic:
        t = topic.replace("_", " ")
        words = t.split(" ")
        sg, pl = " ".join(words[:-1] + [singular(words[-1])]), " ".join(words[:-1] + [plural(words[-1])])
        article = "an" if sg[0] in "aeiou" else "a"
        lead = rng.choice(FRAMES).format(a=f"{article} {sg}", the=f"the {rng.choice((t, sg, pl))}",
                                         the_pl=f"the {pl}", pl=pl)
    else:
        lead = rng.choice(("{}", "Please {}", "Can you {}", "I want to {}", "Could you {}")).format(verb)
    if rng.random() < 0.3:
        lead += " " + rng.choice(MIDDLES)
    lead = lead[0].upper() + lead[1:]
    joined = values[0]
    for v in values[1:]:
        joined += rng.choice((f" to {v}", f" and {v}", f", {v}", f" with {v}", f" in {v}", f" {v}", f" for {v}"))
    if rng.random() < 0.12:  # the values first
        lead = lead if lead.startswith("I ") else lead[0].lower() + lead[1:]
        return f"For {joined}, {lead}{rng.choice('?.')}"
    first = rng.choice(FIRSTS)
    return f"{lead} {first} {joined}{rng.choice(ENDINGS)}" if first else f"{lead} {joined}{rng.choice(ENDINGS)}"
