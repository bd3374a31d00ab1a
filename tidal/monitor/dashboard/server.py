"""`tidal dashboard RUN_DIR [RUN_DIR ...]`: a web page over run directories.

The page (static/index.html, app.js, style.css) draws with Plotly (plotly.js as shipped in the
`plotly` Python package, served from it: nothing is fetched from a CDN and no plotting code
is ours) and asks this server's JSON routes for data (tidal/monitor/dashboard/data.py):

    GET /api/runs                     the runs, their episode facets (envs, statuses, steps), and whether each
                                      is running, finished or failed (tidal/monitor/run_status.py)
    GET /api/metrics?run=I&since=N    metric rows from N on, as columns (live: the page polls)
    GET /api/events?run=I             alerts and reward-hacking events
    GET /api/config                   each run's config and the keys that differ between runs
    GET /api/episodes?run=I&...       a filtered page of episodes
    GET /api/episode?run=I&id=E       one episode whole, with its tokens' texts and where its images sit
    GET /api/image?run=I&id=HEX       one picture of a vision-language episode (image/png, cached for good:
                                      the id is its content hash)

Binding: 127.0.0.1 unless told otherwise. Off loopback a token is required on every route
(`Authorization: Bearer T`, or the cookie set by opening `/?token=T` once). On loopback
without a token the Host header must be a loopback name, so a web page elsewhere cannot reach
the dashboard through DNS rebinding. Episode texts are model output: the page only ever puts
them into the document as text, and the Content-Security-Policy allows no inline script.
"""

from __future__ import annotations

import hmac
import logging
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from tidal.monitor.dashboard.data import DashboardError, DashboardNotFound, RunView, config_diff
from tidal.monitor.run_status import run_status
from tidal.net import ThreadedServer, is_loopback

log = logging.getLogger("tidal")

