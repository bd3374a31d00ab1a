"""Does the embedded general tool model (`default-tool`, tidal/recipes/general_tool_model.py)
call tools it was never trained on, from their schemas alone (examples/envs/unit_convert.py,
examples/envs/train_lookup.py), often enough for RL to start? For `convert`, `weather_at` and
`list_trains`, yes. The measures are tidal/recipes/tool_probe.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tidal.models import GENERAL_TOOL_MODEL_DIR, TOOL_MODEL_DIR, resolve_model_dir
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


def test_default_tool_calls_an_unseen_tool_from_its_schema():
    """Threshold 0.1 of 48 sampled first turns (12 held-out questions, 4 samples, T=1): GRPO
    needs a group (8 samples at examples/unit_convert.yaml) with a success in it, and at p = 0.1
    per sample a group holds a well-formed call with probability 1 - 0.9**8 = 0.57, so about 9 of
    a step's 16 groups carry signal. Measured 19/48 (0.40); 0.1 leaves room for the few samples
    that another CPU's float sums may turn. The positive control: the tool_arith-only `tiny-tool`
    calls `convert` on none (every call a parse error or an unknown name)."""
    unit_convert, _ = _examples()
    assert resolve_model_dir("default-tool") == GENERAL_TOOL_MODEL_DIR  # the name the examples use
    assert first_turn_calls(GENERAL_TOOL_MODEL_DIR, unit_convert.UnitConvertEnv, "convert") >= 0.1
    assert first_turn_calls(TOOL_MODEL_DIR, unit_convert.UnitConvertEnv, "convert") < 0.1


def test_default_tool_picks_weather_at_of_two_unseen_tools():
    """`train_lookup` puts two tools in the prompt; on its weather questions (a few of
    each split) the model has to pick `weather_at(city)` over `list_trains`. The same threshold and
    reasoning as for `convert` (measured 9/48, 0.19: 9 of the 16 turns on the 4 weather questions among the 12).
    Controls: `tiny-tool` calls it on none, and so did the build before the wide worlds
    (`weather_weather(...)`, docs/agents.md)."""
    _, train_lookup = _examples()
    assert first_turn_calls(GENERAL_TOOL_MODEL_DIR, train_lookup.TrainLookupEnv, "weather_at") >= 0.1
    assert first_turn_calls(TOOL_MODEL_DIR, train_lookup.TrainLookupEnv, "weather_at") < 0.1


def test_default_tool_calls_list_trains_from_its_schema():
    """The same for `train_lookup`'s `list_trains(origin, destination)`, two tools in the prompt
    and most of the questions. Measured 7/48 (0.15); threshold 0.06 (3 of 48), where a group of 8
    still holds a well-formed call with probability 1 - 0.94**8 = 0.39, so float sums that turn a
    few samples on another CPU do not fail it. Control: `tiny-tool` calls it on none; so did the
    build before the wide worlds (`list_trains(origines=...)`, docs/agents.md)."""
    _, train_lookup = _examples()
    assert first_turn_calls(GENERAL_TOOL_MODEL_DIR, train_lookup.TrainLookupEnv, "list_trains") >= 0.06
    assert first_turn_calls(TOOL_MODEL_DIR, train_lookup.TrainLookupEnv, "list_trains") < 0.06


def test_copy_spans_are_the_name_argument_names_and_values():
    """call_copy_losses splits a call's tokens by these spans: each is exactly its text, even
    where a value repeats an argument's name."""
    args = {"value": 157, "from_unit": "from_unit", "to_unit": "inches"}
    call = call_text("convert", args)
    spans = _spans(call, "convert", args)
    assert [call[a:b] for a, b in spans["name"]] == ["convert"]
    assert [call[a:b] for a, b in spans["arg_name"]] == ["value", "from_unit", "to_unit"]
    assert [call[a:b] for a, b in spans["value"]] == ["157", '"from_unit"', '"inches"']
