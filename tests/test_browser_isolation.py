"""Every path out of the pool's browsers, tried against a listener this test provides.

The module's fixture makes a network namespace of its own (`unshare --net`, as root) and runs a
listener in it: TCP on HTTP_PORT (HTTP, WebSocket, EventSource, beacons; every connection is
recorded with its request line) and TLS_PORT (a TLS handshake, recorded by its first bytes), UDP
on HTTP_PORT (WebRTC's STUN) and QUIC_PORT (WebTransport's QUIC), and DNS on port 53 of the
host's nameserver addresses (resolv.conf is the host's). The pool's browsers start in that
namespace (`BrowserConfig.netns`) and open ATTACK_PAGE, which tries each path, tagged by its URL
path; clicking its link then navigates to the listener, whose page registers a service worker
that fetches the listener too.

With `network="host"` every path reaches the listener (the control: the test can fail); with
`network="isolated"` the listener sees nothing at all, and the per-layer test shows the
browser's own namespace cannot reach it either, whatever the page does.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from browser_support import require_chromium

from tidal.envs.browser.pool import ORIGIN, BrowserConfig, BrowserPool, Site

HTTP_PORT, TLS_PORT, QUIC_PORT = 18765, 18766, 18767  # the namespace is the test's own: no clash
IP = "/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else (shutil.which("ip") or "/usr/sbin/ip")
DNS_NAME = "exfil.tidal-test"

# Runs as `unshare --net python -c LISTENER PORTS HITS NAMESERVERS`. It brings loopback up, adds
# a veth pair (WebRTC gathers candidates only on a running non-loopback interface; without one
# no STUN packet is sent at all) and the nameservers' addresses, then writes one JSON line per
# connection or datagram to HITS (one write and flush per line, under a lock: a reader that
# keeps only complete lines never sees half a hit), and prints "ready". It exits when its stdin
# closes, so it cannot outlive the test process.
LISTENER = r'''
import base64, hashlib, json, socket, subprocess, sys, threading
(http, tls, quic), hits, dns = map(int, sys.argv[1].split(",")), sys.argv[2], sys.argv[3].split(",")
def ip(*a):
    subprocess.run([sys.argv[4], *a], check=True, capture_output=True)
ip("link", "set", "lo", "up")
ip("link", "add", "tidal0", "type", "veth", "peer", "name", "tidal1")
ip("addr", "add", "198.51.100.1/24", "dev", "tidal0")
ip("link", "set", "tidal0", "up")
ip("link", "set", "tidal1", "up")
ip("route", "add", "default", "dev", "tidal0")
for a in filter(None, dns):
    ip("addr", "add", a + ("/128" if ":" in a else "/32"), "dev", "lo")
lock, out = threading.Lock(), open(hits, "a")
def hit(**h):
    with lock:
        out.write(json.dumps(h) + "\n")
        out.flush()
SW = b"self.addEventListener('install', e => e.waitUntil(fetch('/sw-fetch')));"
NAV = (b"<!doctype html><title>nav</title><script>navigator.serviceWorker.register('/sw.js')"
       b".then(() => document.title = 'sw registered', e => document.title = 'sw failed: ' + e)</script>")
def answer(conn):
    conn.settimeout(3)
    try:
        data = conn.recv(65536)
    except OSError:
        data = b""
    head = data.decode("latin-1").split("\r\n")
    parts = head[0].split(" ")
    method, path = (parts[0], parts[1]) if len(parts) == 3 and parts[2].startswith("HTTP/") else ("", "")
    hit(kind="tcp", port=conn.getsockname()[1], method=method, path=path, first=data[:2].hex())
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
    try:
        if "sec-websocket-key" in headers:
            key = headers["sec-websocket-key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
            accept = base64.b64encode(hashlib.sha1(key.encode()).digest())
            conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
            conn.recv(1024)
            return
        ctype, body = b"text/plain", b"/* ok */"  # also a script that runs
        if path.startswith("/sse"):
            ctype, body = b"text/event-stream", b"data: hi\n\n"
        elif path.startswith("/sw.js"):
            ctype, body = b"text/javascript", SW
        elif path.startswith("/nav"):
            ctype, body = b"text/html", NAV
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nAccess-Control-Allow-Origin: *\r\n"
                     b"Access-Control-Allow-Private-Network: true\r\n"  # else the iframe never loads (Local Network Access)
                     b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    except OSError:
        pass
    finally:
        conn.close()
def serve_tcp(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    def loop():
        while True:
            threading.Thread(target=answer, args=(s.accept()[0],), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()
def serve_udp(family, port):
    s = socket.socket(family, socket.SOCK_DGRAM)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    def loop():
        while True:
            data, peer = s.recvfrom(65536)
            if port == 53:
                i, labels = 12, []
                while i < len(data) and data[i]:
                    labels.append(data[i + 1:i + 1 + data[i]].decode("latin-1"))
                    i += 1 + data[i]
                hit(kind="dns", name=".".join(labels))
                s.sendto(data[:2] + b"\x81\x83" + data[4:], peer)  # NXDOMAIN: the resolver need not retry
            else:
                hit(kind="udp", port=port, stun=data[:2] == b"\x00\x01")
    threading.Thread(target=loop, daemon=True).start()
serve_tcp(http)
serve_tcp(tls)
serve_udp(socket.AF_INET, http)
serve_udp(socket.AF_INET, quic)
serve_udp(socket.AF_INET, 53)
serve_udp(socket.AF_INET6, 53)
print("ready", flush=True)
sys.stdin.read()
'''

# Each path, fired at load; `attempts[tag]` is set before each one starts and then to its
# outcome, so the test can tell that every attempt was made, blocked or not. 127.0.0.1 is a
# potentially trustworthy origin, so plain http/ws to it is not mixed content from an https page.
ATTACK_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>attack</title>
<script>
window.attempts = {}; window.candidates = [];
function note(tag, what) { window.attempts[tag] = String(what); }
["css", "script", "img", "iframe"].forEach(t => note(t, "started"));
</script>
<link rel="stylesheet" href="http://127.0.0.1:@HTTP@/css" onload="note('css', 'load')" onerror="note('css', 'error')">
<script src="http://127.0.0.1:@HTTP@/script" onload="note('script', 'load')" onerror="note('script', 'error')">
</script></head><body>
<img src="http://127.0.0.1:@HTTP@/img" onload="note('img', 'load')" onerror="note('img', 'error')">
<iframe src="http://127.0.0.1:@HTTP@/iframe" onload="note('iframe', 'load')"></iframe>
<a id="nav" href="http://127.0.0.1:@HTTP@/nav">next</a>
<script>
const L = "http://127.0.0.1:@HTTP@";
function attempt(tag, start) {
  note(tag, "started");
  try { Promise.resolve(start()).then(r => note(tag, r), e => note(tag, e)); } catch (e) { note(tag, e); }
}
attempt("fetch", () => fetch(L + "/fetch").then(r => r.status));
attempt("tls", () => fetch("https://127.0.0.1:@TLS@/tls").then(r => r.status));
attempt("dns", () => fetch("https://@DNS@/dns").then(r => r.status));
attempt("xhr", () => new Promise((ok, no) => {
  const x = new XMLHttpRequest(); x.open("GET", L + "/xhr"); x.onload = () => ok(x.status); x.onerror = no; x.send();
}));
attempt("ws", () => new Promise((ok, no) => {
  const ws = new WebSocket("ws://127.0.0.1:@HTTP@/ws"); ws.onopen = () => ok("open"); ws.onerror = () => no("error");
}));
attempt("sse", () => new Promise((ok, no) => {
  const es = new EventSource(L + "/sse");
  es.onmessage = () => { es.close(); ok("message"); }; es.onerror = () => { es.close(); no("error"); };
}));
attempt("beacon", () => navigator.sendBeacon(L + "/beacon", "x"));
attempt("worker", () => new Promise(ok => {
  const src = "fetch('" + L + "/worker').then(r => postMessage(r.status), e => postMessage(String(e)))";
  new Worker(URL.createObjectURL(new Blob([src], {type: "text/javascript"}))).onmessage = e => ok(e.data);
}));
attempt("sharedworker", () => new Promise(ok => {
  const src = "onconnect = c => fetch('" + L + "/sharedworker')" +
              ".then(r => c.ports[0].postMessage(r.status), e => c.ports[0].postMessage(String(e)))";
  new SharedWorker(URL.createObjectURL(new Blob([src], {type: "text/javascript"}))).port.onmessage = e => ok(e.data);
}));
attempt("popup", () => !!window.open(L + "/popup"));
attempt("webtransport", () => new WebTransport("https://127.0.0.1:@QUIC@/wt").ready.then(() => "ready"));
attempt("sw", () => navigator.serviceWorker.register("/sw.js").then(r => r ? "registered" : "undefined"));
attempt("webrtc", () => {
  const pc = new RTCPeerConnection({iceServers: [{urls: "stun:127.0.0.1:@HTTP@"}]});
  pc.createDataChannel("x");
  pc.onicecandidate = e => { if (e.candidate) window.candidates.push(e.candidate.candidate); };
  return pc.createOffer().then(o => pc.setLocalDescription(o)).then(() => "offered");
});
</script></body></html>""".replace("@HTTP@", str(HTTP_PORT)).replace("@TLS@", str(TLS_PORT)).replace(
    "@QUIC@", str(QUIC_PORT)).replace("@DNS@", DNS_NAME)