COOKIE = "tidal_dashboard"
STATIC = Path(str(resources.files("tidal.monitor.dashboard") / "static"))
SECURITY_HEADERS = {
    # plotly.js sets element styles from script (allowed by 'unsafe-inline' for styles only)
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
# A picture's id is the hash of its pixels: the same address never names other bytes, so the browser
# may keep it (private: a token may guard it).
IMAGE_CACHE = "private, max-age=31536000, immutable"


class MissingDashboardExtra(RuntimeError):
    pass


def plotly_js() -> Path:
    """plotly.min.js from the installed `plotly` package (the `dashboard` extra)."""
    try:
        import plotly
    except ImportError:
        raise MissingDashboardExtra("tidal dashboard needs the `dashboard` extra: pip install 'tidal[dashboard]' "
                                    "(plotly and duckdb)") from None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise MissingDashboardExtra(f"the installed plotly ({plotly.__version__}) ships no {path.name}")
    return path


def connect():
    """An in-memory DuckDB for the store's Parquet files (the `dashboard` extra)."""
    try:
        import duckdb
    except ImportError:
        raise MissingDashboardExtra("tidal dashboard needs the `dashboard` extra: pip install 'tidal[dashboard]' "
                                    "(plotly and duckdb)") from None
    con = duckdb.connect(":memory:")
    con.execute("SET threads = 2")
    con.execute("SET parquet_metadata_cache = true")  # footers read once per file, not per request
    return con


def _number(request: Request, name: str, kind: type, default=None):
    """Query parameter `name` as `kind` (int or float); `default` when absent or empty."""
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    try:
        return kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise DashboardError(f"query parameter `{name}` must be {what} (got {raw!r})") from None


def _int(request: Request, name: str, default: int | None = None) -> int | None:
    return _number(request, name, int, default)


def _float(request: Request, name: str) -> float | None:
    return _number(request, name, float)


class _Gate:
    """Who may use the dashboard: without a token, requests whose Host is a loopback name (a
    DNS-rebinding page cannot pass); with one, a bearer header or the cookie that /?token= sets.
    `api` wraps a route: refused requests never reach it, and its errors become JSON."""

    def __init__(self, token: str | None, check_host: bool):
        self.expected = token.encode() if token else None
        self.check_host = check_host

    def refused(self, request: Request) -> Response | None:
        if self.check_host and self.expected is None:
            host = _host_name(request.headers.get("host", ""))
            if host not in LOOPBACK_NAMES:
                return JSONResponse({"error": f"host `{host}` is not a loopback name"}, 403, headers=SECURITY_HEADERS)
        if self.expected is None:
            return None
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.cookies.get(COOKIE, "")
        if hmac.compare_digest(given.encode(), self.expected):
            return None
        return JSONResponse({"error": "a token is required: open /?token=<dashboard token> once, or send "
                                      "Authorization: Bearer <token>"}, 401, headers=SECURITY_HEADERS)

    def api(self, fn):
        def endpoint(request: Request) -> Response:
            bad = self.refused(request)
            if bad is not None:
                return bad
            try:
                result = fn(request)
                return result if isinstance(result, Response) else JSONResponse(result, headers=SECURITY_HEADERS)
            except DashboardNotFound as e:
                return JSONResponse({"error": str(e)}, 404, headers=SECURITY_HEADERS)
            except DashboardError as e:
                return JSONResponse({"error": str(e)}, 400, headers=SECURITY_HEADERS)
            except Exception as e:  # the page shows it; the server goes on serving
                log.exception("dashboard: %s failed", request.url.path)
                return JSONResponse({"error": f"{request.url.path}: {type(e).__name__}: {e}"}, 500,
                                    headers=SECURITY_HEADERS)
        return endpoint

    def index(self, request: Request) -> Response:
        given = request.query_params.get("token")
        if self.expected is not None and given is not None:
            if not hmac.compare_digest(given.encode(), self.expected):
                return JSONResponse({"error": "wrong token"}, 401, headers=SECURITY_HEADERS)
            response = RedirectResponse("/", 303, headers=SECURITY_HEADERS)  # the token leaves the address bar
            response.set_cookie(COOKIE, given, httponly=True, samesite="strict")
            return response
        bad = self.refused(request)
        if bad is not None:
            return bad
        return FileResponse(STATIC / "index.html", headers=SECURITY_HEADERS)

    def static(self, files: dict[str, Path]):
        def serve(request: Request) -> Response:
            bad = self.refused(request)
            if bad is not None:
                return bad
            path = files.get(request.path_params["name"])
            if path is None:
                return JSONResponse({"error": "not found"}, 404, headers=SECURITY_HEADERS)
            return FileResponse(path, headers={**SECURITY_HEADERS, "Cache-Control": "max-age=3600"})

        return serve


def _api_routes(runs: list[RunView], con) -> list[tuple[str, Any]]:
    """The data routes over `runs` (query `run=<index>`), each a function of the request."""

    def run_of(request: Request) -> RunView:
        i = _int(request, "run", 0)
        if not 0 <= i < len(runs):
            raise DashboardError(f"no run {i} (runs 0..{len(runs) - 1})")
        return runs[i]

    def runs_route(request: Request) -> Any:
        return {"runs": [{"index": i, "name": r.name, "path": str(r.root), "episodes": r.facets(con.cursor()),
                          "status": run_status(r.root)} for i, r in enumerate(runs)]}

    def metrics_route(request: Request) -> Any:
        return run_of(request).metrics(_int(request, "since", 0), _int(request, "generation"))

    def events_route(request: Request) -> Any:
        return {"events": run_of(request).events()}

    def config_route(request: Request) -> Any:
        configs = [r.config() for r in runs]
        return {"runs": [r.name for r in runs], "configs": configs, "diff": config_diff(configs)}

    def episodes_route(request: Request) -> Any:
        q = request.query_params
        statuses = [s for s in q.get("status", "").split(",") if s]
        return run_of(request).episodes(
            con.cursor(), step_min=_int(request, "step_min"), step_max=_int(request, "step_max"),
            reward_min=_float(request, "reward_min"), reward_max=_float(request, "reward_max"),
            status=statuses or None, env=q.get("env") or None, text=q.get("text") or None,
            offset=_int(request, "offset", 0), limit=_int(request, "limit", 50), order=q.get("order", "newest"))

    def episode_route(request: Request) -> Any:
        eid = request.query_params.get("id")
        if not eid:
            raise DashboardError("query parameter `id` (an episode id) is required")
        return run_of(request).episode(con.cursor(), eid, _int(request, "step"))

    def image_route(request: Request) -> Response:
        path = run_of(request).image_path(request.query_params.get("id"))
        return FileResponse(path, media_type="image/png", headers={**SECURITY_HEADERS, "Cache-Control": IMAGE_CACHE})

    return [("/api/runs", runs_route), ("/api/metrics", metrics_route), ("/api/events", events_route),
            ("/api/config", config_route), ("/api/episodes", episodes_route), ("/api/episode", episode_route),
            ("/api/image", image_route)]


def build_app(runs: list[RunView], token: str | None = None, check_host: bool = True) -> Starlette:
    if not runs:
        raise DashboardError("the dashboard needs at least one run directory")
    gate = _Gate(token, check_host)
    files = {"app.js": STATIC / "app.js", "style.css": STATIC / "style.css", "plotly.min.js": plotly_js()}
    return Starlette(routes=[Route("/", gate.index), Route("/static/{name}", gate.static(files)),
                             *[Route(path, gate.api(fn)) for path, fn in _api_routes(runs, connect())]])


class DashboardServer:
    """uvicorn serving the dashboard on a daemon thread (`tidal dashboard` waits on it; tests
    and notebooks use it directly)."""

    def __init__(self, run_dirs: list[str | Path], host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, start_timeout_s: float = 30.0):
        if not is_loopback(host) and not token:
            raise DashboardError(f"dashboard: binding {host} (not loopback) needs a token (--token-env)")
        names = _unique_names([Path(d) for d in run_dirs])
        self.runs = [RunView(d, n) for d, n in zip(run_dirs, names)]
        for run in self.runs:  # the tokenizers load in the background: the first opened episode need not wait
            threading.Thread(target=run.warm, name="tidal-dashboard-warm", daemon=True).start()
        self.host, self.token = host, token
        self._server = ThreadedServer(build_app(self.runs, token), host, port, what="dashboard", error=DashboardError,
                                      start_timeout_s=start_timeout_s)
        self.thread, self.port = self._server.thread, self._server.port
        self.url = self._server.base + "/"

    def close(self) -> None:
        self._server.close()

    def __enter__(self) -> DashboardServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _host_name(header: str) -> str:
    """The name in a Host header, without its port (`[::1]:8080` -> `[::1]`)."""
    if header.startswith("["):
        return header.split("]")[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _unique_names(dirs: list[Path]) -> list[str]:
    """Each run's directory name; the parent's name added where two runs share one."""
    names = [d.resolve().name for d in dirs]
    return [f"{d.resolve().parent.name}/{n}" if names.count(n) > 1 else n for d, n in zip(dirs, names)]
