"""Served engines (vLLM's, SGLang's): `ServedEngine`, the Engine they share around their backend,
and the supervision of an inference server child process: a free loopback port, a health wait
that quotes the server's log when it dies, JSON calls with a timeout, and a stop that takes the
whole process group (engine cores and schedulers outlive their leader otherwise)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Self

from tidal.engines.base import EngineBase
from tidal.engines.gate import UpdateGate, with_tied_head
from tidal.models.moe import checkpoint_names
from tidal.types import GenerationRequest, GenerationResult


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


class ServedEngine(EngineBase):
    """What the vLLM and SGLang engines share around their backend: the weight version, the gate
    between generate calls and weight updates (pause/resume; an update waits for the calls in
    flight), the checks that the engine is open and its server alive, and closing. A subclass
    sets `error` (its exception class), `name`, `request_timeout_s`, `_tied`, `_finalizer` (the
    backend's stop) and implements `dead`, `_validate`, `_generate` and `_load_weights`."""

    error: ClassVar[type[Exception]] = RuntimeError
    name: str
    request_timeout_s: float
    _tied: bool
    _finalizer: Callable[[], Any]

    def _start_serving(self) -> None:
        self._version = 0
        self._closed = False
        self._gate = UpdateGate()  # between generate calls and weight updates (threads: update_weights is sync)

    @property
    def version(self) -> int:
        return self._version

    def pause(self) -> None:
        """New generate calls wait until resume(); calls in progress finish."""
        self._gate.pause()

    def resume(self) -> None:
        self._gate.resume()

    def dead(self) -> str:
        """Why the backend is gone (its exit code, the last lines of its log); "" while it runs."""
        raise NotImplementedError

    def _validate(self, r: GenerationRequest) -> None:
        raise NotImplementedError

    async def _generate(self, requests: list[GenerationRequest], what: str,
                        version: int) -> list[tuple[list[int], list[float], str]]:
        """(token ids, log-probs, finish reason) per request, errors raised as `error`."""
        raise NotImplementedError

    def _load_weights(self, named: dict, version: int) -> None:
        raise NotImplementedError

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        what = f"generate of {len(requests)} requests (first {requests[0].request_id})"
        self._check_open(what)
        for r in requests:
            self._validate(r)
        await self._gate.enter(lambda: self._check_open(what))
        version = self._version
        try:
            outs = await self._generate(requests, what, version)
        finally:
            self._gate.exit()
        results = []
        for r, out in zip(requests, outs, strict=True):
            toks, lps, reason = out[:3]
            per_token = out[3] if len(out) > 3 else None  # a backend that updates under requests: each token's version
            if per_token:
                results.append(GenerationResult(r.request_id, toks, lps, reason, max(per_token),
                                                per_token if len(set(per_token)) > 1 else None))
            else:
                results.append(GenerationResult(r.request_id, toks, lps, reason, version))
        return results

    def _update_gate(self, too_slow: Callable[[int], Exception]):
        """What an update holds: the gate (it waits for the calls in flight, holds new ones back),
        or, with partial rollout, nothing: the backend lands it between two steps and tags tokens."""
        if getattr(self, "partial_rollout", False):
            return contextlib.nullcontext()
        return self._gate.exclusive(self.request_timeout_s, too_slow)

    def update_weights(self, version: int, tensors: Mapping[str, Any]) -> None:
        what = f"update_weights(version={version})"
        self._check_open(what)
        try:
            # a mixture of experts' fused experts by their checkpoint names, as the server loads them
            named = with_tied_head(checkpoint_names(tensors), self._tied)
        except ValueError as e:
            raise self.error(f"{self.name}: {what}: {e}") from None
        too_slow = lambda n: self.error(
            f"{self.name}: {what} waited {self.request_timeout_s:g} s for {n} generate calls in flight to "
            "finish (is update_weights called from the event loop that runs them?)")
        with self._update_gate(too_slow):
            try:
                self._load_weights(named, version)
                self._version = version
            except self.error as e:
                raise self.error(f"{self.name}: {what}: {e}") from e
            except Exception as e:
                raise self.error(f"{self.name}: {what} failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Stop the engine (and its server process). Later calls raise `error`."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise self.error(f"{self.name} is closed: {what} refused")
        dead = self.dead()
        if dead:
            raise self.error(f"{self.name} is not running: {what} refused. {dead}")
