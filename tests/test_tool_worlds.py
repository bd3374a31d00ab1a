"""The generated tool worlds (tidal/recipes/tool_worlds.py) and the general tool model's recipe
(tidal/recipes/general_tool_model.py): its compact tool template and its deterministic build."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import pytest

from tidal.envs.base import Action
from tidal.recipes.general_tool_model import (
    CALL_TEMPLATE,
    COMPACT_TEMPLATE,
    build_general_tool_model,
    render_only_tokenizer,
    scripted_segments,
    world_turns,
)
from tidal.recipes.tool_worlds import COINED, RESERVED_NAMES, WorldEnv, make_worlds, name_words, score

ROOT = Path(__file__).resolve().parents[1]


def test_worlds_are_deterministic_and_held_out_tools_are_never_trained_on():
    train, test = make_worlds("train", 400, 0), make_worlds("test", 100, 0)
    assert train == make_worlds("train", 400, 0) and train != make_worlds("train", 400, 1)
    trained = {t.name for w in train for t in w.tools}
    assert not {w.tools[w.target].name for w in test} & {w.tools[w.target].name for w in train}
    assert {t.result for w in train for t in w.tools} == {"number", "decimal", "word", "list", "error"}
    assert {len(w.tools) for w in train} == {1, 2, 3}
    kinds = {p.type for w in train for t in w.tools for p in t.params}
    assert kinds == {"string", "integer", "number", "enum", "boolean"}
    # the unseen-tool examples' names are never generated (tool, argument or topic)
    names = trained | {p.name for w in train for t in w.tools for p in t.params}
    assert not names & RESERVED_NAMES


def test_the_examples_tools_are_reserved():
    sys.path.insert(0, str(ROOT / "examples" / "envs"))
    try:
        import train_lookup
        import unit_convert
    finally:
        sys.path.pop(0)
    words: set[str] = set()
    for env in (unit_convert.UnitConvertEnv({"prompt": "x"}), train_lookup.TrainLookupEnv({"prompt": "x"})):
        for t in env.tools:
            f = t["function"]
            assert {f["name"], *f["parameters"]["properties"]} <= RESERVED_NAMES | {"value", "city"}
            words |= {w for n in (f["name"], *f["parameters"]["properties"]) for w in n.split("_")}
    # nor are the words of their names, units or stations among the coined ones (but the common
    # `value` and `city`, and the prefixes `from`/`to` every world uses)
    values = set(unit_convert.METERS_PER) | {s.lower() for s in train_lookup.STATIONS}
    assert not (words | values) & set(name_words()) - {"value", "city", "from", "to"}


def test_a_world_episode_answers_from_the_tool():
    """The teacher's `tool` habit, run through the real ToolEnv, ends with the tool's answer;
    the question names the values in argument order."""
    rng = random.Random(0)
    for w in make_worlds("train", 30, 3):
        env = WorldEnv(w.row())
        turns = world_turns(w, "tool", rng)
        call = json.loads(turns[0].removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert call["name"] == w.tools[w.target].name and list(call["arguments"]) == list(w.args)
        pos = [w.question.find(str(v)) for v in w.args.values()]
        assert all(p >= 0 for p in pos)

        async def run(env=env, turns=turns):
            await env.reset()
            first = await env.step(Action(turns[0], turn=0))
            return first, await env.step(Action(turns[1], turn=1))

        first, last = asyncio.run(run())
        status = first.tool_calls[0].status
        assert status == "ok" or (status == "raised" and w.answer == "none")
        assert last.done and score(turns[1], w.answer) == {"correct": 1.0}


def test_compact_template_renders_each_tool_on_a_line_and_is_prefix_preserving():
    render = render_only_tokenizer()
    assert render.chat_template == COMPACT_TEMPLATE
    tools = [{"type": "function", "function": {"name": "f", "description": "Do f.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": ["string", "null"]},
                                         "c": {"type": "string", "enum": ["x", "y"]}}, "required": ["a"]}}}]
    text = render.apply_chat_template([{"role": "user", "content": "q"}], tools=tools, add_generation_prompt=True,
                                      tokenize=False)
    assert '- f(a: integer, b?: string | null, c?: "x" | "y"): Do f.\n' in text
    rng = random.Random(1)
    items = [(WorldEnv(w.row()), world_turns(w, h, rng)) for w, h in
             zip(make_worlds("train", 12, 5), ["tool", "malformed", "direct"] * 4)]
    segments = scripted_segments(items)  # raises if a turn does not re-render as written
    assert all(seg[0][1] is False and any(trained for _, trained in seg) for seg in segments)
    # the call-shaped lines: the name and argument names after the text they follow in a call
    call = render_only_tokenizer(CALL_TEMPLATE).apply_chat_template(
        [{"role": "user", "content": "q"}], tools=tools, add_generation_prompt=True, tokenize=False)
    assert '- {"name": "f", "arguments": {"a": integer, "b"?: string | null, "c"?: "x" | "y"}}: Do f.\n' in call
    assert call.replace(call[call.index("- {"):call.index("Do f.\n") + 6], "") == text.replace(
        '- f(a: integer, b?: string | null, c?: "x" | "y"): Do f.\n', "")
    assert scripted_segments(items, CALL_TEMPLATE) != segments


@pytest.mark.slow  # 2 s on a quiet machine, 2.5 min at a load of 20 (tokenizer training, two tiny two-phase builds)
def test_general_build_is_deterministic(tmp_path):
    """A few steps of `tidal build-general-tool-model` twice: the same tokenizer and weights, a
    summary that records what the build cost."""
    from safetensors.torch import load_file

    kw = {"steps": 2, "batch_size": 4, "train_size": 60, "eval_n": 4, "evaluate": lambda *a: {}, "tune_steps": 2}
    a, b = build_general_tool_model(tmp_path / "a", **kw), build_general_tool_model(tmp_path / "b", **kw)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    assert a["tokens_per_example"] == b["tokens_per_example"] and a["cpu_s"] > 0
    assert a["tune"]["stopped_after"] == 2 and a["tune"]["losses"] == b["tune"]["losses"]
    assert '- {{ \'{\' }}"name": ' in (tmp_path / "a" / "chat_template.jinja").read_text()  # the call template


def test_train_lookup_refuses_more_questions_than_it_has():
    """examples/envs/train_lookup.py has 1232 distinct train questions: asking for more is a clear
    error (it once drew forever at train_size 2000), asking for all of them works."""
    sys.path.insert(0, str(ROOT / "examples" / "envs"))
    try:
        import train_lookup
    finally:
        sys.path.pop(0)
    rows = train_lookup.TrainLookupEnv.rows("train", 1232, 0)
    assert len({r["prompt"] for r in rows}) == 1232
    with pytest.raises(ValueError, match="1233 train questions .* only 1232"):
        train_lookup.TrainLookupEnv.rows("train", 1233, 0)


def test_words_apart_tokenizes_a_word_the_same_wherever_it_stands(tmp_path):
    """`build_tokenizer(words_apart=True)`: a name or value is the same tokens after a space, a
    quote, a parenthesis or an underscore (what lets a call copy it token by token), in the
    built tokenizer and in the one transformers loads back; without it, it is not (the control)."""
    from transformers import AutoTokenizer

    from tidal.recipes.tool_model import build_tokenizer

    corpus = [f'- convert(value: number): Convert {w}. {{"name": "convert", "arguments": {{"to_unit": "{w}"}}}}'
              for w in ("Paris", "miles", "feet", "Oslo")] * 5

    def pieces(tok, text: str) -> list[str]:
        return [tok.decode([i]) for i in tok(text, add_special_tokens=False)["input_ids"]]

    apart, joined = build_tokenizer(corpus, 330, words_apart=True), build_tokenizer(corpus, 330)
    apart.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for tok in (apart, loaded):
        word = pieces(tok, "convert")
        assert pieces(tok, " convert")[1:] == word and pieces(tok, '"convert"')[1:-1] == word
        assert pieces(tok, "to_unit") == pieces(tok, '"to_unit')[1:] and pieces(tok, " miles")[1:] == pieces(tok, "miles")
    assert pieces(joined, " convert")[1:] != pieces(joined, "convert")


def test_copy_drills_ask_for_what_the_user_named():
    """Every drill's answer holds the names and values of its question, and only those."""
    from tidal.recipes.general_tool_model import copy_drill

    rng = random.Random(3)
    for _ in range(50):
        (user, u_trained), (answer, a_trained) = copy_drill(rng)
        assert u_trained and a_trained and answer.endswith("<|im_end|>")
        said = user.split("\n")[1].removesuffix("<|im_end|>")
        body = answer.removesuffix("<|im_end|>")
        if body.startswith("<tool_call>"):
            call = json.loads(body.removeprefix("<tool_call>").removesuffix("</tool_call>"))
            assert said == f"Call {call['name']} with " + ", ".join(f"{k} {v}" for k, v in call["arguments"].items()) + "."
        else:
            assert said == "Repeat: " + " ".join(map(str, json.loads(body)))


