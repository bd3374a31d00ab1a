"""Unit conversion with a tool: a complete ToolEnv (docs/agents.md), written as a user writes one.

    tidal train examples/unit_convert.yaml

The tool, its system prompt and its questions are this file's own: the embedded tiny tool model
was never trained on them (tests/test_tool_worlds.py checks that no generated tool is named
like them). A question names a length and two units; the policy calls `convert` and answers
with the number it returned.
"""

import hashlib
import random
import re

from tidal.envs.tool_env import ToolEnv

METERS_PER = {"meters": 1.0, "feet": 0.3048, "inches": 0.0254, "yards": 0.9144, "miles": 1609.344,
              "kilometers": 1000.0, "centimeters": 0.01}
SYSTEM_PROMPT = "You convert lengths with the convert tool. Reply with <answer>number</answer>."
QUESTIONS = ("Convert {value} {from_unit} to {to_unit}.", "Convert {value} {from_unit} into {to_unit}.",
             "What is {value} {from_unit} in {to_unit}?", "How many {to_unit} are in {value} {from_unit}?")


def convert(value: float, from_unit: str, to_unit: str) -> float:
    """Convert a length from one unit to another.

    Args:
        value: the length
        from_unit: its unit: meters, feet, inches, yards, miles, kilometers or centimeters
        to_unit: the unit wanted, one of the same
    """
    for unit in (from_unit, to_unit):
        if unit not in METERS_PER:
            raise ValueError(f"unknown unit {unit!r} (known: {', '.join(METERS_PER)})")
    return round(value * METERS_PER[from_unit] / METERS_PER[to_unit], 2)


class UnitConvertEnv(ToolEnv):
    name = "unit_convert"
    tools = (convert,)
    default_system_prompt = SYSTEM_PROMPT

    @classmethod
    def rows(cls, split: str, n: int, seed: int) -> list[dict]:
        """`n` questions; one in five (by a hash of its text) is held out ("test")."""
        rng, rows, seen = random.Random(f"convert-{split}-{seed}"), [], set()
        while len(rows) < n:
            from_unit, to_unit = rng.sample(sorted(METERS_PER), 2)
            value = rng.randint(2, 999) if rng.random() < 0.7 else round(rng.uniform(1, 99), 1)
            text = rng.choice(QUESTIONS).format(value=value, from_unit=from_unit, to_unit=to_unit)
            held_out = hashlib.sha256(text.encode()).digest()[0] % 5 == 0
            if text in seen or held_out != (split == "test"):
                continue
            seen.add(text)
            rows.append({"prompt": text, "answer": convert(value, from_unit, to_unit)})
        return rows


ANSWER = re.compile(r"<answer>\s*(-?[\d.]+)\s*</answer>")


def score(completion: str, answer: float) -> dict:
    """correct: the last answer is the conversion, to the tool's two decimals."""
    found = ANSWER.findall(completion)
    try:
        right = bool(found) and abs(float(found[-1]) - float(answer)) <= 0.011
    except ValueError:  # "1.2.3" is not a number
        right = False
    return {"correct": float(right)}
