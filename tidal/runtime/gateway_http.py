"""The gateway's HTTP server: Starlette routes over `Gateway` (tidal/runtime/gateway.py),
served by uvicorn on a thread of its own with its own event loop, so the same server runs in
`tidal serve-policy` and inside a training run (whose rollout has a loop of its own).

Routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`, each also under
`/sessions/{id}~{secret}/v1/...` (or with the header `X-Tidal-Session`), and `GET /health`.
Binding: 127.0.0.1 unless configured otherwise; a token (`Authorization: Bearer ...`) is
required whenever the server binds anywhere else, and checked on every route but `/health`.

Plain Starlette routes rather than FastAPI: the gateway validates its bodies itself (in
OpenAI's error shape), and FastAPI's request middleware cost about 0.4 ms a call here, a
third of the server's share of a call (measured: 64 concurrent calls, 70 against 45 ms).
"""

from __future__ import annotations

import hmac
import json
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tidal.models import context_length, stop_token_ids
from tidal.net import ThreadedServer, is_loopback
from tidal.runtime.gateway import Gateway, GatewayError

log = logging.getLogger("tidal")

SESSION_HEADER = "X-Tidal-Session"


MAX_BODY_BYTES = 4 << 20  # a request body past this is refused (413); 4 MiB holds a 1M-character context


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The body, read in chunks and refused past max_body_bytes (a client that sends more, with
    or without a Content-Length, cannot make the server hold it)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise GatewayError(413, f"the request body is larger than {max_body_bytes} bytes", "invalid_request_error",
                           None, "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise GatewayError(413, f"the request body is larger than {max_body_bytes} bytes",
                               "invalid_request_error", None, "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(gateway: Gateway, token: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    expected = f"Bearer {token}".encode() if token is not None else None

    def error(e: GatewayError) -> JSONResponse:
        gateway.stats["errors"] += 1
        return JSONResponse(e.body(), status_code=e.status)

    def refused(request: Request) -> JSONResponse | None:
        if expected is None:
            return None
        given = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(given, expected):
            return None
        return error(GatewayError(401, "invalid or missing API key (Authorization: Bearer <gateway token>)",
                                  "authentication_error", None, "invalid_api_key"))

    async def http_error(request: Request, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error(GatewayError(exc.status_code, str(exc.detail), kind, None,
                                  "not_found" if exc.status_code == 404 else None))

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def models(request: Request):
        return refused(request) or JSONResponse(gateway.models())

    async def serve(kind: str, request: Request):
        if (no := refused(request)) is not None:
            return no
        gateway.stats["requests"] += 1
        try:
            body = json.loads(await read_body(request, max_body_bytes) or b"null")
        except GatewayError as e:
            return error(e)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            return error(GatewayError(400, f"the request body is not valid JSON: {type(e).__name__}: {e}"))
        session_id = request.path_params.get("session_id") or request.headers.get(SESSION_HEADER) or None
        try:
            prep = gateway.prepare(kind, body, session_id)
            results = await gateway.generate(prep)
            out = gateway.respond(prep, results)
        except GatewayError as e:
            return error(e)
        except Exception as e:  # a bug answers 500 in the API's shape and is logged
            log.exception("gateway: %s request failed", kind)
            return error(GatewayError(500, f"internal error: {type(e).__name__}({e})", "server_error"))
        if not prep.stream:
            return Response(json.dumps(out, ensure_ascii=False), media_type="application/json")
        chunks = gateway.stream_chunks(out, prep)

        async def events():
            for c in chunks:
                yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def chat(request: Request):
        return await serve("chat", request)

    async def completions(request: Request):
        return await serve("completion", request)

    routes = [Route("/health", health, methods=["GET"])]
    for prefix in ("", "/sessions/{session_id}"):
        routes += [Route(prefix + "/v1/models", models, methods=["GET"]),
                   Route(prefix + "/v1/chat/completions", chat, methods=["POST"]),
                   Route(prefix + "/v1/completions", completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


class GatewayServer:
    """uvicorn serving `build_app(gateway)` on a daemon thread. `url` is the base to give an
    OpenAI client (`.../v1`); `session_url(id)` that of one episode's session."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 start_timeout_s: float = 30.0):
        if not is_loopback(host) and not token:
            raise ValueError(f"gateway: binding {host} (not loopback) needs a token (gateway.token, or --token)")
        self.gateway, self.host, self.token = gateway, host, token
        self._server = ThreadedServer(build_app(gateway, token), host, port, what="gateway",
                                      start_timeout_s=start_timeout_s, timeout_keep_alive=30)
        self.server, self.thread, self.port, self.base = (self._server.server, self._server.thread, self._server.port,
                                                          self._server.base)

    @property
    def url(self) -> str:
        return f"{self.base}/v1"

    @property
    def api_key(self) -> str:
        """What a client sends as its key: the token, or a placeholder (clients insist on one)."""
        return self.token or "tidal"

    def session_url(self, session_id: str) -> str:
        """The base URL of an open session (its id and secret), for the agent's client."""
        return f"{self.base}/sessions/{self.gateway.session_key(session_id)}/v1"

    def close(self) -> None:
        self._server.close()

    def __enter__(self) -> GatewayServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_gateway(engine, tokenizer, model_dir, cfg, *, run_dir=None) -> GatewayServer:
    """The gateway of `cfg.gateway` (a GatewayConfig) over `engine`, started. Off loopback
    without a configured token, a random token is made; `run_dir/gateway.json` (owner-only)
    records the URL and the token for tools outside the run."""
    import secrets
    from pathlib import Path


    config = json.loads((Path(model_dir) / "config.json").read_text())
    max_len = cfg.max_model_len or context_length(config) or 4096
    token = cfg.token or (None if is_loopback(cfg.host) else secrets.token_urlsafe(24))
    gateway = Gateway(engine, tokenizer, cfg.model_name or Path(model_dir).name, max_model_len=max_len,
                      default_max_tokens=cfg.max_tokens, stop_token_ids=stop_token_ids(tokenizer))
    server = GatewayServer(gateway, cfg.host, cfg.port, token)
    if run_dir is not None:
        path = Path(run_dir) / "gateway.json"
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(json.dumps({"url": server.url, "model": gateway.model_name, "token": token}, indent=1) + "\n")
    log.info("gateway: serving the policy at %s%s", server.url, "; token required" if token else "")
    return server
