"""The project documents itself: every relative link in README.md, BENCHMARKS.md and docs/
names a file of this repository (and an anchor that exists), and every test a page names as
evidence (`tests/test_x.py::test_name`) exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_files_of_the_repository(page):
    prose, fenced = [], False
    for line in page.read_text().splitlines():  # code blocks are not prose: no links there
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            prose.append(line)
    text = re.sub(r"`+[^`\n]*`+", "", "\n".join(prose))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists() and (ROOT in file.parents or file == ROOT), \
            f"{page.name}: the link to {target} names no file of this repository"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.name}: {target}: no heading with that anchor"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tests_named_as_evidence_exist(page):
    for file, name in re.findall(r"`?(tests/test_\w+\.py)(?:::(\w+))?", page.read_text()):
        path = ROOT / file
        assert path.is_file(), f"{page.name} names {file}, which does not exist"
        if name:
            assert f"def {name}(" in path.read_text(), f"{page.name} names {file}::{name}, which does not exist"