# Served as text/html (the pool serves every task path so), so it never registers: the control
# only shows that register() fetched it, the listener's own worker is the one that runs.
SW_ON_TASK_ORIGIN = f"fetch('http://127.0.0.1:{HTTP_PORT}/task-sw');"
ATTEMPTS = {"css", "script", "img", "iframe", "fetch", "tls", "dns", "xhr", "ws", "sse", "beacon", "worker",
            "sharedworker", "popup", "webtransport", "sw", "webrtc"}
PAGE_TAGS = {"/css", "/script", "/img", "/iframe", "/fetch", "tls", "dns", "/xhr", "/ws", "/sse", "/beacon",
             "/worker", "/sharedworker", "/popup", "quic", "stun"}
NAV_TAGS = {"/nav", "/sw.js", "/sw-fetch"}
# What request interception sees and aborts (the URLs in `Site.blocked`). It does not see a
# shared worker's requests (Playwright routes pages and dedicated workers only), WebTransport's
# QUIC, STUN or DNS, and the dead proxy does not catch the first two either (Chromium never
# proxies loopback unless the bypass list has `<-loopback>`): the empty namespace stops them.
INTERCEPTED = {f"http://127.0.0.1:{HTTP_PORT}/{p}" for p in
               ("css", "script", "img", "iframe", "fetch", "xhr", "sse", "beacon", "worker", "popup", "nav")} | {
    f"https://127.0.0.1:{TLS_PORT}/tls", f"https://{DNS_NAME}/dns", f"ws://127.0.0.1:{HTTP_PORT}/ws"}

