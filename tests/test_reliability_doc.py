"""docs/reliability.md is a table of every fault with the tests that show it, and this test
keeps it true: every row names at least one test as `tests/path.py::test_name` (`::name`
alone: the same file as the reference before it), each exists, and one that is marked slow
says `(slow` after its name (so the table tells which run in `make test`); every
`section.key` the page names is a key of the config, and a default it quotes as
`` `section.key` (default VALUE) `` is the config's own default (a default cannot drift).

To add a fault: a row `| fault | what happens | `tests/...::test_...` |`."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from tidal.config import TidalConfig

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reliability.md"
REF = re.compile(r"`((?:tests/[\w/]+\.py)?::\w+)`( \(slow)?")
DEFAULT = re.compile(r"`([a-z_]+(?:\.[a-z_]+)+)` \(default ([^);,]+)")
KEY = re.compile(r"`([a-z_]+(?:\.[a-z_]+)+)(?:=[^`]*)?`")
FILE_SUFFIXES = {"jsonl", "json", "yaml", "log", "parquet", "safetensors", "pt", "md", "py", "tmp", "lock"}


def rows(text: str) -> list[list[str]]:
    """The table's rows (cells), header and rule left out."""
    out = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("| ---") and not line.startswith("| fault |"):
            out.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return out


@functools.cache
def _tests_of(path: str) -> dict[str, bool]:
    """Each test function of a test file, and whether it is marked slow (by its decorator or the
    module's pytestmark)."""
    tree = ast.parse((ROOT / path).read_text())
    module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                      and "mark.slow" in ast.unparse(n.value) for n in tree.body)
    # A decorator `pytest.mark.slow` marks the whole test (slow parameters of a parametrized one
    # do not: the row says which run where).
    return {n.name: module_slow or any(ast.unparse(d).split("(")[0] == "pytest.mark.slow" for d in n.decorator_list)
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def config_defaults() -> dict[str, object]:
    """Every key of the config (`section.key`, nested sections joined by dots) with its default."""
    out: dict[str, object] = {}

    def walk(model, prefix: str) -> None:
        for name in type(model).model_fields:
            value = getattr(model, name)
            if hasattr(type(value), "model_fields"):
                walk(value, f"{prefix}{name}.")
            out[f"{prefix}{name}"] = value
    walk(TidalConfig(), "")
    return out


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)  # exactly: `:g` writes 1048576 as 1.04858e+06
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def problems(text: str) -> list[str]:
    """What is wrong with the page `text`: a row without a test, a test that does not exist or
    whose slow mark the row does not say, a key that is not the config's, a quoted default
    that is not the config's."""
    out = []
    table = rows(text)
    if not table:
        out.append("the page has no table of faults")
    for cells in table:
        if len(cells) != 3:
            out.append(f"row {cells[0][:60]!r}: {len(cells)} cells, want 3 (fault | what happens | test)")
            continue
        refs = REF.findall(cells[2])
        if not refs:
            out.append(f"row {cells[0][:60]!r} names no test (`tests/...py::test_name`)")
        file = None
        for ref, slow_said in refs:
            path, _, name = ref.partition("::")
            file = path or file
            if file is None or not (ROOT / file).is_file():
                out.append(f"row {cells[0][:60]!r}: {ref} names no test file")
                continue
            tests = _tests_of(file)
            if name not in tests:
                out.append(f"row {cells[0][:60]!r}: {file} has no test {name}")
            elif tests[name] != bool(slow_said):
                out.append(f"row {cells[0][:60]!r}: {file}::{name} is {'' if tests[name] else 'not '}marked slow, "
                           f"the row says {'(slow' if slow_said else 'nothing'}")
    defaults = config_defaults()
    sections = {k for k in defaults if "." not in k}
    for key in KEY.findall(text):
        if key.split(".")[0] in sections and key.rsplit(".", 1)[1] not in FILE_SUFFIXES and key not in defaults:
            out.append(f"`{key}` is not a key of the config")
    for key, quoted in DEFAULT.findall(text):
        if key not in defaults:
            continue  # named above
        value = quoted.removesuffix(" s").strip()
        if value != _shown(defaults[key]):
            out.append(f"the page quotes `{key}` (default {quoted}), the config's default is {_shown(defaults[key])}")
    return out


def test_the_reliability_table_names_existing_tests_and_the_configs_defaults():
    assert problems(PAGE.read_text()) == []
    assert len(rows(PAGE.read_text())) >= 20  # the table itself was read


@pytest.mark.parametrize("bad, why", [
    ("| a fault | what | `tests/faults/test_disk.py::test_that_does_not_exist` |", "has no test"),
    ("| a fault | what | no test named |", "names no test"),
    ("| a fault | what | `tests/faults/test_signals.py::test_a_signalled_driver_stops_cleanly_and_resumes_exactly` |",
     "is marked slow"),
    ("| a fault | after `placement.call_timeout_s` (default 120 s) | `tests/test_reliability_doc.py::test_the_check_can_fail` |",
     "the config's default is 600"),
    ("| a fault | `run.no_such_key` | `tests/test_reliability_doc.py::test_the_check_can_fail` |", "not a key"),
])
def test_the_check_can_fail(bad, why):
    """Positive control: a page with each kind of error is caught (the real page's rows kept)."""
    text = PAGE.read_text() + "\n" + bad + "\n"
    found = problems(text)
    assert any(why in p for p in found), found
