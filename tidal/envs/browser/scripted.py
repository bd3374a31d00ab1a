"""A scripted policy for the browser environment: it plays a task's action steps (a row's
`solution` or `wrong`) through a `BrowserEnv`, as a model would, from the observations alone.

A step names its element by role and accessible name (`{"action": "click", "role": "button",
"name": "Save"}`), never by ref: refs are only known once the page is seen. `resolve_ref` finds
the ref in the latest snapshot (the line `- button "Save" [ref=e4]`), `scripted_action` turns a
step into the turn's text (one `<tool_call>` per turn), and `run_episode` plays the steps one
turn each and returns the reward. Tests use it to show every family's solution scores 1 (and
its wrong sequence 0); benchmarks/browser.py uses it to drive episodes.

    reward, turns = await run_episode(BrowserEnv(row, 0, pool=pool), row, "solution")
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from tidal.envs.base import Action

ACTIONS = ("click", "type", "select", "scroll", "press", "go_back", "done")
STEP_KEYS = ("action", "role", "name")  # the rest of a step are the tool's arguments (text, option, key, answer)

# One element of `aria_snapshot(mode="ai")`, after YAML's single quotes are undone:
# role, then its name as a JSON string, then attributes: `button "Save" [disabled] [ref=e4]`.
_ELEMENT = re.compile(r'(?P<role>[a-z]+)(?: "(?P<name>(?:[^"\\]|\\.)*)")?(?P<attrs>(?: \[[^\]]*\])*)')
_REF = re.compile(r"\[ref=([^\]\s]+)\]")
_QUOTED = re.compile(r"'((?:[^']|'')*)'")


class ScriptError(LookupError):
    """A step that cannot be played on the page seen: no element, or several, of its role and
    name; or an error observation where the script expected none."""


def snapshot_elements(snapshot: str) -> Iterator[tuple[str, str, str]]:
    """(role, name, ref) of every element of the snapshot that has a ref, in page order (an
    element without a name has name "")."""
    for line in snapshot.splitlines():
        text = line.lstrip()
        if not text.startswith("- "):
            continue
        text = text[2:]
        if text.startswith("'"):  # YAML quotes a line holding ": " or " #"; '' is a quote inside
            quoted = _QUOTED.match(text)
            if not quoted:
                continue
            text = quoted.group(1).replace("''", "'")
        m = _ELEMENT.match(text)
        ref = _REF.search(m.group("attrs")) if m else None
        if ref:
            name = json.loads(f'"{m.group("name")}"') if m.group("name") is not None else ""
            yield m.group("role"), name, ref.group(1)


def resolve_ref(snapshot: str, role: str, name: str) -> str:
    """The ref of the one element of `role` named `name` (exactly, whitespace collapsed) in
    `snapshot`; ScriptError naming what the page has when none or several match."""
    want = " ".join(name.split())
    elements = list(snapshot_elements(snapshot))
    refs = [ref for r, n, ref in elements if r == role and " ".join(n.split()) == want]
    if len(refs) == 1:
        return refs[0]
    if refs:
        raise ScriptError(f'{len(refs)} elements are {role} "{name}" (refs {", ".join(refs)}): the step is ambiguous')
    same_role = [f'"{n}"' for r, n, _ in elements if r == role]
    seen = f"the {role}s are {', '.join(same_role)}" if same_role else f"it has no {role}"
    raise ScriptError(f'no {role} "{name}" on the page ({seen})')


def scripted_action(snapshot: str, step: dict[str, Any]) -> str:
    """The turn that plays `step` on the page `snapshot`: one tool call, its ref resolved from
    the step's role and name (steps without a role, like press or done, need none)."""
    action = step.get("action")
    if action not in ACTIONS:
        raise ScriptError(f"step {step} has no known action (actions: {', '.join(ACTIONS)})")
    arguments = {k: v for k, v in step.items() if k not in STEP_KEYS and v is not None}
    if "role" in step:
        arguments = {"ref": resolve_ref(snapshot, step["role"], step.get("name", "")), **arguments}
    return f"<tool_call>{json.dumps({'name': action, 'arguments': arguments})}</tool_call>"


async def run_episode(env: Any, row: dict[str, Any] | None = None, column: str = "solution", *,
                      steps: list[dict[str, Any]] | None = None, strict: bool = True) -> tuple[float, int]:
    """Play `steps` (default: the row's `column`, JSON or a list; the row defaults to the env's)
    through `env`, a BrowserEnv, one tool call a turn; close the env; return (reward, turns).

    The episode ends at the env's verdict (a done step, or its max_turns); steps that run out
    before it are followed by a turn without a tool call, which ends it. `strict`: an error
    observation raises ScriptError (a script that does not fit its page); otherwise the
    episode goes on from the page seen before it."""
    row = env.row if row is None else row
    if steps is None:
        steps = json.loads(row[column]) if isinstance(row[column], str) else row[column]
    turns = 0
    try:
        observation = (await env.reset())[-1]["content"]
        for i, step in enumerate([*steps, None]):
            text = "" if step is None else scripted_action(observation, step)
            result = await env.step(Action(text, turn=turns))
            turns += 1
            if result.done:
                return result.reward, turns
            content = result.messages[-1]["content"]
            if not content.startswith("error:"):
                observation = content
            elif strict:
                raise ScriptError(f"task {row.get('task_id', '?')}: step {i} {step} got an error observation: "
                                  f"{content[:300]}")
        raise ScriptError(f"task {row.get('task_id', '?')}: the episode did not end after a turn without a tool call")
    finally:
        await env.close()
