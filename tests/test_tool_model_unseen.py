"""Does the shipped tiny tool model call tools it was never trained on, from their schemas alone
(examples/envs/unit_convert.py, examples/envs/train_lookup.py), often enough for RL to start?
Not yet: the test is a strict xfail that states the gap (issue #47, item 1). The measures are
tidal/recipes/tool_probe.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tidal.models import TOOL_MODEL_DIR
from tidal.recipes.tool_model import call_text
from tidal.recipes.tool_probe import _spans, first_turn_calls

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


def _examples():
    sys.path.insert(0, str(ROOT / "examples" / "envs"))
    try:
        import train_lookup
        import unit_convert
    finally:
        sys.path.pop(0)
    return unit_convert, train_lookup


@pytest.mark.xfail(strict=True, reason="the shipped tiny-tool knows only tool_arith's calculator; a build that "
                   "generalizes over tool schemas is not reached yet (docs/agents.md, 'Tools the model never saw')")
def test_shipped_tool_model_calls_unseen_tools_from_their_schemas():
    """Threshold 0.2 of sampled first turns: RL's GRPO needs a group (8 samples at
    examples/unit_convert.yaml) with a success in it, and at p = 0.2 per sample a group of 8
    holds a well-formed call with probability 1 - 0.8**8 = 0.83. The shipped model calls
    neither tool (every call a parse error: measured in docs/agents.md), hence the strict xfail:
    it turns into a failure, to be removed, the day a model that does is shipped."""
    unit_convert, train_lookup = _examples()
    assert first_turn_calls(TOOL_MODEL_DIR, unit_convert.UnitConvertEnv, "convert") >= 0.2
    assert first_turn_calls(TOOL_MODEL_DIR, train_lookup.TrainLookupEnv, "list_trains") >= 0.2 * 0.75


def test_copy_spans_are_the_name_argument_names_and_values():
    """call_copy_losses splits a call's tokens by these spans: each is exactly its text, even
    where a value repeats an argument's name."""
    args = {"value": 157, "from_unit": "from_unit", "to_unit": "inches"}
    call = call_text("convert", args)
    spans = _spans(call, "convert", args)
    assert [call[a:b] for a, b in spans["name"]] == ["convert"]
    assert [call[a:b] for a, b in spans["arg_name"]] == ["value", "from_unit", "to_unit"]
    assert [call[a:b] for a, b in spans["value"]] == ["157", '"from_unit"', '"inches"']
