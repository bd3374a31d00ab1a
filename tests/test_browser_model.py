"""The tiny-browser builder's data, without a browser: relabelled demonstrations keep the page
and change only its labels, and the lookup curriculum and the quote turn are written in the
snapshot's own tokens."""

from __future__ import annotations

import json
import random

import pytest

from tidal.envs.browser.scripted import resolve_ref, snapshot_elements
from tidal.models import BROWSER_MODEL_DIR
from tidal.recipes.browser_model import (
    _SnapshotPieces,
    demonstrations,
    relabel_episode,
    teacher_turns,
)

PAGE = """Page: Raven admin (/)
- generic [active] [ref=e1]:
  - heading "Raven admin" [level=1] [ref=e2]
  - paragraph [ref=e3]: Choose an action.
  - button "Renew invoice" [ref=e5]
  - button "Pause invoice" [ref=e7]
  - button "Archive subscription" [ref=e9]
  - button "Renew account" [ref=e11]"""
SUBMITTED = [{"role": "tool", "tool_call_id": "call_0_0", "name": "click",
              "content": "Page: Submitted (/submit)\n- heading \"Submitted\" [level=1] [ref=f1e1]"}]


def recorded(habit: str, target: str = "Pause invoice") -> dict:
    """An episode as `record_episode` stores it (the env's observations written out)."""
    solution = json.dumps([{"action": "click", "role": "button", "name": target}])
    turns = teacher_turns(PAGE, {"solution": solution}, habit)
    return {"task_id": "t1", "solution": solution, "habit": habit, "tools": [],
            "messages": [{"role": "system", "content": "sys"},
                         {"role": "user", "content": f'Click the "{target}" button.\n\n{PAGE}'}],
            "steps": [{"text": turns[0], "assistant": {}, "messages": SUBMITTED},
                      {"text": turns[1], "assistant": {}, "messages": []}], "reward": 1.0}


def _page_of(episode: dict) -> str:
    return episode["messages"][-1]["content"].partition("\n\n")[2]


def test_relabelling_changes_the_labels_and_nothing_else_of_the_page():
    rng = random.Random(0)
    seen_targets = set()
    for i in range(50):
        form = ("named", "line")[i % 2]
        new = relabel_episode(recorded("right"), rng, form)
        page = _page_of(new)
        target = json.loads(new["solution"])[0]["name"]
        seen_targets.add(target)
        old_lines, new_lines = PAGE.splitlines(), page.splitlines()
        assert len(old_lines) == len(new_lines)
        for a, b in zip(old_lines, new_lines):  # the same elements and refs; only button names change
            if "button" in a:
                assert a.split('"')[0] == b.split('"')[0] and a.rsplit('"', 1)[1] == b.rsplit('"', 1)[1]
            else:
                assert a == b
        names = [n for role, n, _ in snapshot_elements(page) if role == "button"]
        assert len(set(names)) == len(names) and target in names
        assert new["messages"][-1]["content"].startswith(f'Click the "{target}" button.\n\n')
        ref = resolve_ref(page, "button", target)
        said = f'Target: "{target}", button "{target}" [ref={ref}]\n' if form == "line" else f'"{target}" is {ref}.\n'
        assert new["steps"][0]["text"].startswith(said)
        call = new["steps"][0]["assistant"]["tool_calls"][0]["function"]
        assert call["name"] == "click" and json.loads(call["arguments"]) == {"ref": ref}
        assert new["steps"][0]["messages"] == SUBMITTED and new["reward"] == 1.0
    assert len(seen_targets) > 25  # fresh targets, not a handful


def test_the_first_habit_relabelled_clicks_the_first_button_and_scores_by_chance():
    rng = random.Random(1)
    rewards = []
    for _ in range(200):
        new = relabel_episode(recorded("first"), rng)
        call = new["steps"][0]["assistant"]["tool_calls"][0]["function"]
        assert json.loads(call["arguments"]) == {"ref": "e5"}
        first = next(n for role, n, _ in snapshot_elements(_page_of(new)) if role == "button")
        rewards.append(new["reward"])
        assert new["reward"] == float(first == json.loads(new["solution"])[0]["name"])
    # 4 buttons: the target is first a quarter of the time; 200 draws, ±4.6 sigma
    assert 0.1 < sum(rewards) / len(rewards) < 0.4


