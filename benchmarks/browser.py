"""Browser environment throughput: episodes/s and CPU per episode of `BrowserEnv`, against the
same episodes driven over the raw Chrome DevTools Protocol (the near-limit reference).

    python benchmarks/browser.py [--episodes 21] [--rounds 3] [--concurrency 1 4 8]
                                 [--seed 0] [--out benchmarks/results/browser.json]

The episodes are `make_tasks("train", episodes, seed)` (the families in turn), each played from
its `solution` steps by a scripted policy that finds elements by role and name in every
observation, one action a turn; every episode must score 1 on both sides, or the run stops.

- tidal: `BrowserEnv(row, 0, pool=pool)` through `tidal.envs.browser.scripted.run_episode`, a
  `BrowserPool` sized to the concurrency (`browsers=min(2, c)`, `contexts_per_browser=ceil(c /
  browsers)`), the default isolated network; everything of an episode counted (a fresh context,
  the page served by request interception, an aria snapshot after every action, the close).
- CDP: the same number of Chromium processes, the same Chromium flags (read from the pool's own
  browser's command line, its pipe swapped for `--remote-debugging-port=0`), the same uid
  (65534 when root) with Chromium's sandbox on, only not in a network namespace of its own (the
  port must be reachable on 127.0.0.1). One `websockets` connection a browser, flat sessions;
  per episode `Target.createBrowserContext` and `createTarget`, `Fetch.enable` serving the
  pages and recording `/submit` as the pool does, `Page.navigate` until `Page.loadEventFired`,
  `Accessibility.getFullAXTree` as the observation after every action (elements resolved by
  role and name from it), actions as JavaScript on the element (`DOM.resolveNode` +
  `Runtime.callFunctionOn`: `click()`; value set + input/change events; option picked by its
  text) and keys as `Input.dispatchKeyEvent`, the same verifier (`tasks.check`), then
  `Target.disposeBrowserContext`.

Each measurement starts its browsers (the launch is timed and reported apart), plays a warm-up
of max(2, c) other episodes, then the measured episodes at concurrency c (`asyncio.Semaphore`),
and closes the browsers. CPU is that of the whole process tree (this Python, Playwright's node
driver, every Chromium process, also those that exit), read from a cgroup v1 cpuacct / v2 group
made for the run (benchmarks/sandbox.py's `CgroupCpu`; root), split into this process
(getrusage), the node driver (/proc/PID/stat) and the browsers (the rest). Rounds alternate
which side goes first; ratios tidal/CDP are taken within a round and their median reported,
because this machine is shared and noisy. Writes the raw figures as JSON and prints a Markdown
table.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import math
import os
import platform
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sandbox import CgroupCpu
from websockets.asyncio.client import connect

from tidal.envs.browser import BrowserConfig, BrowserEnv, BrowserPool
from tidal.envs.browser.pool import ORIGIN, SUBMIT_PATH, SUBMITTED_PAGE, UNPRIVILEGED_UID, Site, find_chromium
from tidal.envs.browser.scripted import ScriptError, run_episode
from tidal.envs.browser.tasks import check, make_tasks, parse_form

CLK_TCK = os.sysconf("SC_CLK_TCK")
HTML_HEADERS = [{"name": "Content-Type", "value": "text/html; charset=utf-8"}]
KEYS = {"Enter": (13, "\r"), "Tab": (9, ""), "Escape": (27, ""), "Backspace": (8, ""), "Space": (32, " ")}
CLICK_JS = "function () { this.click(); }"
TYPE_JS = """function (v) { this.focus(); this.value = v;
  this.dispatchEvent(new Event("input", {bubbles: true})); this.dispatchEvent(new Event("change", {bubbles: true})); }"""
SELECT_JS = """function (t) {
  const o = Array.from(this.options).find((o) => o.label.trim() === t || o.textContent.trim() === t);
  if (!o) throw new Error("no option " + t);
  this.value = o.value;
  this.dispatchEvent(new Event("input", {bubbles: true})); this.dispatchEvent(new Event("change", {bubbles: true})); }"""
SETTLE_JS = "new Promise((r) => setTimeout(r, 0))"  # tasks the action queued (a form's submission) have run


# -- CPU --------------------------------------------------------------------------------------------

def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a live process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _driver_pid() -> int | None:
    """Playwright's node driver: the child of this process that runs node."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and "node" in stat.split(")")[0]:
                    return int(entry)
    return None


