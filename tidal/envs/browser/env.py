"""browser (computer use): do a task on a web page in headless Chromium through tool calls.

The world is a small site built from the task's seed (tidal.envs.browser.tasks: buttons,
forms, lists, a multi-page site, a date picker, a search box), served from memory on
`https://tidal.task` to a fresh context of the pool's browsers (tidal.envs.browser.pool:
isolated from every network, an unprivileged user, Chromium's sandbox on).

Observations are text: the instruction, then after every action the page's title and path and
its accessibility snapshot (Playwright's `aria_snapshot(mode="ai")`), whose elements carry refs
(`button "Save" [ref=e4]`). Actions are tool calls in the Hermes format,
`<tool_call>{"name": "click", "arguments": {"ref": "e4"}}</tool_call>`:

| tool | does |
| --- | --- |
| `click(ref)` | clicks the element (links navigate, buttons submit, checkboxes toggle) |
| `type(ref, text)` | replaces the text of a text field |
| `select(ref, option)` | picks an option of a drop-down by its text |
| `scroll(direction)` | scrolls the page `up` or `down` |
| `press(key)` | presses a key (Enter, Tab, Escape, arrows, Backspace, Delete, Home, End, PageUp, PageDown, Space) |
| `go_back()` | goes back one page |
| `done(answer)` | ends the episode; `answer` for tasks that ask a question |

Calls of one turn run in order. A malformed or impossible action (an unknown ref, a ref of an
older page, a field that is not a field, a disabled button, a key not in the list) is an error
observation, as for every tool, and the episode goes on; each action has its own timeout
(`action_timeout_s`; loading and reading the page after it has `page_timeout_s`, and past that
the episode is `env_error`: the task's pages load at once, so it is the machine's failure). The
episode ends at `done`, at a turn without a tool call, or after `max_turns` turns; the verifier
then decides from the final state, which only the host sees: the forms the page sent to
`/submit` (recorded by the request interception, not read from the page), the answer, or the
final page. Reward `{"correct": 1 or 0}` on the last turn
(`default_reward` is None).

A crashed renderer or a dead browser ends the episode `env_error` (raised), never 0; the other
episodes go on. Per-turn metrics: `browser/actions`, `browser/action_errors`; at the end
`browser/out_of_turns` and `browser/blocked_requests` (requests the page tried off the origin).

Reproducibility: the pages use no clock and no randomness, the context has a fixed viewport,
locale, timezone and no animations, so a seed gives the same snapshots (and, with
`screenshot()`, the same PNG bytes) across browsers and restarts.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from tidal.envs.base import Action, Message, StepResult
from tidal.envs.browser.pool import ORIGIN, BrowserConfig, BrowserPool, Site, Tab, loop_browser_pool
from tidal.envs.browser.tasks import FAMILIES, check, make_tasks
from tidal.envs.tool_env import ToolEnv
from tidal.envs.tools import Tool

SYSTEM_PROMPT = (
    "You use a web browser. You see the page as an accessibility tree; act on an element by its ref, e.g. "
    '<tool_call>{"name": "click", "arguments": {"ref": "e3"}}</tool_call>. '
    'When the task is done call <tool_call>{"name": "done", "arguments": {}}</tool_call>, with "answer" if it asks '
    "a question."
)
KEYS = ("Enter", "Tab", "Escape", "ArrowUp", "ArrowDown", "ArrowLeft", "ArrowRight", "Backspace", "Delete", "Home",
        "End", "PageUp", "PageDown", "Space")
REF_RE = re.compile(r"^(f\d{1,6})?e\d{1,6}$")  # e5, or f1e5 on a later page
SCROLL_PX = 400


class BrowserActionError(ValueError):
    """An action the page cannot take: the policy sees the message."""


def _validate_row(row: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    where = f"browser: row {row.get('task_id', '?')}"
    try:
        pages = json.loads(row["pages"]) if isinstance(row.get("pages"), str) else row.get("pages")
        verifier = json.loads(row["verifier"]) if isinstance(row.get("verifier"), str) else row.get("verifier")
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: `pages` or `verifier` is not JSON: {e}") from None
    if not isinstance(pages, dict) or not pages or not all(isinstance(k, str) and k.startswith("/") and isinstance(v, str)
                                                           for k, v in pages.items()):
        raise ValueError(f"{where}: `pages` must map paths (\"/...\") to HTML, got {str(pages)[:200]}")
    if not isinstance(verifier, dict) or verifier.get("kind") not in ("submit", "answer", "visit"):
        raise ValueError(f"{where}: `verifier` must be an object of kind submit, answer or visit, got {str(verifier)[:200]}")
    if row.get("start", "/") not in pages:
        raise ValueError(f"{where}: `start` {row.get('start')!r} is not one of the pages ({', '.join(sorted(pages))})")
    return pages, verifier


def _playwright_message(e: Exception) -> str:
    """Playwright's error without its call log (the first line says what failed)."""
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


