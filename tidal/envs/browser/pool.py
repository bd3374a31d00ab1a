"""A pool of headless Chromium browsers, each with several fresh contexts (one per episode).

Pages are untrusted once the policy types into them, so a browser of this pool, by default:

- runs in a **network namespace of its own** with no interface but a loopback that is down
  (`unshare --net`): no packet leaves it, whatever the page does (fetch, WebSocket, WebRTC's
  UDP, DNS, a service worker's fetch);
- sends every HTTP(S) request of a context to **request interception**: the task's pages are
  served from memory on the task origin, `/submit` is recorded for the verifier, and every
  other request is aborted; a proxy that does not exist (`--proxy-server=127.0.0.1:9`, with
  a bypass for the task origin only, loopback included in what is proxied), WebRTC limited
  to proxied UDP, and service workers blocked are the layers behind it. Interception does not
  see everything: a shared worker's requests and WebTransport pass it by (measured, Chromium
  150), and so the namespace is the layer that holds for them;
- runs as an **unprivileged user** (uid 65534 when tidal is root; otherwise the user itself in
  a user namespace) with **Chromium's own sandbox on** (renderers in their namespaces, under
  Chromium's seccomp filter).

`network="host"` turns the first two layers off (Chromium in the host's network, requests to
other origins continued): for trusted pages, and for the tests that show each blocked path is
reachable without the blocking. `netns` runs the browsers in a given network namespace (a path
like `/proc/PID/ns/net`); the isolated mode still makes a fresh one inside it.

Lifetimes: a browser is recycled (closed once its open contexts end, a fresh one started)
after `recycle_after` contexts or when its process tree's resident memory passes
`max_browser_rss_mb`. A renderer crash ends only that context's episode (`Tab.crashed`); a
browser that dies ends the episodes of its contexts and is replaced. `close()` closes every
browser and the Playwright driver and returns when no process of any of them is left
(stragglers are killed and waited for). If the tidal process itself is killed, the driver sees
its pipe close and exits, and Chromium exits when its DevTools pipe closes.

The pool belongs to the event loop that starts it (Playwright's async API): `loop_browser_pool`
gives each loop its own, closed when the loop shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from tidal.envs.browser.tasks import parse_form
from tidal.envs.loop_scoped import loop_scoped

ORIGIN = "https://tidal.task"
SUBMIT_PATH = "/submit"
CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium-headless-shell", "chromium-headless-shell")
SUBMITTED_PAGE = ("<!doctype html><html><head><meta charset=\"utf-8\"><title>Submitted</title></head>"
                  "<body><h1>Submitted</h1><p>Your submission was received.</p></body></html>")
NOT_FOUND_PAGE = ("<!doctype html><html><head><meta charset=\"utf-8\"><title>Not found</title></head>"
                  "<body><h1>Not found</h1></body></html>")
UNPRIVILEGED_UID = 65534


class BrowserConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    executable: str | None = Field(None, description="Chromium to run (a path or a name on PATH). None: Debian's `chromium-headless-shell` (`scripts/setup.sh` installs it).")
    browsers: int = Field(2, ge=1, description="Browser processes of the pool.")
    contexts_per_browser: int = Field(4, ge=1, description="Episodes (fresh contexts) open at once in one browser; more wait for a free one.")
    recycle_after: int = Field(500, ge=1, description="A browser that has opened this many contexts is closed once they end and a fresh one replaces it.")
    max_browser_rss_mb: int = Field(1500, ge=64, description="A browser whose process tree holds more resident memory than this is recycled the same way (checked when a context opens).")
    network: Literal["isolated", "host"] = Field("isolated", description="`isolated`: Chromium in a network namespace of its own with only loopback (down), every request but the task origin's aborted, no proxy reachable, WebRTC UDP and service workers blocked. `host`: none of that (trusted pages only).")
    netns: str | None = Field(None, description="A network namespace to run the browsers in (e.g. `/proc/PID/ns/net`); `isolated` still makes a fresh one inside it. None: this process's.")
    run_as_uid: int = Field(UNPRIVILEGED_UID, ge=1, description="When tidal runs as root: the unprivileged uid (and gid) Chromium runs as, with its own sandbox on.")
    viewport_width: int = Field(800, ge=100)
    viewport_height: int = Field(600, ge=100)
    launch_timeout_s: float = Field(30.0, gt=0, description="Starting one browser.")
    acquire_timeout_s: float = Field(120.0, gt=0, description="Waiting for a free context slot; past it the episode fails with an error naming the pool's size.")


def find_chromium(executable: str | None = None) -> str:
    """The Chromium executable to run; a clear error naming the install command when none is found."""
    for candidate in ([executable] if executable else CHROMIUM_CANDIDATES):
        path = candidate if os.path.isabs(candidate) else shutil.which(candidate)
        if path and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        f"browser: no Chromium at {executable or ' or '.join(CHROMIUM_CANDIDATES)}; install Debian's headless shell "
        "(`scripts/setup.sh` does, as root: `apt-get install -y chromium-headless-shell fonts-liberation`) or set "
        "env_args.browser.executable")


def _launcher_script(chromium: str, cfg: BrowserConfig, pidfile: Path) -> str:
    """A shell script Playwright starts as "the browser": it records its pid, chowns the
    profile Playwright made to the unprivileged user, and execs Chromium into the namespaces
    (exec keeps the pid, so the recorded pid is the browser's)."""
    prefix: list[str] = []
    if cfg.netns:
        prefix += ["/usr/bin/nsenter", f"--net={cfg.netns}", "--"]
    root = os.geteuid() == 0
    if cfg.network == "isolated":
        prefix += ["/usr/bin/unshare", "--net", "--"] if root else \
                  ["/usr/bin/unshare", "--user", "--map-current-user", "--net", "--"]
    if root:
        uid = cfg.run_as_uid
        prefix += ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--"]
    chown = (f'for a in "$@"; do case "$a" in --user-data-dir=*) chown -R {cfg.run_as_uid}:{cfg.run_as_uid} '
             '"${a#--user-data-dir=}";; esac; done\n') if root else ""
    quoted = " ".join(_sh_quote(p) for p in [*prefix, chromium])
    return f"#!/bin/sh\n{chown}echo $$ > {_sh_quote(str(pidfile))}\nexec {quoted} \"$@\"\n"


def _sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _descendants(pid: int) -> set[int]:
    """`pid` and every live process below it (by parent pid, from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in out or not Path(f"/proc/{p}").exists():
            continue
        out.add(p)
        todo += children.get(p, [])
    return out


def _rss_mb(pids: set[int]) -> float:
    total = 0
    for p in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Site:
    """The pages of one episode, served from memory on the task origin; requests to
    `/submit` are recorded (form fields, in order) and answered with a confirmation page."""

    pages: dict[str, str]
    submissions: list[dict[str, str]] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)  # URLs aborted (the first 100)

    def page_for(self, path: str) -> tuple[int, str]:
        if path in self.pages:
            return 200, self.pages[path]
        return 404, NOT_FOUND_PAGE


@dataclass
class _Browser:
    index: int
    browser: Any
    pid: int
    opened: int = 0
    active: int = 0
    draining: bool = False
    dead: bool = False
    tabs: set = field(default_factory=set)


class Tab:
    """One episode's fresh context and page. `crashed` says why it can no longer be used
    (its renderer crashed, or its browser died), or is empty."""

    def __init__(self, pool: BrowserPool, slot: _Browser, context: Any, page: Any, site: Site):
        self.pool, self.slot, self.context, self.page, self.site = pool, slot, context, page, site
        self.crashed = ""
        page.on("crash", lambda _page: self._crash("the page's renderer crashed"))

    def _crash(self, why: str) -> None:
        self.crashed = self.crashed or why

    async def close(self) -> None:
        await self.pool._release(self)


class BrowserPool:
    """`BrowserPool(config)`; `await pool.open_tab(site)` gives a `Tab` in a fresh context,
    `await tab.close()` releases it; `await pool.close()`. Started on first use."""

    def __init__(self, config: BrowserConfig | None = None):
        self.config = config or BrowserConfig()
        self._pw = None
        self._dir: Path | None = None
        self._slots: list[_Browser] = []
        self._cond: asyncio.Condition | None = None
        self._start_lock: asyncio.Lock | None = None
        self._launches = 0
        self._closed = False
        self._pids: set[int] = set()  # every browser pid ever started (close() verifies them gone)
        self._driver_pid: int | None = None
        self.stats = {"launched": 0, "recycled": 0, "died": 0, "contexts": 0}

    async def _start(self) -> None:
        if self._pw is not None:
            return
        try:
            from playwright.async_api import async_playwright
        except ImportError:
            raise ImportError("the browser environment needs Playwright: pip install 'tidal[browser]'") from None
        self._chromium = find_chromium(self.config.executable)
        self._dir = Path(tempfile.mkdtemp(prefix="tidal-browser-"))
        self._cond = asyncio.Condition()
        manager = async_playwright()
        self._pw = await manager.start()
        # The driver's pid (Playwright keeps it private): close() makes sure it ended too.
        proc = getattr(getattr(getattr(manager, "_client", None), "_transport", None), "_proc", None)
        self._driver_pid = getattr(proc, "pid", None)
        self._slots = [await self._launch(i) for i in range(self.config.browsers)]

    async def _launch(self, index: int) -> _Browser:
        cfg = self.config
        self._launches += 1
        pidfile = self._dir / f"browser-{self._launches}.pid"
        script = self._dir / f"launch-{self._launches}.sh"
        script.write_text(_launcher_script(self._chromium, cfg, pidfile))
        script.chmod(0o700)
        args = ["--disable-gpu", "--font-render-hinting=none", "--disable-background-networking",
                "--disable-component-update", "--disable-domain-reliability", "--no-first-run", "--mute-audio",
                "--hide-scrollbars"]
        if cfg.network == "isolated":
            host = urlsplit(ORIGIN).hostname
            args += ["--proxy-server=http://127.0.0.1:9", f"--proxy-bypass-list={host};<-loopback>",
                     "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
                     "--webrtc-ip-handling-policy=disable_non_proxied_udp"]
        home = self._dir / f"home-{self._launches}"
        home.mkdir()
        if os.geteuid() == 0:
            os.chown(home, cfg.run_as_uid, cfg.run_as_uid)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "TZ": "UTC"}
        try:
            browser = await asyncio.wait_for(
                self._pw.chromium.launch(executable_path=str(script), chromium_sandbox=True, args=args, env=env,
                                         handle_sigint=False, handle_sigterm=False, handle_sighup=False,
                                         timeout=cfg.launch_timeout_s * 1000),
                cfg.launch_timeout_s + 5)
        except Exception as e:  # noqa: BLE001 - whatever stopped Chromium, the message says it
            raise RuntimeError(f"browser: Chromium ({self._chromium}) did not start: {str(e).strip()[:1500]}") from None
        pid = int(pidfile.read_text())
        self._pids.add(pid)
        slot = _Browser(index, browser, pid)
        browser.on("disconnected", lambda _b: self._died(slot))
        self.stats["launched"] += 1
        return slot

    def _died(self, slot: _Browser) -> None:
        if slot.dead:
            return
        slot.dead = True
        if not slot.draining and not self._closed:
            self.stats["died"] += 1
        for tab in list(slot.tabs):
            tab._crash("the browser process died")

    async def open_tab(self, site: Site) -> Tab:
        """A fresh context and page serving `site`, on the browser with the fewest open
        contexts (waiting for a slot up to `acquire_timeout_s`)."""
        if self._closed:
            raise RuntimeError("browser: the pool is closed")
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            await self._start()
        cfg = self.config
        deadline = time.monotonic() + cfg.acquire_timeout_s
        async with self._cond:
            while True:
                await self._replace_finished()
                free = [s for s in self._slots if not s.dead and not s.draining and s.active < cfg.contexts_per_browser]
                if free:
                    slot = min(free, key=lambda s: (s.active, s.index))
                    slot.active += 1
                    slot.opened += 1
                    if slot.opened >= cfg.recycle_after:  # decided here, so no other open slips in meanwhile
                        slot.draining = True  # no new contexts; closed and replaced when its last one ends
                        self.stats["recycled"] += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"browser: no free context within {cfg.acquire_timeout_s:g} s (pool of "
                                       f"{cfg.browsers} browsers x {cfg.contexts_per_browser} contexts)")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._cond.wait(), left)
        try:
            context = await slot.browser.new_context(
                viewport={"width": cfg.viewport_width, "height": cfg.viewport_height}, device_scale_factor=1,
                service_workers="block" if cfg.network == "isolated" else "allow", accept_downloads=False,
                java_script_enabled=True, locale="en-US", timezone_id="UTC", reduced_motion="reduce",
                color_scheme="light")
            await context.route("**/*", lambda route: self._serve(route, site))
            if cfg.network == "isolated":
                await context.route_web_socket("**/*", lambda ws: self._block_socket(ws, site))
            page = await context.new_page()
        except Exception as e:  # noqa: BLE001 - the slot is given back whatever failed
            await self._settle(slot)
            why = "its browser died" if slot.dead else str(e).strip()[:500]
            raise RuntimeError(f"browser: could not open a context: {why}") from None
        tab = Tab(self, slot, context, page, site)
        slot.tabs.add(tab)
        if slot.dead:
            tab._crash("the browser process died")
        self.stats["contexts"] += 1
        if not slot.draining and _rss_mb(_descendants(slot.pid)) > cfg.max_browser_rss_mb:
            slot.draining = True
            self.stats["recycled"] += 1
        return tab

    async def _serve(self, route: Any, site: Site) -> None:
        request = route.request
        url = urlsplit(request.url)
        with contextlib.suppress(Exception):  # the context may be closing under us
            if f"{url.scheme}://{url.netloc}" == ORIGIN:
                if url.path == SUBMIT_PATH:
                    body = request.post_data if request.method == "POST" else url.query
                    site.submissions.append(parse_form(body or ""))
                    await route.fulfill(status=200, content_type="text/html; charset=utf-8", body=SUBMITTED_PAGE)
                    return
                status, body = site.page_for(url.path or "/")
                await route.fulfill(status=status, content_type="text/html; charset=utf-8", body=body)
                return
            if self.config.network == "host":
                await route.continue_()
                return
            if len(site.blocked) < 100:
                site.blocked.append(request.url[:300])
            await route.abort("blockedbyclient")

    @staticmethod
    def _block_socket(ws: Any, site: Site) -> None:
        if len(site.blocked) < 100:
            site.blocked.append(ws.url[:300])
        asyncio.ensure_future(ws.close(code=1008, reason="blocked"))

    async def _release(self, tab: Tab) -> None:
        slot = tab.slot
        if tab not in slot.tabs:
            return
        slot.tabs.discard(tab)
        with contextlib.suppress(Exception):  # a dead browser's context is already gone
            await asyncio.wait_for(tab.context.close(), 10)
        await self._settle(slot)

    async def _settle(self, slot: _Browser) -> None:
        async with self._cond:
            slot.active -= 1
            await self._replace_finished()
            self._cond.notify_all()

    async def _replace_finished(self) -> None:
        """Close recycled browsers whose contexts have ended and dead ones; start their
        replacements (under the condition's lock)."""
        if self._closed:
            return
        for i, slot in enumerate(self._slots):
            if slot.dead or (slot.draining and slot.active == 0):
                if slot.active:
                    continue  # a dead browser's episodes are still closing
                await self._close_browser(slot)
                self._slots[i] = await self._launch(slot.index)

    async def _close_browser(self, slot: _Browser) -> None:
        tree = _descendants(slot.pid) if _alive(slot.pid) else set()
        slot.draining = True
        try:
            await asyncio.wait_for(slot.browser.close(), 10)
            grace = 1.0  # a closed browser exits in milliseconds; one whose driver's pipe task was cancelled (a loop
            # shutting down) does not, and is killed
        except Exception:  # noqa: BLE001 - the driver is gone or stuck: nothing will end the browser but us
            grace = 0.2
        await _reap(tree, grace)

    async def close(self) -> None:
        """Close every context and browser and the driver; returns when no process of any
        browser is left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            await self._close_browser(slot)
        stopped = False
        if self._pw is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._pw.stop(), 2)  # ms when its connection lives
                stopped = True
            self._pw = None
        leftover = set().union(*(_descendants(p) for p in self._pids)) if self._pids else set()
        if self._driver_pid is not None and _alive(self._driver_pid):
            leftover |= _descendants(self._driver_pid)  # the driver and what it started
        await _reap(leftover, 1.0 if stopped else 0.2)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def processes(self) -> set[int]:
        """Every live process of the pool's browsers (for tests and leak checks)."""
        return set().union(*(_descendants(p) for p in self._pids)) if self._pids else set()


async def _reap(pids: set[int], grace_s: float = 3.0) -> None:
    """Wait for `pids` to end; SIGKILL what is left after `grace_s`, and wait for that."""
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    for p in pids:
        if _alive(p):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    left = [p for p in pids if _alive(p)]
    if left:
        raise RuntimeError(f"browser: processes {left} did not end after SIGKILL")


async def loop_browser_pool(config: BrowserConfig) -> BrowserPool:
    """The browser pool of the running event loop for `config` (made on first use, closed
    with the loop: tidal.envs.loop_scoped; Playwright's objects belong to the loop that made them)."""
    return await loop_scoped("browser:" + config.model_dump_json(), lambda: BrowserPool(config))
