"""Sessions → episodes (tidal/runtime/sessions.py): continuation, prefix breaks, branches,
and that no token the policy did not generate is ever trained, nor any trained twice.

The tokenizer here is one token per character (ord), so a text and its tokens are the same
thing and every expectation can be written out."""

from __future__ import annotations

import pytest

from tidal.runtime.sessions import Session, SessionLimit
from tidal.types import Episode


def tok(text: str) -> list[int]:
    return [ord(c) for c in text]


def generate(session: Session, prompt: str, *completions: str, version: int = 0):
    """One call: the prompt, then each choice's completion (as the engine would return it)."""
    call, ids = session.begin_call(prompt, tok)
    for c, text in enumerate(completions):
        session.add_completion(call, c, tok(text), [-0.5] * len(text), [version] * len(text), "stop", text, text, [],
                               version)
    return call, ids


def fill(session: Session, policy: str = "split") -> Episode:
    ep = Episode("e", "g", "t", "agent")
    session.fill(ep, policy)
    return ep


def trained_text(ep: Episode) -> list[str]:
    """The runs of trained tokens, as text."""
    runs, cur = [], []
    for t, m in zip(ep.tokens, ep.loss_mask):
        if m:
            cur.append(chr(t))
        elif cur:
            runs.append("".join(cur))
            cur = []
    if cur:
        runs.append("".join(cur))
    return runs


def test_a_call_that_extends_the_last_one_continues_its_tokens():
    s = Session("e")
    _, ids0 = generate(s, "Q:", "A1|")
    _, ids1 = generate(s, "Q:A1|obs;", "A2|")
    assert ids0 == tok("Q:") and ids1 == tok("Q:A1|obs;")  # the engine got the context it produced, extended
    ep = fill(s)
    assert "".join(map(chr, ep.tokens)) == "Q:A1|obs;A2|" and ep.segments == [0]
    assert trained_text(ep) == ["A1|", "A2|"]
    assert [(t.start, t.end, t.obs_end) for t in ep.turns] == [(2, 5, 9), (9, 12, 12)]
    assert ep.prompt_len == 2 and ep.metrics["rollout/prefix_breaks"] == 0
    assert {ep.logprobs[i] for i, m in enumerate(ep.loss_mask) if m} == {-0.5}
    assert {ep.versions[i] for i, m in enumerate(ep.loss_mask) if not m} == {-1}


def test_continuation_reuses_the_recorded_tokens_not_a_retokenization():
    # The tokenizer of the second call would split the text differently (a merge): the context
    # tokens come from the record, only the appended text is tokenized.
    s = Session("e")
    generate(s, "Q:", "AB")
    def merged(text):  # would merge the whole text into one token
        return [999] if text == "Q:AB+" else tok(text)

    _, ids = s.begin_call("Q:AB+", merged)
    assert ids == tok("Q:AB") + tok("+")


def test_an_edited_history_is_a_prefix_break_with_split_and_continue():
    s = Session("e")
    generate(s, "Q:", "long reasoning A1|")
    generate(s, "Q:A1|obs;", "A2|")  # the agent dropped its reasoning: nothing earlier is a prefix
    ep = fill(s, "split")
    assert ep.metrics["rollout/prefix_breaks"] == 1 and len(ep.segments) == 2
    assert trained_text(ep) == ["long reasoning A1|", "A2|"]
    # the re-rendered "A1|" in the second segment is context the policy did not generate there: masked
    second = ep.segments[1]
    assert "".join(chr(t) for t, m in zip(ep.tokens[second:], ep.loss_mask[second:]) if not m) == "Q:A1|obs;"
    ep = fill(s, "continue")
    assert trained_text(ep) == ["A2|"]  # only the last segment is trained
    assert len(ep.turns) == 2 and ep.turns[0].text == "long reasoning A1|"  # kept in the record, masked


def test_dropped_history_starts_a_new_root():
    s = Session("e")
    generate(s, "Q:", "A1|")
    generate(s, "Summary. Q2:", "A2|")  # the agent replaced its whole history
    ep = fill(s)
    assert ep.metrics["rollout/prefix_breaks"] == 1 and ep.segments == [0, 5]
    assert "".join(map(chr, ep.tokens[5:])) == "Summary. Q2:A2|" and trained_text(ep) == ["A1|", "A2|"]
    assert ep.metrics["gateway/branches"] == 0


def test_branches_of_n_choices_train_each_generated_token_once():
    s = Session("e")
    generate(s, "Q:", "x|", "y|")  # n=2
    generate(s, "Q:y|obs;", "z|")  # the agent went on with the second choice
    ep = fill(s, "split")
    assert ep.metrics["gateway/branches"] == 1 and ep.metrics["rollout/prefix_breaks"] == 0
    assert trained_text(ep) == ["x|", "y|", "z|"]
    # the chain of the last call is the last segment; the shared prompt is context in both
    last = ep.segments[-1]
    assert "".join(map(chr, ep.tokens[last:])) == "Q:y|obs;z|"
    assert trained_text(fill(s, "continue")) == ["y|", "z|"]


def test_a_retried_prompt_reuses_its_node_and_both_replies_are_trained():
    s = Session("e")
    generate(s, "Q:", "a|")
    _, ids = generate(s, "Q:", "b|")  # the same prompt again (a retry)
    assert ids == tok("Q:")
    ep = fill(s)
    assert trained_text(ep) == ["a|", "b|"] and ep.metrics["rollout/prefix_breaks"] == 0
    assert sum(1 for n in s.nodes if n.kind == "prompt") == 1


def test_turn_and_token_budgets_refuse_the_call_and_are_recorded():
    s = Session("e", max_calls=1)
    generate(s, "Q:", "a|")
    with pytest.raises(SessionLimit, match="max_turns"):
        s.begin_call("Q:a|more", tok)
    assert s.limit_hit == "turns"
    s = Session("e", max_total_tokens=6)
    call, _ = generate(s, "Q:", "abc")
    assert s.room(call) == 4
    with pytest.raises(SessionLimit, match="max_total_tokens"):
        s.begin_call("Q:abc+++", tok)
    assert s.limit_hit == "tokens"


def test_a_closed_session_takes_no_call():
    s = Session("e")
    s.open = False
    with pytest.raises(KeyError, match="closed"):
        s.begin_call("Q:", tok)


def test_token_id_prompts_match_by_ids():
    s = Session("e")
    call, _ = s.begin_call("", tok, prompt_ids=[1, 2])
    s.add_completion(call, 0, [3, 4], [-1.0, -1.0], [0, 0], "stop", "", "", [], 0)
    call, ids = s.begin_call("", tok, prompt_ids=[1, 2, 3, 4, 5])
    s.add_completion(call, 0, [6], [-1.0], [0], "stop", "", "", [], 0)
    assert ids == [1, 2, 3, 4, 5]
    ep = fill(s)
    assert ep.tokens == [1, 2, 3, 4, 5, 6] and ep.loss_mask == [False, False, True, True, False, True]