def test_demonstrations_keep_the_recorded_habits_and_refuse_a_malformed_relabel():
    eps = [recorded("right"), recorded("first"), recorded("malformed")]
    demos = demonstrations(eps, 5, random.Random(2))
    assert [d["habit"] for d in demos] == ["right"] * 5 + ["first"] * 5 + ["malformed"] * 5
    assert all(d is eps[2] for d in demos[10:])  # its error observation quotes what it typed
    with pytest.raises(ValueError, match="only right and first"):
        relabel_episode(eps[2], random.Random(0))


def test_the_lookup_curriculum_and_the_quote_turn_use_the_snapshot_lines_own_tokens():
    """The lookup curriculum builds lines and queries from pieces of the tokenizer's own split of
    a snapshot line; the quote turn writes the label after `the "`, then the line's fill, so the
    tokens before the ref in the turn occur in the page once: right before that button's ref."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BROWSER_MODEL_DIR)
    pieces = _SnapshotPieces(tok)
    assert tok.convert_ids_to_tokens(pieces.fill) == ['"', "Ġ[", "ref", "=e"]  # 4 levels of fill
    for label, ref in (("Renew invoice", 5), ("Pause", 12), ("Archive subscription", 39)):
        line = pieces.lead + pieces.label_ids[label] + pieces.fill + pieces.ref(ref) + pieces.end
        assert line == pieces.encode(f'- button "{label}" [ref=e{ref}]\n'), label
    page = pieces.encode(recorded("right", "Renew invoice")["messages"][-1]["content"])
    solution = json.dumps([{"action": "click", "role": "button", "name": "Renew invoice"}])
    turn = pieces.encode(teacher_turns(PAGE, {"solution": solution}, "right", form="quote")[0])
    key = pieces.label_ids["Renew invoice"] + pieces.fill
    assert turn[:len(pieces.query) + len(key)] == pieces.query + key
    after = [page[i + len(key):i + len(key) + 1] for i in range(len(page)) if page[i:i + len(key)] == key]
    assert after == [pieces.ref(5)]  # once, the look-alike "Renew account" not matched
    # the curriculum's right turn is the teacher's, token for token: the ref looked up, then clicked
    ids, mask = pieces.quote_turn("Renew invoice", 5)
    assert ids == turn and [t for t, on in zip(ids, mask) if on] == pieces.ref(5) * 2
    assert turn[-len(pieces.click_tail) - len(pieces.ref(5)):-len(pieces.click_tail)] == pieces.ref(5)


def test_a_tokenizer_that_merges_across_the_snapshot_lines_parts_is_refused_by_name():
    """A tokenizer without Qwen's pre-split learns merges across the quote that ends a label; the
    lookup curriculum would then train on tokens the policy never reads, so it refuses with the
    line it could not split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    lines = [f'- button "{label}" [ref=e{n}]\n' for n, label in enumerate(["Renew", "Pause", "Renew invoice"] * 50)]
    bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    merged = PreTrainedTokenizerFast(tokenizer_object=bpe)
    assert len(merged.tokenize('Renew" [ref=e')) < len('Renew" [ref=e')  # it did learn merges
    with pytest.raises(ValueError, match=r"merges across the parts of the snapshot line '- button \"Cancel\" \[ref=e12\]"):
        _SnapshotPieces(merged)


def test_the_builder_refuses_settings_that_would_teach_one_turn_and_demonstrate_another(tmp_path):
    """The lookup curriculum teaches the quote form's turn; with another form it would train a turn
    that no demonstration shows, so the builder refuses before recording anything."""
    from tidal.recipes.browser_model import build_browser_model

    with pytest.raises(ValueError, match="lookup_steps needs form='quote'.*'named'"):
        build_browser_model(tmp_path / "m", form="named")
    with pytest.raises(ValueError, match="form must be one of named, line, quote, got 'quoted'"):
        build_browser_model(tmp_path / "m", form="quoted")
    with pytest.raises(ValueError, match="habits must be fractions"):
        build_browser_model(tmp_path / "m", habits={"right": 0.5, "lucky": 0.5})
    assert not (tmp_path / "m").exists()
