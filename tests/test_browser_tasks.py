"""The browser task generator (tidal.envs.browser.tasks): rows, splits, the verifier `check`, and
each family end to end in real Chromium: the pages are served by request interception on the
task origin, the scripted `solution` is replayed by role and name through the accessibility
snapshot's refs and must score 1, the `wrong` sequence 0."""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Any
from urllib.parse import urlsplit

import pytest

from tidal.envs.browser.tasks import FAMILIES, check, make_tasks, parse_form

CHROMIUM = "/usr/lib/chromium/chromium-headless-shell"
ORIGIN = "https://tidal.task"
SUBMITTED = '<!doctype html><html><head><meta charset="utf-8"><title>Sent</title></head><body><p>Sent.</p></body></html>'
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


# -- end to end in Chromium ------------------------------------------------------------------

def ref_of(snapshot: str, role: str, name: str) -> str:
    """The ref of the one element of `role` named exactly `name` in an `aria_snapshot(mode="ai")`
    text, whose lines read `- button "Cancel order" [ref=e5]` (other [attributes] may come first).
    Refs of a later document of the page carry a frame prefix, `f1e5`; a stale one is an error."""
    line = re.compile(rf'^\s*- {re.escape(role)} {re.escape(json.dumps(name))}(?: \[[^\]]*\])*? \[ref=(f?\d*e\d+)\]',
                      re.MULTILINE)
    refs = line.findall(snapshot)
    assert len(refs) == 1, f"{len(refs)} elements are {role} {name!r} in:\n{snapshot}"
    return refs[0]


async def replay(browser: Any, row: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Serve the row's pages, play `steps` by role and name, and score the episode with `check`."""
    pages = json.loads(row["pages"])
    submissions: list[dict[str, str]] = []
    strays: list[str] = []

    async def serve(route: Any) -> None:
        request, url = route.request, urlsplit(route.request.url)
        if f"{url.scheme}://{url.netloc}" != ORIGIN:
            strays.append(request.url)
            await route.abort()
        elif url.path == "/submit":
            submissions.append(parse_form((request.post_data if request.method == "POST" else url.query) or ""))
            await route.fulfill(status=200, content_type="text/html; charset=utf-8", body=SUBMITTED)
        elif url.path in pages:
            await route.fulfill(status=200, content_type="text/html; charset=utf-8", body=pages[url.path])
        else:
            strays.append(request.url)
            await route.fulfill(status=404, content_type="text/plain", body="not found")

    context = await browser.new_context(viewport={"width": 1000, "height": 800})
    await context.route("**/*", serve)
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    await page.goto(ORIGIN + row["start"])
    answer, snapshots = None, []
    for step in steps:
        snapshot = await page.aria_snapshot(mode="ai")
        snapshots.append(snapshot)
        action = step["action"]
        if action == "done":
            answer = step.get("answer")
            break
        if action in ("click", "type", "select"):
            element = page.locator(f"aria-ref={ref_of(snapshot, step['role'], step['name'])}")
            if action == "click":
                await element.click()
            elif action == "type":
                await element.fill(step["text"])
            else:
                await element.select_option(label=step["option"])
        elif action == "press":
            await page.keyboard.press(step["key"])
        elif action == "scroll":
            await page.mouse.wheel(0, 400 if step["direction"] == "down" else -400)
        elif action == "go_back":
            await page.go_back()
        else:
            raise AssertionError(f"unknown step {step}")
        await page.wait_for_load_state()
    path = urlsplit(page.url).path
    await context.close()
    assert not errors and not strays, (row["task_id"], errors, strays)
    return {"reward": check(row["verifier"], submissions, answer, path), "snapshots": snapshots}


def chromium() -> str:
    pytest.importorskip("playwright.async_api", reason="playwright is in the dev extra (scripts/setup.sh)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is not installed: scripts/setup.sh installs chromium-headless-shell")
    return CHROMIUM


class Browser:
    """One Chromium for the module on an event loop of its own (the tests are sync):
    `run(fn)` awaits `fn(browser)` there."""

    def __init__(self, path: str) -> None:
        from playwright.async_api import async_playwright

        self.loop = asyncio.new_event_loop()
        self.playwright = self.loop.run_until_complete(async_playwright().start())
        # as root, Chromium's own sandbox cannot start
        self.chromium = self.loop.run_until_complete(
            self.playwright.chromium.launch(executable_path=path, args=["--no-sandbox"]))

    def run(self, fn: Any) -> Any:
        return self.loop.run_until_complete(fn(self.chromium))

    def close(self) -> None:
        self.loop.run_until_complete(self.chromium.close())
        self.loop.run_until_complete(self.playwright.stop())
        self.loop.close()


@pytest.fixture(scope="module")
def browser():
    b = Browser(chromium())
    yield b
    b.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_solution_scores_one_and_wrong_scores_zero(browser, family):
    rows = make_tasks("train", 2, seed=11, families=[family]) + make_tasks("test", 2, seed=11, families=[family])

    async def run(browser: Any) -> None:
        for row in rows:
            good = await replay(browser, row, json.loads(row["solution"]))
            assert good["reward"] == 1.0, (row["task_id"], row["instruction"], good["snapshots"][-1])
            assert 150 < len(good["snapshots"][0]) < 3000, good["snapshots"][0]
            bad = await replay(browser, row, json.loads(row["wrong"]))
            assert bad["reward"] == 0.0, (row["task_id"], row["instruction"], row["wrong"])

    browser.run(run)


def start_page(doc: str) -> Any:
    async def serve(route: Any) -> None:
        await route.fulfill(content_type="text/html; charset=utf-8", body=doc)
    return serve


def test_same_task_renders_the_same_snapshot_and_screenshot(browser):
    rows = make_tasks("train", len(FAMILIES), seed=5)

    async def run(browser: Any) -> None:
        for row in rows:
            shots = []
            for _ in range(2):
                context = await browser.new_context(viewport={"width": 800, "height": 600})
                await context.route("**/*", start_page(json.loads(row["pages"])[row["start"]]))
                page = await context.new_page()
                await page.goto(ORIGIN + row["start"])
                shots.append((await page.aria_snapshot(mode="ai"), await page.screenshot()))
                await context.close()
            assert shots[0] == shots[1], row["task_id"]

    browser.run(run)