class CpuMeter:
    """CPU seconds of the whole tree (the cgroup), of this process and of the node driver."""

    def __init__(self, cgroup: CgroupCpu):
        self.cgroup = cgroup

    def read(self) -> dict[str, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        driver = _driver_pid()
        total = self.cgroup.read()
        if total is None:
            raise RuntimeError("benchmarks/browser.py needs cgroup CPU accounting (root, cgroup v1 cpuacct or v2)")
        return {"total": total, "python": usage.ru_utime + usage.ru_stime,
                "driver": _proc_cpu_s(driver) if driver else 0.0}


def _spent(before: dict[str, float], after: dict[str, float], episodes: int) -> dict[str, float]:
    """CPU ms per episode: the tree, and its parts (browsers = the tree less python and driver)."""
    d = {k: (after[k] - before[k]) * 1000 / episodes for k in before}
    return {"cpu_ms": d["total"], "python_ms": d["python"], "driver_ms": d["driver"],
            "browsers_ms": d["total"] - d["python"] - d["driver"]}


# -- tidal ------------------------------------------------------------------------------------------

def pool_config(concurrency: int) -> BrowserConfig:
    browsers = min(2, concurrency)
    return BrowserConfig(browsers=browsers, contexts_per_browser=math.ceil(concurrency / browsers))


def _check_all(results: list[tuple[float, int]], rows: list[dict[str, Any]], side: str) -> int:
    failed = [(r["task_id"], reward) for r, (reward, _) in zip(rows, results) if reward != 1.0]
    if failed:
        raise RuntimeError(f"{side}: {len(failed)} of {len(rows)} episodes did not score 1: {failed[:5]}")
    return sum(turns for _, turns in results)


async def run_tidal(rows: list[dict[str, Any]], warmup: list[dict[str, Any]], concurrency: int,
                    meter: CpuMeter) -> dict[str, Any]:
    pool = BrowserPool(pool_config(concurrency))
    sem = asyncio.Semaphore(concurrency)

    async def one(row: dict[str, Any]) -> tuple[float, int]:
        async with sem:
            return await run_episode(BrowserEnv(row, 0, pool=pool), row, "solution")

    try:
        t0, c0 = time.perf_counter(), meter.read()
        tab = await pool.open_tab(Site({"/": ""}))  # starts the driver and every browser of the pool
        await tab.close()
        launch_s, c1 = time.perf_counter() - t0, meter.read()
        _check_all(await asyncio.gather(*(one(r) for r in warmup)), warmup, "tidal warm-up")
        t0, before = time.perf_counter(), meter.read()
        results = await asyncio.gather(*(one(r) for r in rows))
        wall, after = time.perf_counter() - t0, meter.read()
    finally:
        await pool.close()
    turns = _check_all(results, rows, "tidal")
    return {"episodes_per_s": len(rows) / wall, "wall_s": wall, "turns": turns, **_spent(before, after, len(rows)),
            "launch_s": launch_s, "launch_cpu_s": c1["total"] - c0["total"]}


async def playwright_chromium_args() -> list[str]:
    """The flags the pool's Playwright starts Chromium with, less its profile and pipe."""
    pool = BrowserPool(BrowserConfig(browsers=1))
    try:
        tab = await pool.open_tab(Site({"/": ""}))
        await tab.close()
        for pid in pool.processes():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "--remote-debugging-pipe" in argv:
                return [a for a in argv[1:] if a and a != "--remote-debugging-pipe"
                        and not a.startswith("--user-data-dir=")]
    finally:
        await pool.close()
    raise RuntimeError("benchmarks/browser.py: found no process of the pool with --remote-debugging-pipe")


# -- raw CDP ----------------------------------------------------------------------------------------

class CdpError(RuntimeError):
    pass


class CdpBrowser:
    """One Chromium over one DevTools WebSocket: commands matched to answers by id, events
    handed to the page of their (flat) session."""

    def __init__(self, proc: asyncio.subprocess.Process, ws: Any, profile: str, drain: asyncio.Task):
        self.proc, self.ws, self.profile, self._drain = proc, ws, profile, drain
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.pages: dict[str, CdpPage] = {}
        self.active = 0
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def launch(cls, chromium: str, args: list[str]) -> CdpBrowser:
        profile = tempfile.mkdtemp(prefix="tidal-cdp-bench-")
        prefix = []
        if os.geteuid() == 0:  # as the pool: an unprivileged uid, Chromium's own sandbox on
            os.chown(profile, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
            prefix = ["/usr/bin/setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
                      "--clear-groups", "--inh-caps=-all", "--"]
        env = {"PATH": "/usr/bin:/bin", "HOME": profile, "LANG": "C.UTF-8", "TZ": "UTC"}
        proc = await asyncio.create_subprocess_exec(
            *prefix, chromium, *args, "--remote-debugging-port=0", f"--user-data-dir={profile}/data",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            env=env)
        seen = []
        while True:
            line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode(errors="replace")
            if not line:
                raise RuntimeError(f"CDP: Chromium exited before listening: {''.join(seen)[-1500:]}")
            seen.append(line)
            if m := re.search(r"DevTools listening on (ws://\S+)", line):
                break

        async def drain() -> None:  # a full stderr pipe would block Chromium
            while await proc.stderr.read(65536):
                pass

        ws = await connect(m.group(1), max_size=None, compression=None, ping_interval=None)
        return cls(proc, ws, profile, asyncio.create_task(drain()))

    async def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict:
        msg_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[msg_id] = future
        message = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        await self.ws.send(json.dumps(message))
        return await future

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                msg = json.loads(raw)
                if "id" in msg:
                    future = self._waiting.pop(msg["id"], None)
                    if future is not None and not future.done():
                        if "error" in msg:
                            future.set_exception(CdpError(msg["error"].get("message", str(msg["error"]))))
                        else:
                            future.set_result(msg.get("result", {}))
                elif (page := self.pages.get(msg.get("sessionId"))) is not None:
                    page.event(msg["method"], msg.get("params", {}))
        finally:
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(CdpError("the DevTools connection closed"))

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.send("Browser.close"), 5)
        with contextlib.suppress(Exception):
            await self.ws.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        self._reader.cancel()
        self._drain.cancel()
        shutil.rmtree(self.profile, ignore_errors=True)


class CdpPage:
    """One episode's browser context and page: the site served by `Fetch`, the main frame's
    loading state and URL followed from `Page` events."""

    def __init__(self, browser: CdpBrowser, site: Site):
        self.browser, self.site = browser, site
        self.session = self.target = self.context = ""
        self.url = "about:blank"
        self.loading = False  # a navigation of the main frame is under way
        self.loaded = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    async def open(self) -> None:
        b = self.browser
        self.context = (await b.send("Target.createBrowserContext", {"disposeOnDetach": True}))["browserContextId"]
        self.target = (await b.send("Target.createTarget", {"url": "about:blank", "browserContextId": self.context,
                                                            "width": 800, "height": 600}))["targetId"]
        self.session = (await b.send("Target.attachToTarget", {"targetId": self.target, "flatten": True}))["sessionId"]
        b.pages[self.session] = self
        await asyncio.gather(self.send("Fetch.enable", {"patterns": [{"urlPattern": "*"}]}), self.send("Page.enable"))

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict:
        return await self.browser.send(method, params, self.session)

    def event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Fetch.requestPaused":
            task = asyncio.create_task(self._serve(params))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif method in ("Page.frameRequestedNavigation", "Page.frameStartedLoading"):
            if params.get("frameId") == self.target:  # a page target's main frame has the target's id
                self.loading = True
                self.loaded.clear()
        elif method in ("Page.loadEventFired", "Page.frameStoppedLoading"):
            if method == "Page.loadEventFired" or params.get("frameId") == self.target:
                self.loading = False
                self.loaded.set()
        elif method == "Page.frameNavigated" and not params["frame"].get("parentId"):
            self.url = params["frame"]["url"]

    async def _serve(self, params: dict[str, Any]) -> None:
        request, request_id = params["request"], params["requestId"]
        url = urlsplit(request["url"])
        with contextlib.suppress(CdpError):  # the context may be closing under us
            if f"{url.scheme}://{url.netloc}" != ORIGIN:
                if len(self.site.blocked) < 100:
                    self.site.blocked.append(request["url"][:300])
                await self.send("Fetch.failRequest", {"requestId": request_id, "errorReason": "BlockedByClient"})
                return
            if url.path == SUBMIT_PATH:
                if request["method"] == "POST":
                    entries = request.get("postDataEntries")
                    body = ("".join(base64.b64decode(e.get("bytes", "")).decode() for e in entries) if entries
                            else request.get("postData", ""))
                else:
                    body = url.query
                self.site.submissions.append(parse_form(body))
                status, html = 200, SUBMITTED_PAGE
            else:
                status, html = self.site.page_for(url.path or "/")
            await self.send("Fetch.fulfillRequest", {"requestId": request_id, "responseCode": status,
                                                     "responseHeaders": HTML_HEADERS,
                                                     "body": base64.b64encode(html.encode()).decode()})

    async def wait_loaded(self) -> None:
        if self.loading:
            await asyncio.wait_for(self.loaded.wait(), 10)

    async def navigate(self, url: str) -> None:
        self.loading = True
        self.loaded.clear()
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise CdpError(f"navigating to {url}: {result['errorText']}")
        await self.wait_loaded()

    async def ax_tree(self) -> list[dict[str, Any]]:
        return (await self.send("Accessibility.getFullAXTree"))["nodes"]

    async def on_element(self, backend_id: int, function: str, *args: Any) -> None:
        obj = (await self.send("DOM.resolveNode", {"backendNodeId": backend_id}))["object"]["objectId"]
        result = await self.send("Runtime.callFunctionOn", {
            "objectId": obj, "functionDeclaration": function, "arguments": [{"value": a} for a in args],
            "returnByValue": True})
        if "exceptionDetails" in result:
            raise CdpError(f"{function[:40]}: {result['exceptionDetails'].get('exception', {}).get('description')}")

    async def press(self, key: str) -> None:
        code, text = KEYS[key]
        down = {"type": "keyDown" if text else "rawKeyDown", "key": key, "code": key, "windowsVirtualKeyCode": code}
        if text:
            down |= {"text": text, "unmodifiedText": text}
        await self.send("Input.dispatchKeyEvent", down)
        await self.send("Input.dispatchKeyEvent", {"type": "keyUp", "key": key, "code": key,
                                                   "windowsVirtualKeyCode": code})

    async def settle(self) -> None:
        """Wait for what the action started: a navigation it requested, until its load event."""
        with contextlib.suppress(CdpError):  # a navigation can destroy the context mid-call
            await self.send("Runtime.evaluate", {"expression": SETTLE_JS, "awaitPromise": True})
        await self.wait_loaded()

    async def close(self) -> None:
        with contextlib.suppress(CdpError):
            await self.browser.send("Target.disposeBrowserContext", {"browserContextId": self.context})
        self.browser.pages.pop(self.session, None)
        for task in list(self._tasks):
            task.cancel()


def ax_resolve(nodes: list[dict[str, Any]], role: str, name: str) -> int:
    """The backend DOM node of the one unignored AX node of `role` named `name`."""
    want = " ".join(name.split())
    hits = [n["backendDOMNodeId"] for n in nodes if not n.get("ignored") and n.get("role", {}).get("value") == role
            and " ".join(str(n.get("name", {}).get("value", "")).split()) == want and "backendDOMNodeId" in n]
    if len(hits) != 1:
        raise ScriptError(f'CDP: {len(hits)} elements are {role} "{name}" in the accessibility tree')
    return hits[0]


async def cdp_episode(browser: CdpBrowser, row: dict[str, Any]) -> tuple[float, int]:
    """The row's solution over raw CDP: an AX tree after the load and after every action, as
    the env takes a snapshot; the verdict of tasks.check. (reward, turns)."""
    page = CdpPage(browser, Site(json.loads(row["pages"])))
    answer, turns = None, 0
    browser.active += 1
    try:
        await page.open()
        await page.navigate(ORIGIN + row.get("start", "/"))
        nodes = await page.ax_tree()
        for step in json.loads(row["solution"]):
            turns += 1
            action = step["action"]
            if action == "done":
                answer = step.get("answer")
                break
            if action == "press":
                await page.press(step["key"])
            else:
                node = ax_resolve(nodes, step["role"], step["name"])
                if action == "click":
                    await page.on_element(node, CLICK_JS)
                elif action == "type":
                    await page.on_element(node, TYPE_JS, step["text"])
                elif action == "select":
                    await page.on_element(node, SELECT_JS, step["option"])
                else:
                    raise ScriptError(f"CDP: the reference plays click, type, select, press and done, not {action}")
            await page.settle()
            nodes = await page.ax_tree()
        else:
            turns += 1  # the env's closing turn without a tool call
        url = urlsplit(page.url)
        path = url.path if f"{url.scheme}://{url.netloc}" == ORIGIN else page.url
        return check(row["verifier"], page.site.submissions, answer, path), turns
    finally:
        await page.close()
        browser.active -= 1


async def run_cdp(rows: list[dict[str, Any]], warmup: list[dict[str, Any]], concurrency: int, meter: CpuMeter,
                  chromium: str, args: list[str]) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    browsers: list[CdpBrowser] = []

    async def one(row: dict[str, Any]) -> tuple[float, int]:
        async with sem:
            return await cdp_episode(min(browsers, key=lambda b: b.active), row)

    try:
        t0, c0 = time.perf_counter(), meter.read()
        for _ in range(pool_config(concurrency).browsers):
            browsers.append(await CdpBrowser.launch(chromium, args))
        launch_s, c1 = time.perf_counter() - t0, meter.read()
        _check_all(await asyncio.gather(*(one(r) for r in warmup)), warmup, "CDP warm-up")
        t0, before = time.perf_counter(), meter.read()
        results = await asyncio.gather(*(one(r) for r in rows))
        wall, after = time.perf_counter() - t0, meter.read()
    finally:
        for b in browsers:
            await b.close()
    turns = _check_all(results, rows, "CDP")
    return {"episodes_per_s": len(rows) / wall, "wall_s": wall, "turns": turns, **_spent(before, after, len(rows)),
            "launch_s": launch_s, "launch_cpu_s": c1["total"] - c0["total"]}


# -- the run ----------------------------------------------------------------------------------------

SIDES = ("tidal", "cdp")
FIGURES = ("episodes_per_s", "cpu_ms", "python_ms", "driver_ms", "browsers_ms", "launch_s", "launch_cpu_s")


async def measure(episodes: int, rounds: int, concurrency: list[int], seed: int) -> dict[str, Any]:
    rows = make_tasks("train", episodes, seed)
    spare = make_tasks("train", 2 * max(2, *concurrency), seed + 1)
    chromium = find_chromium()
    cpu = CgroupCpu()
    meter = CpuMeter(cpu)
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {s: {str(c): [] for c in concurrency} for s in SIDES}
    loads = []
    try:
        args = await playwright_chromium_args()
        for r in range(rounds):
            loads.append(os.getloadavg())
            for c in concurrency:
                warmup = spare[:max(2, c)]
                for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                    if side == "tidal":
                        m = await run_tidal(rows, warmup, c, meter)
                    else:
                        m = await run_cdp(rows, warmup, c, meter, chromium, args)
                    raw[side][str(c)].append(m)
            print(f"round {r + 1}/{rounds} (load {loads[-1][0]:.1f}): " + ", ".join(
                f"{s}@{c}={raw[s][str(c)][-1]['episodes_per_s']:.1f}/s {raw[s][str(c)][-1]['cpu_ms']:.0f}ms"
                for c in concurrency for s in SIDES), flush=True)
    finally:
        cpu.remove()
    summary = {}
    for c in map(str, concurrency):
        med = {s: {f: statistics.median(m[f] for m in raw[s][c]) for f in FIGURES} for s in SIDES}
        pairs = list(zip(raw["tidal"][c], raw["cdp"][c]))
        summary[c] = {**med, "ratio_episodes_per_s": statistics.median(t["episodes_per_s"] / d["episodes_per_s"]
                                                                       for t, d in pairs),
                      "ratio_cpu_per_episode": statistics.median(t["cpu_ms"] / d["cpu_ms"] for t, d in pairs)}
    families: dict[str, int] = {}
    for row in rows:
        families[row["family"]] = families.get(row["family"], 0) + 1
    return {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "load_average_at_round_start": loads, "chromium": chromium, "cdp_chromium_args": args,
            "cdp_runs_as": f"uid {UNPRIVILEGED_UID}, Chromium's sandbox on" if os.geteuid() == 0 else "this user",
            "episodes": episodes, "families": families, "seed": seed, "rounds": rounds, "concurrency": concurrency,
            "cpu_accounting": f"cgroup {cpu.mount}/{cpu.usage_file} of the whole tree; python: getrusage(SELF); "
                              "driver: /proc/PID/stat; browsers: the rest",
            "raw": raw, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=21, help="measured episodes per measurement (3 per family)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/browser.json")
    ns = p.parse_args()
    t0, load = time.perf_counter(), os.getloadavg()
    result = asyncio.run(measure(ns.episodes, ns.rounds, ns.concurrency, ns.seed))
    result |= {"command": " ".join(["python benchmarks/browser.py", *sys.argv[1:]]),
               "load_average_at_start": load, "wall_s": time.perf_counter() - t0}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1) + "\n")
    print("\n| concurrency | tidal episodes/s | CDP episodes/s | tidal/CDP | tidal CPU ms/episode | "
          "CDP CPU ms/episode | tidal/CDP |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c, s in result["summary"].items():
        t, d = s["tidal"], s["cdp"]
        print(f"| {c} | {t['episodes_per_s']:.2f} | {d['episodes_per_s']:.2f} | {s['ratio_episodes_per_s']:.2f}× "
              f"| {t['cpu_ms']:.0f} | {d['cpu_ms']:.0f} | {s['ratio_cpu_per_episode']:.2f}× |")
    print("\nCPU ms per episode by process (median): python / node driver / Chromium")
    for c, s in result["summary"].items():
        print(f"  concurrency {c}: " + "; ".join(
            f"{side} {s[side]['python_ms']:.0f} / {s[side]['driver_ms']:.0f} / {s[side]['browsers_ms']:.0f}"
            for side in SIDES))
    print("\nlaunch (median, excluded above): " + "; ".join(
        f"{c} concurrent: tidal {s['tidal']['launch_s']:.2f} s ({s['tidal']['launch_cpu_s']:.2f} CPU s), "
        f"CDP {s['cdp']['launch_s']:.2f} s ({s['cdp']['launch_cpu_s']:.2f} CPU s)" for c, s in result["summary"].items()))
    print(f"\n{result['episodes']} episodes x {result['rounds']} rounds, {result['wall_s']:.0f} s, "
          f"load at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
