"""Supervising an inference server child process (vLLM's, SGLang's): a free loopback port,
a health wait that quotes the server's log when it dies, JSON calls with a timeout, and a
stop that takes the whole process group (engine cores and schedulers outlive their
leader otherwise)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_workspace(kind: str, log_dir: str | Path | None) -> tuple[int, Path, Path, Path]:
    """A served engine's place to run: a free loopback port, a fresh temporary directory (new weights
    go to its `weights/`) and the server's log file, `<kind>-server-<port>.log` in `log_dir` (or in
    the temporary directory). Returns (port, tmp, weights_dir, log_path)."""
    import tempfile

    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix=f"tidal-{kind}-"))
    log_root = Path(log_dir) if log_dir is not None else tmp
    log_root.mkdir(parents=True, exist_ok=True)
    return port, tmp, tmp / "weights", log_root / f"{kind}-server-{port}.log"


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(stat.parent.name))
    return members


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session=True), SIGKILL
    after timeout_s, then wait until no live process of the group is left: children that
    outlive the leader (vLLM's engine core, SGLang's scheduler) go too."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while group_members(proc.pid) and time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.1)


def wait_healthy(proc: subprocess.Popen, health_url: str, timeout_s: float, who: str, log_path: Path,
                  error: type[Exception], setting: str) -> None:
    """Poll health_url until it answers 200; `error` names `who` if the process exits first or
    the time (the config key `setting`) runs out, quoting the log's last lines."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise error(f"{who} (pid {proc.pid}) exited with code {proc.returncode} "
                        f"while starting; last lines of {log_path}:\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(health_url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):  # HTTPError (503 while starting) included
            pass
        time.sleep(0.5)
    raise error(f"{who} (pid {proc.pid}) was not healthy within {timeout_s:g} s "
                f"({setting}); last lines of {log_path}:\n{tail(log_path)}")


def http_call(base_url: str, method: str, path: str, body: dict | None, timeout_s: float,
               error: type[Exception], dead: Callable[[], str]) -> str:
    """One JSON HTTP call with a timeout; the answer's text, or `error` naming the call (and,
    when the call could not be made, why the server is gone: `dead()`)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise error(f"{method} {path} answered {e.code}: {detail}") from e
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise error(f"{method} {path} failed: {e}. {dead()}") from e
