"""The entry point: a pool that runs code in sandboxes for many episodes at once.

Every run gets a fresh sandbox (new namespaces, empty workspace): nothing one run does is
seen by the next. What a pool shares is start-up work: it keeps `warm` sandboxes started
ahead of need — bubblewrap set up, the interpreter loaded, the runner blocked on its
request pipe — so a run pays only for its own code while the next sandbox starts on an
idle core. A semaphore bounds the runs executing at once (`max_concurrency`).

The pool is used from one event loop (`async with SandboxPool(cfg) as pool: await
pool.run_python(...)`). `run_python_sync` / `run_command_sync` are for scripts without
a loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tidal.sandbox import cgroup, seccomp, uids
from tidal.sandbox.cgroup_run import new_run
from tidal.sandbox.config import SandboxConfig, SandboxLimits
from tidal.sandbox.launch import find_bwrap, prepare, resolve_python, uid_pool_in_use
from tidal.sandbox.process import KILL_GRACE_S, SandboxProcess
from tidal.sandbox.result import SandboxResult, SandboxStatus, SandboxUnavailable
from tidal.sandbox.session import PythonSession, ShellSession

log = logging.getLogger("tidal.sandbox")

Files = Mapping[str, "bytes | str"]
# A warm sandbox this close to its idle timeout is not handed out: it may exit meanwhile.
WARM_MARGIN_S = 5.0
# Sandbox settings already shown to work in this process (one probe run each, not one per pool).
_PROBED: set[str] = set()
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


def _request_files(files: Files | None, reserved: str | None = None) -> dict[str, bytes]:
    """Workspace files as the runner takes them, with paths checked to stay inside."""
    out: dict[str, bytes] = {}
    for path, data in (files or {}).items():
        parts = path.split("/")
        if not path or path.startswith("/") or ".." in parts or "" in parts:
            raise ValueError(f"sandbox file path {path!r} must be relative, inside the workspace, without '..'")
        if path == reserved:
            raise ValueError(f"sandbox file {path!r} would overwrite the script of run_python")
        out[path] = data.encode() if isinstance(data, str) else bytes(data)
    return out


def _limits_for_runner(limits: SandboxLimits) -> dict[str, int]:
    return {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes, "max_processes": limits.max_processes,
            "max_open_files": limits.max_open_files, "file_bytes": limits.file_bytes}


class SandboxPool:
    """Runs commands, Python snippets and sessions in sandboxes; see the module docstring."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self._slots = asyncio.Semaphore(self.config.max_concurrency)
        self._warm: list[SandboxProcess] = []
        self._warming = 0  # warm starts in flight
        self._background: set[asyncio.Task] = set()  # warm starts, and teardowns after a run
        # Starting a process blocks its caller until the exec (milliseconds under load): done
        # on these threads, the event loop keeps serving runs. They live as long as the pool,
        # which matters: bubblewrap dies with the thread that started it (PR_SET_PDEATHSIG).
        self._starter = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tidal-sandbox-start")
        self._sessions: set[PythonSession | ShellSession] = set()
        self._cgroups: cgroup.PoolCgroups | None = None  # where the runs' cgroups go (None: rlimits only)
        # A uid per live sandbox (None: all run as sandbox_uid, or as this user when not root).
        self._uids = (uids.UidPool(self.config.uid_pool_start, self.config.uid_pool_size)
                      if uid_pool_in_use(self.config) else None)
        self._checked = False
        self._start_lock = asyncio.Lock()  # the first runs of many episodes arrive together
        self._closed = False

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Check that isolation works here (raises SandboxUnavailable, naming what is
        missing) and start the warm sandboxes. Called by the first run if not before."""
        async with self._start_lock:
            if not self._checked:
                try:
                    await self._check_and_warm()
                except BaseException:
                    if self._cgroups is not None:  # nothing runs in them yet (the probe is closed)
                        pool_cgroups, self._cgroups = self._cgroups, None
                        pool_cgroups.remove()
                    raise

    async def _check_and_warm(self) -> None:
        probe_key = self.config.model_dump_json(include={"isolation", "python", "python_site_packages",
                                                         "extra_ro_binds", "sandbox_uid", "bwrap", "seccomp", "cgroups",
                                                         "uid_pool_start", "uid_pool_size", "mask_host_sockets"})
        if self.config.isolation == "bwrap" and self.config.uid_pool_size > 0 and self._uids is None:
            _warn_once("sandbox: tidal does not run as root, so every sandbox runs as this user (uid "
                       f"{os.geteuid()}) and they share its per-user kernel quotas (inotify instances, pipe buffers, "
                       "message queues): one run can exhaust them for the others (docs/sandbox.md)")
        if self.config.isolation == "bwrap":
            if self.config.seccomp:
                seccomp.filter_program()  # SandboxUnavailable without libseccomp
            if self.config.cgroups:
                self._make_cgroups()
        if self.config.isolation == "bwrap" and probe_key not in _PROBED:
            find_bwrap(self.config)
            resolve_python(self.config)
            probe = await self._start_process(self.config.limits)
            try:
                result = await probe.run(self._python_request(probe, "pass", b"", {}, (), self.config.limits),
                                         self.config.limits.updated({"wall_s": 30.0}))
            finally:
                await probe.close()
            if result.status is not SandboxStatus.OK or result.exit_code != 0:
                raise SandboxUnavailable(f"bubblewrap is installed but cannot start a sandbox here: "
                                         f"{result.error or result.stderr.strip()[-1000:]}")
            _PROBED.add(probe_key)
        else:
            resolve_python(self.config)
        await asyncio.get_running_loop().run_in_executor(self._starter, prepare, self.config)
        self._checked = True
        self._fill_warm()

    def _make_cgroups(self) -> None:
        layout, reason = cgroup.detect()
        if layout is not None and layout.missing and self.config.require_cgroups:
            raise SandboxUnavailable(f"sandbox.require_cgroups is set but the {', '.join(layout.missing)} controller "
                                     f"cannot be used: {'; '.join(layout.missing.values())}")
        if layout is not None:
            try:
                self._cgroups = cgroup.PoolCgroups(layout, self.config.max_concurrency + self.config.warm)
                cgroup.warn_missing_once(layout.missing)
                return
            except cgroup.CgroupError as e:
                reason = str(e)
        if self.config.require_cgroups:
            raise SandboxUnavailable(f"sandbox.require_cgroups is set but no per-run cgroup can be made: {reason}")
        cgroup.warn_once(reason)

    async def close(self) -> None:
        """End every warm sandbox and open session, and return once no process of any of
        them is left: each sandbox's cgroup is emptied and removed, then the pool's own
        (CgroupError, naming what survived, if that fails within the kill grace period).
        The pool cannot be used afterwards."""
        self._closed = True
        while self._background:  # warm starts close what they start once the pool is closed
            await asyncio.gather(*self._background, return_exceptions=True)
        warm, self._warm = self._warm, []
        sessions, self._sessions = list(self._sessions), set()
        await asyncio.gather(*(p.close() for p in warm), *(s.close() for s in sessions), return_exceptions=True)
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        self._starter.shutdown(wait=False)
        if self._cgroups is not None:
            pool_cgroups, self._cgroups = self._cgroups, None
            pool_cgroups.remove()

    # -- one-shot runs -------------------------------------------------------------------

    async def run_python(self, code: str, *, stdin: bytes | str = b"", files: Files | None = None,
                         argv: Sequence[str] = (), limits: Mapping[str, Any] | None = None) -> SandboxResult:
        """Run `code` as the script `main.py` in the workspace (with `files` next to it),
        `stdin` as its standard input and `argv` as sys.argv[1:]."""
        run_limits = self.config.limits.updated(limits)
        request_files = _request_files(files, reserved="main.py")
        request_files["main.py"] = code.encode()
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        return await self._run_one(
            lambda p: self._python_request(p, code, stdin_bytes, request_files, argv, run_limits), run_limits)

    async def run_command(self, argv: Sequence[str], *, stdin: bytes | str = b"", files: Files | None = None,
                          limits: Mapping[str, Any] | None = None) -> SandboxResult:
        """Run a command (looked up on the sandbox's PATH) in the workspace, e.g.
        `["bash", "-c", "ls | wc -l"]`."""
        if not argv:
            raise ValueError("run_command needs a non-empty argv")
        run_limits = self.config.limits.updated(limits)
        request_files = _request_files(files)
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else bytes(stdin)

        def request(p: SandboxProcess) -> dict:
            return {"mode": "exec", "argv": [str(a) for a in argv], "files": request_files, "stdin": stdin_bytes,
                    "limits": _limits_for_runner(run_limits), "workspace": p.launch.workspace}

        return await self._run_one(request, run_limits)

    @staticmethod
    def _python_request(p: SandboxProcess, code: str, stdin: bytes, files: dict[str, bytes], argv: Sequence[str],
                        limits: SandboxLimits) -> dict:
        return {"mode": "python", "code": code, "script": "main.py", "argv": [str(a) for a in argv],
                "files": files, "stdin": stdin, "limits": _limits_for_runner(limits), "workspace": p.launch.workspace}

    async def _run_one(self, make_request, limits: SandboxLimits) -> SandboxResult:
        await self.start()
        self._warn_if_unsafe()
        async with self._slots:
            process, warm = await self._take_process(limits)
            result = await self._run_in(process, make_request, limits)
            if result.status is SandboxStatus.SANDBOX_ERROR and warm:
                # A warm sandbox can have died while waiting (idle timeout); a cold one is
                # the fair second try, and its error is the one reported.
                log.info("warm sandbox failed (%s); retrying in a fresh one", result.error)
                result = await self._run_in(await self._start_process(limits), make_request, limits)
            return result

    async def _run_in(self, process: SandboxProcess, make_request, limits: SandboxLimits) -> SandboxResult:
        try:
            return await process.run(make_request(process), limits)
        finally:
            self._close_later(process)  # the result is complete; teardown need not delay it

    def _spawn(self, limits: SandboxLimits, stdin_pipe: bool) -> SandboxProcess:
        """Start one sandbox in a cgroup of its own (on a starter thread)."""
        run_cgroup = None
        uid = self._uids.acquire() if self._uids is not None else None
        try:
            if self._cgroups is not None:
                try:
                    run_cgroup = new_run(self._cgroups, limits.memory_bytes, limits.max_processes, limits.cpus)
                except cgroup.CgroupError as e:
                    raise OSError(str(e)) from e
            process = SandboxProcess.start(self.config, limits, stdin_pipe, run_cgroup, uid)
        except BaseException:
            if run_cgroup is not None:
                run_cgroup.destroy_sync(KILL_GRACE_S)  # raises if a process survived: the uid stays taken
            if uid is not None:
                self._uids.release(uid)
            raise
        if uid is not None:
            process.on_gone = lambda: self._uids.release(uid)
        return process

    async def _start_process(self, limits: SandboxLimits, stdin_pipe: bool = False) -> SandboxProcess:
        started = asyncio.get_running_loop().run_in_executor(self._starter, self._spawn, limits, stdin_pipe)
        try:
            return await asyncio.shield(started)
        except asyncio.CancelledError:  # the caller gave up: whatever was started is ended
            started.add_done_callback(lambda f: None if f.cancelled() or f.exception() else self._close_later(f.result()))
            raise
        except OSError as e:
            raise SandboxUnavailable(f"starting a sandbox failed: {e}") from e

    # -- sessions ------------------------------------------------------------------------

    async def python_session(self, *, files: Files | None = None,
                             limits: Mapping[str, Any] | None = None) -> PythonSession:
        """A Python interpreter whose globals last across `run` calls (one episode's tool
        calls); `await session.close()` (or `async with`) at the episode's end."""
        session_limits = self.config.limits.updated(limits)
        await self.start()
        self._warn_if_unsafe()
        process, _ = await self._take_process(session_limits)
        session = PythonSession(process, session_limits, self._slots, self.config.idle_timeout_s, self._sessions)
        await session.open(_request_files(files), _limits_for_runner(session_limits))
        return session

    async def shell_session(self, *, files: Files | None = None,
                            limits: Mapping[str, Any] | None = None) -> ShellSession:
        """A bash whose state (cwd, variables, functions) lasts across `run` calls."""
        session_limits = self.config.limits.updated(limits)
        await self.start()
        self._warn_if_unsafe()
        process = await self._start_process(session_limits, stdin_pipe=True)
        session = ShellSession(process, session_limits, self._slots, self.config.idle_timeout_s, self._sessions)
        await session.open(_request_files(files), _limits_for_runner(session_limits))
        return session

    # -- warm sandboxes ------------------------------------------------------------------

    async def _take_process(self, limits: SandboxLimits) -> tuple[SandboxProcess, bool]:
        """A warm sandbox if one fits, else a new one; whether it was warm."""
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        max_age = self.config.idle_timeout_s - WARM_MARGIN_S
        while (i := next((i for i, p in enumerate(self._warm) if p.fits(limits)), None)) is not None:
            process = self._warm.pop(i)
            if process.alive and time.monotonic() - process.started_at < max_age:
                self._fill_warm()
                return process, True
            self._close_later(process)
        self._fill_warm()
        return await self._start_process(limits), False

    def _fill_warm(self) -> None:
        for _ in range(self.config.warm - len(self._warm) - self._warming):
            self._warming += 1
            self._in_background(self._start_warm())

    async def _start_warm(self) -> None:
        try:
            process = await self._start_process(self.config.limits)
        except SandboxUnavailable as e:  # the run that needs one will start it and report
            log.warning("starting a warm sandbox failed: %s", e)
            return
        finally:
            self._warming -= 1
        if self._closed:
            await process.close()
        else:
            self._warm.append(process)

    def _close_later(self, process: SandboxProcess) -> None:
        self._in_background(process.close())

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _warn_if_unsafe(self) -> None:
        if self.config.isolation == "unsafe_host":
            log.warning("sandbox isolation=unsafe_host: running untrusted code directly on this host, without "
                        "namespaces (only rlimits); use isolation=bwrap for anything but trusted code")


def _run_in_fresh_pool(config: SandboxConfig | None, call) -> SandboxResult:
    """`await call(pool)` in a pool made for it (no warm sandboxes) and closed after."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("run_python_sync/run_command_sync called inside an event loop; "
                           "use `await pool.run_python(...)`")

    async def once() -> SandboxResult:
        async with SandboxPool((config or SandboxConfig()).model_copy(update={"warm": 0})) as pool:
            return await call(pool)

    return asyncio.run(once())


def run_python_sync(code: str, config: SandboxConfig | None = None, **kwargs: Any) -> SandboxResult:
    """One Python run from synchronous code; the keywords are those of `SandboxPool.run_python`."""
    return _run_in_fresh_pool(config, lambda pool: pool.run_python(code, **kwargs))


def run_command_sync(argv: Sequence[str], config: SandboxConfig | None = None, **kwargs: Any) -> SandboxResult:
    """One command run from synchronous code; the keywords are those of `SandboxPool.run_command`."""
    return _run_in_fresh_pool(config, lambda pool: pool.run_command(argv, **kwargs))
