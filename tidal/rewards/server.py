"""The reward-model pool over HTTP (FastAPI + uvicorn): `tidal serve-rm MODEL_DIR`.

Endpoints (JSON in, JSON out):
- `POST /score`: tidal's. `{"texts": [...]}` or `{"prompts": [...], "completions": [...]}`
  (a prompt is the rendered text the policy saw, or chat messages, rendered here with the
  model's chat template) → `{"scores": [...]}`, in order.
- `POST /get_reward`: OpenRLHF's remote reward-model protocol. `{"query": [full texts],
  "prompts": [...], "labels": [...]}` → `{"rewards": [...], "scores": [...], "extra_logs":
  {...}}`. A query is the whole sequence, prompt and response (OpenRLHF decodes it with
  special tokens kept); prompts and labels are accepted, checked for length, not needed to
  score. `extra_logs` holds per-query lists (OpenRLHF logs each key as a metric).
- `GET /health`: the model, its batching settings and the pool's batch-size histogram.

Every request of every client goes into one `RewardModelPool`, so concurrent requests share
forward passes (dynamic batching across connections, not only within one request).

Security: binds 127.0.0.1 by default; a non-loopback host is refused unless a token is set,
and with a token every endpoint requires `Authorization: Bearer <token>`. Errors come back
as `{"error": {"code": N, "type": "...", "message": "..."}}`.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from typing import Any, Self

from pydantic import BaseModel, ConfigDict

from tidal.net import is_loopback
from tidal.rewards.rm import RewardModelError, RewardModelPool, Transform, transform_scores

MAX_TEXTS = 4096  # most texts in one request; a larger one is answered 413


class ServeError(ValueError):
    """A server that must not start as configured (e.g. a public address without a token)."""


def check_bind(host: str, token: str | None) -> None:
    if not is_loopback(host) and not token:
        raise ServeError(f"refusing to serve the reward model on {host}, which is not a loopback address, without a "
                         "token: pass --token-env NAME (an environment variable holding the token) or --token T, "
                         "and clients then send `Authorization: Bearer T`")


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[str] | None = None
    prompts: list[str | list[dict[str, Any]]] | None = None
    completions: list[str] | None = None


class GetRewardRequest(BaseModel):  # OpenRLHF's; extra keys are tolerated as its clients evolve
    model_config = ConfigDict(extra="allow")
    query: list[str]
    prompts: list[Any] | None = None
    labels: list[Any] | None = None


class Fail(Exception):
    """An answer other than 200, in the server's error shape."""

    def __init__(self, code: int, kind: str, message: str):
        self.code, self.kind, self.message = code, kind, message


def _error(code: int, kind: str, message: str, headers: dict | None = None):
    """The server's one error shape: `{"error": {code, type, message}}`."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"code": code, "type": kind, "message": message}}, status_code=code,
                        headers=headers)


def _guard(app, token: str | None) -> None:
    """The bearer-token check (when `token` is set) and the handlers that turn every error, ours
    and the framework's, into the server's error shape."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    error = _error

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        if token:
            got = request.headers.get("authorization", "")
            scheme, _, value = got.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
                return error(401, "unauthorized", "this reward server requires `Authorization: Bearer <token>`"
                             + (" (the token given does not match)" if got else " (no Authorization header)"),
                             {"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(Fail)
    async def on_fail(request: Request, e: Fail):
        return error(e.code, e.kind, e.message)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, e: RequestValidationError):
        msgs = [f"{'.'.join(str(x) for x in err['loc'][1:]) or 'body'}: {err['msg']}" for err in e.errors()]
        return error(422, "invalid_request", f"{request.url.path}: " + "; ".join(msgs))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, e: StarletteHTTPException):
        return error(e.status_code, "http_error", f"{request.method} {request.url.path}: {e.detail}")

    @app.exception_handler(Exception)
    async def on_crash(request: Request, e: Exception):
        return error(500, "internal_error", f"{request.url.path}: {type(e).__name__}: {e}")


def _texts_of(req: ScoreRequest, pool: RewardModelPool) -> list[str]:
    """The texts a /score request asks to score: its `texts`, or its prompts and completions
    rendered by the model's chat template."""
    if req.texts is not None:
        if req.prompts is not None or req.completions is not None:
            raise Fail(400, "invalid_request", "/score: give `texts`, or `prompts` and `completions`, not both")
        return req.texts
    if req.prompts is not None and req.completions is not None:
        if len(req.prompts) != len(req.completions):
            raise Fail(400, "invalid_request", f"/score: {len(req.prompts)} prompts and {len(req.completions)} "
                       "completions: they pair up one to one")
        try:
            return [pool.render(c, p, None) if isinstance(p, str) else pool.render(c, None, p)
                    for p, c in zip(req.prompts, req.completions)]
        except Exception as e:  # a message list the chat template cannot render
            raise Fail(400, "invalid_request", f"/score: cannot render a prompt: {type(e).__name__}: {e}") from e
    raise Fail(400, "invalid_request", "/score: the body needs `texts`, or `prompts` and `completions`")


def create_app(pool: RewardModelPool, token: str | None = None, transform: Transform = "raw",
               max_texts: int = MAX_TEXTS):
    from fastapi import FastAPI

    app = FastAPI(title="tidal reward model", docs_url=None, redoc_url=None, openapi_url=None)
    _guard(app, token)

    async def scores_of(texts: list[str], path: str) -> list[float]:
        if len(texts) > max_texts:
            raise Fail(413, "too_many_texts", f"{path}: {len(texts)} texts in one request; at most {max_texts}")
        try:
            return transform_scores(await pool.score(texts), transform, pool.meta)
        except RewardModelError as e:
            raise Fail(500, "model_error", f"{path}: {e}") from e

    @app.post("/score")
    async def score(req: ScoreRequest) -> dict:
        return {"scores": await scores_of(_texts_of(req, pool), "/score")}

    @app.post("/get_reward")
    async def get_reward(req: GetRewardRequest) -> dict:
        for key in ("prompts", "labels"):
            got = getattr(req, key)
            if got is not None and len(got) != len(req.query):
                raise Fail(400, "invalid_request", f"/get_reward: {len(req.query)} queries and {len(got)} {key}: "
                           "they pair up one to one")
        rewards = await scores_of(req.query, "/get_reward")
        return {"rewards": rewards, "scores": rewards, "extra_logs": {"rm_score": rewards}}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": pool.path, "transform": transform, "max_batch_size": pool.max_batch_size,
                "max_wait_ms": pool.max_wait_s * 1000.0, "stats": pool.stats()}

    return app


class RewardServer:
    """uvicorn serving `create_app(pool, ...)` on a socket bound here (port 0: a free port),
    run in a background thread (`start()`) or in the caller's (`run()`)."""

    def __init__(self, pool: RewardModelPool, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 transform: Transform = "raw", log_level: str = "warning", max_texts: int = MAX_TEXTS):
        import uvicorn

        check_bind(host, token)
        self.pool = pool
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise ServeError(f"cannot bind the reward server to {host}:{port}: {e}") from e
        self.host, self.port = host, self.sock.getsockname()[1]
        app = create_app(pool, token, transform, max_texts)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self, timeout_s: float = 30.0) -> Self:
        self._thread = threading.Thread(target=self.run, name="reward-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ServeError(f"the reward server on {self.url} did not start within {timeout_s:g} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
