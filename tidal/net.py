"""Addresses and servers: whether a host is loopback (every tidal service binds 127.0.0.1
unless told otherwise, and needs a token anywhere else), and an ASGI app served by uvicorn on
a thread of its own. Its own module, free of tidal's heavy imports, so that servers, Ray
placement and its workers share it without importing each other."""

from __future__ import annotations

import ipaddress
import threading
import time


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class ThreadedServer:
    """uvicorn serving `app` on a daemon thread with its own event loop, started (or the
    error `error` naming `what`, the address and why). `port` is the bound one (port 0: a
    free one), `base` the server's `http://host:port`."""

    def __init__(self, app, host: str, port: int, *, what: str, error: type[Exception] = RuntimeError,
                 start_timeout_s: float = 30.0, **uvicorn_options):
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                                **uvicorn_options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"tidal-{what.replace(' ', '-')}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise error(f"{what}: the server did not start on {host}:{port} within {start_timeout_s:g} s "
                            "(is the port taken?)")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