# Measured on 2 busy CPU cores: the control's page paths all reach the listener within 0.45 s
# of DOMContentLoaded, the navigation's three within 0.35 s of the click. CONTROL_TIMEOUT_S only
# bounds a failing control; the isolated test listens QUIET_S / NAV_QUIET_S, six times that, for
# a slower machine (the first packet of a path is what would fail it, not its retransmissions).
CONTROL_TIMEOUT_S = 15.0
QUIET_S = 3.0
NAV_QUIET_S = 2.0


def tag(h: dict) -> str:
    """A hit's path tag: the request path, or what a connection or datagram was."""
    if h["kind"] == "dns":
        return "dns" if h["name"].startswith(DNS_NAME) else f"dns:{h['name']}"
    if h["kind"] == "udp":
        return "stun" if h["stun"] and h["port"] == HTTP_PORT else "quic" if h["port"] == QUIC_PORT else \
            f"udp:{h['port']}"
    if h["path"]:
        return h["path"].split("?")[0]
    return "tls" if h["port"] == TLS_PORT and h["first"] == "1603" else f"tcp:{h['port']}:{h['first']}"


@dataclass
class Listener:
    pid: int
    hits_file: Path

    @property
    def netns(self) -> str:
        return f"/proc/{self.pid}/ns/net"

    def hits(self, since: int = 0) -> list[dict]:
        """Complete lines only: the listener may be writing the next one."""
        lines = self.hits_file.read_text().split("\n")[:-1]
        return [json.loads(line) for line in lines[since:]]

    def mark(self) -> int:
        return len(self.hits())

    async def watch(self, since: int, want: set[str], timeout_s: float) -> set[str]:
        """The tags seen since `since`, polled until all of `want` are seen or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = {tag(h) for h in self.hits(since)}
            if want <= seen or time.monotonic() > deadline:
                return seen
            await asyncio.sleep(0.05)


def nameservers() -> list[str]:
    text = Path("/etc/resolv.conf").read_text() if Path("/etc/resolv.conf").exists() else ""
    return re.findall(r"^\s*nameserver\s+(\S+)", text, re.MULTILINE)  # none: glibc asks 127.0.0.1, which is up


@pytest.fixture(scope="module")
def listener(tmp_path_factory):
    require_chromium()
    if os.geteuid() != 0:
        pytest.skip("the isolation tests make a network namespace for their listener (unshare --net): root only")
    hits = tmp_path_factory.mktemp("listener") / "hits.jsonl"
    hits.touch()
    proc = subprocess.Popen(["/usr/bin/unshare", "--net", sys.executable, "-c", LISTENER,
                             f"{HTTP_PORT},{TLS_PORT},{QUIC_PORT}", str(hits), ",".join(nameservers()), IP],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            pytest.fail(f"the listener's namespace did not start: {proc.communicate()[1][-2000:]}", pytrace=False)
        yield Listener(proc.pid, hits)
    finally:
        proc.kill()
        proc.communicate()


@dataclass
class Outcome:
    seen: set[str]  # the listener's tags while the page ran
    attempts: dict[str, str]
    candidates: list[str]
    registrations: int  # service workers of the task origin
    nav_title: str
    blocked: list[str]
    errors: list[str]
    browser_pid: int


async def attack(config: BrowserConfig, listener: Listener, quiet: bool) -> Outcome:
    """Open ATTACK_PAGE in a fresh pool, then click its link. `quiet`: listen the fixed
    QUIET_S / NAV_QUIET_S; else until every tag is seen (at most CONTROL_TIMEOUT_S)."""
    since = listener.mark()
    pool = BrowserPool(config)
    try:
        tab = await pool.open_tab(Site(pages={"/": ATTACK_PAGE, "/sw.js": SW_ON_TASK_ORIGIN}))
        # Chromium's own Local Network Access check denies an https page's requests to loopback
        # (a permission nobody grants headless); granted in both modes, so only the pool blocks.
        await tab.context.grant_permissions(["local-network-access"])
        errors: list[str] = []
        tab.page.on("pageerror", lambda e: errors.append(str(e)))
        await tab.page.goto(ORIGIN + "/", wait_until="domcontentloaded")  # the attempts have started; the loads are some
        await listener.watch(since, PAGE_TAGS, QUIET_S if quiet else CONTROL_TIMEOUT_S)
        attempts = await tab.page.evaluate("window.attempts")
        candidates = await tab.page.evaluate("window.candidates")
        registrations = await tab.page.evaluate("navigator.serviceWorker.getRegistrations().then(r => r.length)")
        await tab.page.click("#nav")  # last: leaving the page would end the attempts above
        seen = await listener.watch(since, PAGE_TAGS | NAV_TAGS, NAV_QUIET_S if quiet else CONTROL_TIMEOUT_S)
        nav_title = await tab.page.title()
        browser_pid = pool._slots[0].pid
        await tab.close()
    finally:
        await pool.close()
    return Outcome(seen, attempts, candidates, registrations, nav_title, list(tab.site.blocked), errors, browser_pid)


def test_every_path_reaches_the_listener_without_blocking(listener):
    out = asyncio.run(attack(BrowserConfig(network="host", netns=listener.netns, browsers=1), listener, quiet=False))
    assert set(out.attempts) == ATTEMPTS and out.errors == []
    assert PAGE_TAGS | NAV_TAGS <= out.seen, f"never reached the listener: {sorted(PAGE_TAGS | NAV_TAGS - out.seen)}"
    assert out.attempts["fetch"] == "200" and out.attempts["ws"] == "open" and out.candidates
    assert out.nav_title == "sw registered"  # the listener's page registered its worker, which fetched /sw-fetch
    # The task origin's register() was not stubbed out: it fetched /sw.js, which fails only because
    # the pool serves every task path as text/html.
    assert "MIME type" in out.attempts["sw"], out.attempts["sw"]
    assert out.blocked == []


def test_every_path_is_blocked_when_isolated(listener):
    since = listener.mark()
    out = asyncio.run(attack(BrowserConfig(network="isolated", netns=listener.netns, browsers=1), listener,
                             quiet=True))
    assert set(out.attempts) == ATTEMPTS and out.errors == []  # every path was tried
    assert listener.hits(since) == []  # nothing at all: no connection, datagram or DNS query
    assert out.attempts["sw"] == "undefined" and out.registrations == 0  # Playwright's stub of register()
    assert out.nav_title != "sw registered"
    assert out.candidates == []  # no interface to gather on, and non-proxied UDP is off
    assert INTERCEPTED <= set(out.blocked), f"not aborted by interception: {sorted(INTERCEPTED - set(out.blocked))}"
    assert all(u.startswith(("http://127.0.0.1:", "https://127.0.0.1:", "ws://127.0.0.1:", f"https://{DNS_NAME}/"))
               for u in out.blocked), out.blocked  # nothing of the task origin was aborted


PROBE = r'''
import errno, socket, sys
port, out = int(sys.argv[1]), []
try:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"GET /probe HTTP/1.1\r\n\r\n")
    out.append("tcp ok")
except OSError as e:
    out.append(f"tcp {errno.errorcode[e.errno]}")
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"probe", ("127.0.0.1", port))
    out.append("udp ok")
except OSError as e:
    out.append(f"udp {errno.errorcode[e.errno]}")
print("; ".join(out))
'''


def in_netns(netns: str, *cmd: str) -> str:
    return subprocess.run(["/usr/bin/nsenter", f"--net={netns}", *cmd], capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()


def probe(netns: str) -> str:
    """A TCP connection and a UDP datagram to the listener's port, from inside `netns`."""
    return in_netns(netns, sys.executable, "-c", PROBE, str(HTTP_PORT))


