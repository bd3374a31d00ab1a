"""The browser task generator (tidal.envs.browser.tasks): rows, splits and the verifier `check`.
Each family end to end in Chromium, through the environment and its pool (the `solution`
scores 1, the `wrong` sequence 0), is tests/test_browser_env.py."""

from __future__ import annotations

import json

import pytest

from tidal.envs.browser.tasks import FAMILIES, check, make_tasks, parse_form

FORBIDDEN = ["Math.random", "Date", "performance", "setTimeout", "setInterval", "requestAnimationFrame", "http://",
             "https://", "transition", "animation", "@import", "<img", "url("]


def test_rows_are_deterministic_and_plain():
    rows = make_tasks("train", 21, seed=3)
    assert rows == make_tasks("train", 21, seed=3)
    assert {r["task_id"] for r in rows}.isdisjoint(r["task_id"] for r in make_tasks("train", 21, seed=4))
    assert [r["family"] for r in rows[:len(FAMILIES)]] == list(FAMILIES)
    for r in rows:
        assert json.loads(json.dumps(r)) == r
        assert r["task_id"].startswith(f"browser-{r['family']}-") and r["prompt"] == [{"role": "user", "content": r["instruction"]}]
        pages = json.loads(r["pages"])
        assert r["start"] in pages and "/submit" not in pages
        for path, doc in pages.items():
            assert doc.startswith("<!doctype html>") and '<meta charset="utf-8">' in doc and "<title>" in doc, path
            assert not [w for w in FORBIDDEN if w in doc], (r["task_id"], path)
        assert json.loads(r["verifier"])["kind"] in ("submit", "answer", "visit")
        for step in json.loads(r["solution"]) + json.loads(r["wrong"]):
            assert '"' not in step.get("name", "") and "\\" not in step.get("name", "")


def test_splits_are_disjoint_and_every_family_is_there():
    train, test = make_tasks("train", 140, seed=0), make_tasks("test", 140, seed=0)
    assert len({r["task_id"] for r in train}) == 140 and len({r["task_id"] for r in test}) == 140
    assert {r["task_id"] for r in train}.isdisjoint(r["task_id"] for r in test)
    assert {r["pages"] for r in train}.isdisjoint(r["pages"] for r in test)
    assert {r["family"] for r in train} == {r["family"] for r in test} == set(FAMILIES)
    assert {json.loads(r["verifier"])["kind"] for r in train} == {"submit", "answer", "visit"}
    one = make_tasks("test", 6, seed=1, families=["navigate", "search"])
    assert [r["family"] for r in one] == ["navigate", "search"] * 3


def test_unknown_family_or_split_is_named():
    with pytest.raises(ValueError, match=r"unknown task families \['drag_drop'\].*click_button"):
        make_tasks("train", 2, 0, families=["click_button", "drag_drop"])
    with pytest.raises(ValueError, match="split must be 'train' or 'test', got 'dev'"):
        make_tasks("dev", 2, 0)
    with pytest.raises(ValueError, match="unknown verifier kind 'scroll'"):
        check({"kind": "scroll", "expect": 1}, [], None, "/")


def test_parse_form_keeps_blanks_and_the_last_value():
    assert parse_form("a=1&b=&c=x+y&a=2&d=%40") == {"a": "2", "b": "", "c": "x y", "d": "@"}
    assert parse_form("") == {}


def test_check_submit():
    spec = {"kind": "submit", "expect": {"email": "ann@example.org", "note": ""}}
    assert check(spec, [{"email": " ann@example.org ", "note": "", "extra": "fine"}], None, "/submit") == 1.0
    assert check(json.dumps(spec), [{"email": "ann@example.org", "note": ""}], None, "/") == 1.0
    assert check(spec, [{"email": "bob@example.org", "note": ""}], None, "/") == 0.0
    assert check(spec, [{"email": "ann@example.org"}], None, "/") == 0.0  # a listed blank field must be there
    assert check(spec, [], None, "/") == 0.0
    assert check(spec, [{"email": "ann@example.org", "note": ""}, {"email": "x"}], None, "/") == 0.0  # the last counts


def test_check_answer_and_visit():
    spec = {"kind": "answer", "expect": "Head of  Sales"}
    assert check(spec, [], "  head of\nsales ", "/") == 1.0
    assert check(spec, [], "Head of Support", "/") == 0.0
    assert check(spec, [], None, "/") == 0.0
    visit = {"kind": "visit", "expect": "/offices/lisbon"}
    assert check(visit, [], None, "/offices/lisbon") == 1.0
    assert check(visit, [], None, "/offices/porto") == 0.0
    assert check(visit, [], None, None) == 0.0