class BrowserEnv(ToolEnv):
    """`BrowserEnv(row, seed, **env_args)`: one task of tidal.envs.browser.tasks in a fresh context.

    env_args: `max_turns` (after this many turns the env verifies and ends the episode; keep
    rollout.max_turns at least this), `action_timeout_s` (one action), `page_timeout_s` (loading
    and reading the page, the start's and after each action: past it the episode is `env_error`,
    the machine's failure, not the policy's), `max_tool_output_chars`,
    `max_calls_per_turn`, `system_prompt`, `browser` (BrowserConfig fields), `families` (task
    families of `rows`), `actions` (the tools offered, a subset including `done`; default all:
    fewer tools make a shorter system turn for a small model). `pool` (a BrowserPool, not from
    YAML) shares one pool.
    """

    name: ClassVar[str] = "browser"
    default_system_prompt: ClassVar[str] = SYSTEM_PROMPT
    default_reward: ClassVar[str | None] = None  # the verifier's reward is the last step's

    @classmethod
    def rows(cls, split: str, n: int, seed: int, families: list[str] | None = None,
             **env_args: Any) -> list[dict[str, Any]]:
        """`n` distinct generated tasks of `split` ("train" or "test"), families in turn."""
        return make_tasks(split, n, seed, families)

    def __init__(self, row: dict[str, Any], seed: int = 0, *, max_turns: int = 8, action_timeout_s: float = 2.0,
                 page_timeout_s: float = 30.0, max_tool_output_chars: int = 3000, max_calls_per_turn: int = 4,
                 system_prompt: str | None = None,
                 browser: dict[str, Any] | BrowserConfig | None = None, families: list[str] | None = None,
                 actions: list[str] | None = None, pool: BrowserPool | None = None):
        self.pages, self.verifier = _validate_row(row)
        if max_turns < 1 or action_timeout_s <= 0 or page_timeout_s <= 0:
            raise ValueError(f"browser: env_args.max_turns ({max_turns}) must be >= 1, action_timeout_s "
                             f"({action_timeout_s}) and page_timeout_s ({page_timeout_s}) > 0")
        unknown = [f for f in families or [] if f not in FAMILIES]
        if unknown:
            raise ValueError(f"browser: env_args.families has unknown families {unknown} (families: {', '.join(FAMILIES)})")
        try:
            self.browser = browser if isinstance(browser, BrowserConfig) else BrowserConfig.model_validate(browser or {})
        except ValueError as e:
            raise ValueError(f"browser: env_args.browser is not a valid browser config: {e}") from None
        every = {"click": self._click, "type": self._type, "select": self._select, "scroll": self._scroll,
                 "press": self._press, "go_back": self._go_back, "done": self._done}
        chosen = list(every) if actions is None else list(actions)
        if not chosen or set(chosen) - set(every) or "done" not in chosen:
            raise ValueError(f"browser: env_args.actions must be tools among {', '.join(every)} including done, "
                             f"got {actions}")
        tools = [Tool.from_function(every[n], name=n) for n in every if n in chosen]
        super().__init__(row, seed, tools=tools, system_prompt=system_prompt,
                         tool_timeout_s=(action_timeout_s + page_timeout_s) * (max_calls_per_turn + 1) + 5.0,
                         max_tool_output_chars=max_tool_output_chars, max_calls_per_turn=max_calls_per_turn)
        self.max_turns = max_turns
        self.action_timeout_s = action_timeout_s
        self.page_timeout_s = page_timeout_s
        self._pool = pool
        self._tab: Tab | None = None
        self._lock = asyncio.Lock()
        self._finished = False
        self._answer: str | None = None
        self._infra_error = ""
        self._metrics: dict[str, float] = {}

    # -- the page ---------------------------------------------------------------------------
    async def reset(self) -> list[Message]:
        await self._release()
        self._finished, self._answer, self._infra_error = False, None, ""
        pool = self._pool or await loop_browser_pool(self.browser)
        self._tab = await pool.open_tab(Site(self.pages))
        try:
            await self._tab.page.goto(ORIGIN + self.row.get("start", "/"), wait_until="load",
                                      timeout=self.page_timeout_s * 1000)
            observation = await self.observe()
        except Exception as e:  # noqa: BLE001 - Playwright's errors, a closed page: the episode cannot start
            await self._release()
            raise RuntimeError(f"browser: opening task {self.row.get('task_id', '?')} failed: "
                               f"{_playwright_message(e)}") from None
        messages = await super().reset()
        messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}\n\n{observation}"}
        return messages

    async def observe(self) -> str:
        """The page as the policy sees it: title, path, accessibility snapshot with refs."""
        page = self._page()
        snapshot = await page.aria_snapshot(mode="ai", timeout=self.page_timeout_s * 1000)
        snapshot = snapshot.replace(" [cursor=pointer]", "")
        return f"Page: {await page.title()} ({self.path()})\n{snapshot}"

    async def screenshot(self) -> bytes:
        """The viewport as PNG bytes (no caret, animations stopped): the same for the same seed."""
        return await self._page().screenshot(type="png", animations="disabled", caret="hide",
                                             timeout=self.page_timeout_s * 1000)

    def path(self) -> str:
        url = urlsplit(self._page().url)
        return url.path if f"{url.scheme}://{url.netloc}" == ORIGIN else url.geturl()

    def _page(self):
        if self._tab is None:
            raise RuntimeError("browser: the episode has no page (reset it first)")
        return self._tab.page

    async def _act(self, what: str, action) -> str:
        """Run one action on the page, in order with the turn's other calls; the new page."""
        async with self._lock:
            tab = self._tab
            if self._finished or tab is None:
                raise BrowserActionError("the episode is over (done was called)")
            self._metrics["browser/actions"] = self._metrics.get("browser/actions", 0.0) + 1.0
            try:
                await action(tab.page)
            except BrowserActionError:
                self._count_error()
                raise
            except Exception as e:  # noqa: BLE001 - any failed action is an observation, or the browser's failure
                if tab.crashed or tab.page.is_closed():
                    self._infra_error = tab.crashed or "the page was closed"
                    raise RuntimeError("the browser failed (infrastructure); the episode ends") from None
                self._count_error()
                raise BrowserActionError(f"{what} failed: {_playwright_message(e)}") from None
            # The page after the action: our own pages load at once, so a load or a snapshot
            # that takes longer than page_timeout_s is the machine's failure, not the policy's.
            try:
                await tab.page.wait_for_load_state("load", timeout=self.page_timeout_s * 1000)
                return await self.observe()
            except Exception as e:  # noqa: BLE001 - the episode cannot go on without its observation
                self._infra_error = tab.crashed or f"reading the page after {what} failed: {_playwright_message(e)}"
                raise RuntimeError("the browser failed (infrastructure); the episode ends") from None

    def _count_error(self) -> None:
        self._metrics["browser/action_errors"] = self._metrics.get("browser/action_errors", 0.0) + 1.0

    @staticmethod
    async def _locator(page, ref: str):
        """The element of `ref` in the latest snapshot; an error right away when there is none
        (Playwright would wait for it until the action's timeout)."""
        if not isinstance(ref, str) or not REF_RE.match(ref.strip()):
            raise BrowserActionError(f"ref must be an element's ref from the latest snapshot, like e5; got {ref!r:.40}")
        locator = page.locator(f"aria-ref={ref.strip()}")
        if not await locator.count():
            raise BrowserActionError(f"no element has ref {ref.strip()} in the latest snapshot (refs change with the page)")
        return locator

    async def _on(self, page, ref: str, method: str, *args: Any, **kwargs: Any) -> None:
        await getattr(await self._locator(page, ref), method)(*args, **kwargs)

    # -- tools ------------------------------------------------------------------------------
    async def _click(self, ref: str) -> str:
        """Click an element of the page.

        Args:
            ref: the element's ref in the latest snapshot, e.g. e5
        """
        ms = self.action_timeout_s * 1000
        return await self._act(f"click {ref}", lambda page: self._on(page, ref, "click", timeout=ms))

    async def _type(self, ref: str, text: str) -> str:
        """Replace the text of a text field.

        Args:
            ref: the field's ref in the latest snapshot
            text: the text to put in it
        """
        ms = self.action_timeout_s * 1000
        return await self._act(f"type into {ref}", lambda page: self._on(page, ref, "fill", text, timeout=ms))

    async def _select(self, ref: str, option: str) -> str:
        """Pick an option of a drop-down list by its text.

        Args:
            ref: the drop-down's ref in the latest snapshot
            option: the text of the option
        """
        ms = self.action_timeout_s * 1000
        return await self._act(f"select in {ref}",
                               lambda page: self._on(page, ref, "select_option", label=option, timeout=ms))

    async def _scroll(self, direction: Literal["up", "down"]) -> str:
        """Scroll the page.

        Args:
            direction: up or down
        """
        if direction not in ("up", "down"):
            raise BrowserActionError(f"direction must be up or down, got {direction!r:.40}")
        dy = SCROLL_PX if direction == "down" else -SCROLL_PX
        return await self._act("scroll", lambda page: page.mouse.wheel(0, dy))

    async def _press(self, key: str) -> str:
        """Press a key on the focused element.

        Args:
            key: one of Enter, Tab, Escape, ArrowUp, ArrowDown, ArrowLeft, ArrowRight, Backspace, Delete, Home, End, PageUp, PageDown, Space
        """
        if key not in KEYS:
            raise BrowserActionError(f"key must be one of {', '.join(KEYS)}; got {key!r:.40}")
        return await self._act(f"press {key}", lambda page: page.keyboard.press(key))

    async def _go_back(self) -> str:
        """Go back to the previous page."""
        return await self._act("go back", lambda page: page.go_back(timeout=self.action_timeout_s * 1000))

    async def _done(self, answer: str | None = None) -> str:
        """End the episode: the page (or the answer) is checked.

        Args:
            answer: the answer, when the task asks a question
        """
        async with self._lock:
            self._finished = True
            self._answer = answer
        return "ok"

    # -- turns ------------------------------------------------------------------------------
    async def step(self, action: Action | str) -> StepResult:
        turn = self.turn
        self._metrics = {"browser/actions": 0.0, "browser/action_errors": 0.0}
        result = await super().step(action)
        if self._infra_error or (self._tab is not None and self._tab.crashed):
            why = self._infra_error or self._tab.crashed
            raise RuntimeError(f"browser: task {self.row.get('task_id', '?')}: {why}")
        result.metrics = {**result.metrics, **self._metrics}
        if result.done:  # a turn without tool calls: final_turn verified
            return result
        if not (self._finished or turn + 1 >= self.max_turns):
            return result
        final = self._verify()
        final.tool_calls, final.assistant_message = result.tool_calls, result.assistant_message
        final.metrics = {**result.metrics, **final.metrics, "browser/out_of_turns": float(not self._finished)}
        return final

    async def final_turn(self, action: Action) -> StepResult:
        return self._verify()

    def _verify(self) -> StepResult:
        tab = self._tab
        if tab is None:
            raise RuntimeError("browser: the episode has no page to verify")
        correct = float(check(self.verifier, tab.site.submissions, self._answer, self.path()))
        return StepResult(reward=correct, reward_parts={"correct": correct}, done=True,
                          metrics={"browser/out_of_turns": 0.0, "browser/blocked_requests": float(len(tab.site.blocked))})

    async def _release(self) -> None:
        tab, self._tab = self._tab, None
        if tab is not None:
            await tab.close()

    async def close(self) -> None:
        await self._release()
        await super().close()