def status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)


def test_isolated_browser_is_in_an_empty_namespace_unprivileged_and_sandboxed(listener):
    """The layers under interception, each on its own: the namespace (nothing in it reaches the
    listener, whatever asks), the unprivileged user, Chromium's sandbox around renderers."""

    async def inspect():
        pool = BrowserPool(BrowserConfig(network="isolated", netns=listener.netns, browsers=1))
        try:
            tab = await pool.open_tab(Site(pages={"/": "<!doctype html><title>t</title><p>hi</p>"}))
            await tab.page.goto(ORIGIN + "/")
            pid = pool._slots[0].pid
            netns = f"/proc/{pid}/ns/net"
            own = os.readlink(netns)
            links = (await asyncio.to_thread(in_netns, netns, IP, "-o", "link")).splitlines()
            since = listener.mark()
            from_browser = await asyncio.to_thread(probe, netns)
            leaked = listener.hits(since)
            procs = {p: (status(p), Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"),
                         os.readlink(f"/proc/{p}/ns/net"), os.readlink(f"/proc/{p}/ns/user"))
                     for p in pool.processes()}
            await tab.close()
            return own, links, from_browser, leaked, procs, os.readlink(f"/proc/{pid}/ns/user")
        finally:
            await pool.close()

    own, links, from_browser, leaked, procs, browser_userns = asyncio.run(inspect())
    assert own not in (os.readlink(listener.netns), os.readlink("/proc/self/ns/net"))
    assert len(links) == 1 and ": lo: " in links[0] and "state DOWN" in links[0], links  # nothing but lo, down
    assert from_browser == "tcp ENETUNREACH; udp ENETUNREACH" and leaked == []
    since = listener.mark()  # the probe itself can fail: from the listener's namespace it gets through
    assert probe(listener.netns) == "tcp ok; udp ok"
    assert {"/probe", f"udp:{HTTP_PORT}"} <= asyncio.run(listener.watch(since, {"/probe", f"udp:{HTTP_PORT}"}, 5))

    assert procs and all(s["Uid"].split() == ["65534"] * 4 for s, *_ in procs.values())
    renderers = [(s, net, user) for s, cmd, net, user in procs.values() if "--type=renderer" in cmd]
    assert renderers, "no renderer process"
    for s, net, user in renderers:  # in Chromium's sandbox: its namespaces, its seccomp filter
        assert s["Seccomp"] == "2" and net != own and user != browser_userns
    # The processes outside the sandbox's namespaces (the browser, its network service, the GPU
    # process) share the browser's empty one.
    assert {net for _, _, net, user in procs.values() if user == browser_userns} == {own}


