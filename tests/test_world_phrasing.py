"""Wide tool worlds (tidal/recipes/world_phrasing.py): names and questions that a model cannot
answer by the plain worlds' shortcut (a name's last word is the word the question says)."""

from __future__ import annotations

import random
import re

from tidal.recipes.tool_worlds import RESERVED_NAMES, make_worlds
from tidal.recipes.world_phrasing import FRAMES, plural, singular, wide_question


def test_plural_and_singular():
    assert [plural(w) for w in ("train", "city", "day", "bus", "price")] == ["trains", "cities", "days", "bus", "prices"]
    assert [singular(w) for w in ("trains", "cities", "glass", "bus", "weather")] == \
        ["train", "city", "glass", "bus", "weather"]


def _last_word_said(worlds) -> float:
    """The share of target tools with a two-word name whose last word the question says."""
    named = [w for w in worlds if "_" in w.tools[w.target].name]
    return sum(w.tools[w.target].name.rsplit("_", 1)[1].replace("_", " ") in w.question.lower()
               for w in named) / len(named)


def test_wide_worlds_break_the_last_word_shortcut():
    """In plain worlds the question says the last word of almost every two-word name (so a model
    can write `verb_` + the question's word without reading the schema); in wide worlds it does
    for far fewer (topic-first names, particles), while the topic is still said, in one
    inflection or another."""
    plain, wide = make_worlds("train", 2000, 0), make_worlds("train", 2000, 0, wide=True)
    assert _last_word_said(plain) > 0.85
    assert _last_word_said(wide) < 0.6
    topical = [w for w in wide if w.tools[w.target].topic]
    said = sum(singular(w.tools[w.target].topic.replace("_", " ").split(" ")[-1]) in w.question.lower()
               for w in topical)
    assert said / len(topical) > 0.95


def test_wide_worlds_keep_the_worlds_rules():
    """Values in the question, held-out tools never trained on, no reserved name, all result
    kinds and 1-3 tools: the same rules as the plain worlds."""
    train, test = make_worlds("train", 600, 0, wide=True), make_worlds("test", 100, 0, wide=True)
    assert train == make_worlds("train", 600, 0, wide=True) and train != make_worlds("train", 600, 0)
    assert not {w.tools[w.target].name for w in test} & {w.tools[w.target].name for w in train}
    names = {t.name for w in train for t in w.tools} | {p.name for w in train for t in w.tools for p in t.params}
    assert not names & RESERVED_NAMES
    assert {len(w.tools) for w in train} == {1, 2, 3}
    for w in train:
        assert all(str(v) in w.question for v in w.args.values()), w.question
    styles = {("topic_first" if t.topic and t.name.startswith(t.topic + "_") else
               "verb_first" if "_" in t.name else "one_word") for w in train for t in w.tools}
    assert styles == {"topic_first", "verb_first", "one_word"}


def test_wide_questions_use_every_frame_and_name_the_values_in_order():
    rng = random.Random(0)
    questions = [wide_question(rng, "flight", "find", ["Oslo", "Lima"]) for _ in range(3000)]
    for q in questions:
        assert "Oslo" in q and "Lima" in q and q.index("Oslo") < q.index("Lima"), q
        assert "flight" in q, q
    leads = {f.split(" {")[0].lower() for f in FRAMES}
    seen = {lead for lead in leads for q in questions if q.lower().startswith(lead) or f", {lead}" in q.lower()}
    assert seen == leads
    assert any(q.startswith("Which flights go ") for q in questions)  # a word between topic and values


def test_wide_results_are_copied_to_their_end():
    """Plain worlds' word answers are one token of the default tool model's tokenizer, so a model
    learns to copy one token and stop (it answered `foggy` as `foggy_apart_at", ...`); wide worlds
    also return coined names, clock times and lists of them, most of several tokens."""
    from tidal.models import GENERAL_TOOL_MODEL_DIR, load_tokenizer

    tok = load_tokenizer(GENERAL_TOOL_MODEL_DIR)

    def multi_token(worlds, kinds) -> tuple[int, float]:
        answers = [w.answer for w in worlds if w.tools[w.target].result in kinds]
        return len(answers), sum(len(tok(a, add_special_tokens=False)["input_ids"]) > 1 for a in answers) / len(answers)

    n, share = multi_token(make_worlds("train", 1000, 0), ("word", "list"))
    assert n > 100 and share < 0.1
    wide = make_worlds("train", 1000, 0, wide=True)
    n, share = multi_token(wide, ("name", "names", "time", "times"))
    assert n > 200 and share > 0.8
    assert any(re.fullmatch(r"\d\d:\d\d", w.answer) for w in wide)
