"""The scripted browser policy's resolver (tidal.envs.browser.scripted), on snapshot text as
Playwright's `aria_snapshot(mode="ai")` writes it: no browser needed."""

from __future__ import annotations

import json

import pytest

from tidal.envs.browser.scripted import ScriptError, resolve_ref, scripted_action, snapshot_elements

SNAPSHOT = """Page: Form (/)
- generic [active] [ref=e1]:
  - heading "Form" [level=1] [ref=e2]
  - textbox "Email" [ref=e5]
  - combobox "Country" [ref=e6]:
    - option "Spain" [selected]
  - checkbox "I agree" [checked] [ref=e8]
  - button "Save" [ref=e9]
  - button "Save" [ref=e10]
  - 'button "Say \\"hi\\" \\\\ now: it''s late" [ref=f1e11]'
  - 'button "a: b #c" [ref=e12]': x
  - button [ref=e13]
  - link "Next page" [ref=e14]:
    - /url: /b"""


def test_elements_are_parsed_with_yaml_quotes_and_escaped_names():
    elements = list(snapshot_elements(SNAPSHOT))
    assert ("button", 'Say "hi" \\ now: it\'s late', "f1e11") in elements
    assert ("button", "a: b #c", "e12") in elements and ("button", "", "e13") in elements
    assert all(role != "option" for role, _, _ in elements)  # no ref, not an element one can act on


def test_resolve_ref_finds_one_and_names_the_problem_otherwise():
    assert resolve_ref(SNAPSHOT, "textbox", "Email") == "e5"
    assert resolve_ref(SNAPSHOT, "checkbox", "I  agree") == "e8"  # whitespace collapsed
    with pytest.raises(ScriptError, match=r'2 elements are button "Save" \(refs e9, e10\)'):
        resolve_ref(SNAPSHOT, "button", "Save")
    with pytest.raises(ScriptError, match=r'no link "Home" on the page \(the links are "Next page"\)'):
        resolve_ref(SNAPSHOT, "link", "Home")


def test_scripted_action_is_one_tool_call():
    def call(text: str) -> dict:
        assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
        return json.loads(text[len("<tool_call>"):-len("</tool_call>")])

    assert call(scripted_action(SNAPSHOT, {"action": "type", "role": "textbox", "name": "Email", "text": "a@b"})) == {
        "name": "type", "arguments": {"ref": "e5", "text": "a@b"}}
    assert call(scripted_action(SNAPSHOT, {"action": "select", "role": "combobox", "name": "Country",
                                           "option": "Spain"}))["arguments"] == {"ref": "e6", "option": "Spain"}
    assert call(scripted_action(SNAPSHOT, {"action": "press", "key": "Enter"})) == {"name": "press",
                                                                                   "arguments": {"key": "Enter"}}
    assert call(scripted_action(SNAPSHOT, {"action": "done"})) == {"name": "done", "arguments": {}}
    with pytest.raises(ScriptError, match="no known action"):
        scripted_action(SNAPSHOT, {"action": "hover", "role": "button", "name": "Save"})