def live(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def playwright_child(pid: int) -> bool:
    """A live Playwright driver started by this process (any process may end while it is read)."""
    try:
        return (live(pid) and "playwright" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid()))
    except OSError:
        return False


def test_pool_close_leaves_no_process():
    require_chromium()

    async def run():
        pool = BrowserPool(BrowserConfig(browsers=2))
        tabs = [await pool.open_tab(Site(pages={"/": "<!doctype html><title>t</title><p>hi</p>"})) for _ in range(2)]
        for tab in tabs:
            await tab.page.goto(ORIGIN + "/")
        before = pool.processes()
        driver = {p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if playwright_child(p)}
        await pool.close()  # tabs left open: close() ends them too
        return pool, before, driver

    pool, before, driver = asyncio.run(run())
    assert len(before) >= 6, before  # two browsers, each with its zygotes, network service and a renderer
    assert driver, "no Playwright driver found among this process's children"
    assert pool.processes() == set()
    left = [p for p in before | driver if live(p)]
    assert left == [], {p: Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left}
    assert not pool._dir.exists()
    # Machine-wide: no process still has the pool's home (the browsers' HOME) in its environment.
    home = f"HOME={pool._dir}/".encode()
    stray = []
    for p in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if home in Path(f"/proc/{p}/environ").read_bytes():
                stray.append(p)
        except OSError:
            continue
    assert stray == []