def test_coined_names_cannot_be_remembered():
    """At the default `COINED`, most tool names of held-out worlds never occur in 3,000 training
    worlds: a model sees each name too rarely to remember it and has to copy it. Without coined
    words (the control) most of them do occur."""
    def unseen(coined: float) -> float:
        train = {t.name for w in make_worlds("train", 3000, 0, coined=coined) for t in w.tools}
        test = [w.tools[w.target].name for w in make_worlds("test", 100, 0, coined=coined)]
        return sum(n not in train for n in test) / len(test)

    assert unseen(COINED) > 0.6 and unseen(0.0) < 0.4


@pytest.mark.slow  # 144 s here: recording 64,000 demonstrations and 100 SFT steps, then a small control
def test_build_general_tool_model_rebuilds_the_shipped_one(tmp_path):
    """`tidal build-general-tool-model` still builds the shipped `default-tool`: the same
    tokenizer (integer work: the same vocabulary and merges on any machine), the same demonstrations
    (tokens per example) and, over the first 100 of its steps, the same losses (the whole build,
    about 50 CPU minutes, is too long for CI). A change of the worlds, the drills, the template,
    the tokenizer or the loss mask changes one of these; the positive control is the loss
    check failing for a smaller build without the prompt loss."""
    import torch

    from tidal.models import GENERAL_TOOL_MODEL_DIR

    torch.set_num_threads(1)  # the shipped model was built with 1 thread
    shipped = json.loads((GENERAL_TOOL_MODEL_DIR / "tidal_build.json").read_text())
    summary = build_general_tool_model(tmp_path / "m", stop_after=100, evaluate=lambda *a: {})
    built, ours = (json.loads((d / "tokenizer.json").read_text())["model"] for d in (tmp_path / "m", GENERAL_TOOL_MODEL_DIR))
    assert built["vocab"] == ours["vocab"] and built["merges"] == ours["merges"]
    assert summary["tokens_per_example"] == shipped["tokens_per_example"]
    # The same batches in the same order, but not the same float sums: MKL's depend on the CPU and
    # on memory alignment, so even two processes on one machine differ. Measured here against the
    # shipped record: 0.0096 at step 50 and 0.0048 at step 100 (2.4365 / 1.8684 against 2.4269 /
    # 1.8636, the same in two reruns). 0.05 is five times that; the control below is 0.39 off.
    want = dict(map(tuple, shipped["losses"]))
    for step, loss in summary["losses"]:
        assert loss == pytest.approx(want[step], abs=0.05), (step, loss, want[step])
    # the positive control, small (4,000 demonstrations): a build that trains only the policy's turns
    without = build_general_tool_model(tmp_path / "n", stop_after=50, evaluate=lambda *a: {}, prompt_loss=False,
                                       train_size=4000)
    assert abs(dict(map(tuple, without["losses"]))[50] - want[50]) > 0.2  # measured 2.8166 against 2.4269
