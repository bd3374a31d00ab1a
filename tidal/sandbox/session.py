"""Persistent sessions for multi-turn tools: one sandbox whose state lasts across turns.

A Python session keeps one `__main__` namespace (a final bare expression is shown, as in
a notebook); a shell session keeps one bash (cwd, variables, functions). Each turn's
stdout and stderr end with a line carrying a random per-turn token, which is how the
host knows the turn is over without closing anything. A turn that passes its wall clock
or its output cap kills the whole session (its state is then unknowable); so does an
exit of the interpreter or shell. Later turns raise `SandboxSessionClosed`.

A session holds no concurrency slot while idle (the policy is generating); each turn
takes one while it runs. Between turns its cgroup is frozen (where the freezer is
available), so what it left running in the background gets no CPU while it holds no slot;
the host then ends a session idle for `idle_timeout_s` (frozen, it cannot time out by
itself).
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from collections.abc import Awaitable, Callable

from tidal.sandbox.config import SandboxLimits
from tidal.sandbox.process import KILL_GRACE_S, SandboxProcess
from tidal.sandbox.result import SandboxResult, SandboxSessionClosed, SandboxStatus, classify_exit

READ_CHUNK = 1 << 16
# bash reads each turn as one line and runs it in the same shell, so state persists; a
# `read -t` timeout ends an abandoned session.
SHELL_LOOP = 'while IFS= read -r -t {idle} __tidal_turn; do eval "$__tidal_turn"; done'
_SHELL_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-.,/:=+@%")


def ansi_c_quote(text: str) -> str:
    """`text` as one bash $'…' word: everything but plain characters as \\xHH, so the
    command (newlines, quotes, any bytes) fits on one line of the session protocol."""
    return "$'" + "".join(chr(b) if b in _SHELL_SAFE else f"\\x{b:02x}" for b in text.encode()) + "'"


class _Session:
    def __init__(self, process: SandboxProcess, limits: SandboxLimits, slots: asyncio.Semaphore,
                 idle_timeout_s: int, registry: set):
        self.process = process
        self.limits = limits
        self._slots = slots
        self._idle_timeout_s = idle_timeout_s
        self._registry = registry
        self._pending_out = bytearray()  # read past a turn's end marker: the next turn's
        self._pending_err = bytearray()
        self._eof = {"out": False, "err": False}
        self.ended: str | None = None  # why the session is over
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_end: asyncio.Task | None = None
        self._closing: asyncio.Future | None = None

    async def open(self, files: dict[str, bytes], runner_limits: dict[str, int]) -> None:
        self._registry.add(self)
        self.process.apply_limits(self.limits)
        if not await self.process.send(self._setup_request(files, runner_limits)):
            await self._end("the sandbox exited before the session was set up")
        else:
            self._pause()

    def _pause(self) -> None:
        """Between turns: freeze the session's processes and start the host's idle clock."""
        cgroup = self.process.cgroup
        if cgroup is None or not cgroup.can_freeze:
            return  # unfrozen, the session's own idle timeout ends it
        cgroup.freeze()
        self._idle_timer = asyncio.get_running_loop().call_later(self._idle_timeout_s, self._idle_expired)

    def _idle_expired(self) -> None:
        if self.ended is None:
            self._idle_end = asyncio.ensure_future(self._end(f"idle for idle_timeout_s={self._idle_timeout_s}"))

    def _resume(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self.process.cgroup is not None:
            self.process.cgroup.thaw()

    def _setup_request(self, files: dict[str, bytes], runner_limits: dict[str, int]) -> dict:
        raise NotImplementedError

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End the session and its sandbox (at the episode's end). Every caller returns once
        the sandbox is gone (the pool's close waits for a session the host's idle clock
        is ending): the session leaves the pool's registry only then."""
        if self.ended is None:
            self.ended = "closed"
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._closing is None:
            self._closing = asyncio.ensure_future(self.process.close())
            self._closing.add_done_callback(lambda _: self._registry.discard(self))
        await asyncio.shield(self._closing)

    async def _end(self, reason: str) -> None:
        self.ended = reason
        await self.close()

    async def _turn(self, send: Callable[[str], Awaitable[bool]], wall_s: float | None) -> SandboxResult:
        if self.ended is not None:
            raise SandboxSessionClosed(f"sandbox session has ended: {self.ended}")
        wall_s = wall_s or self.limits.wall_s
        cap = self.limits.output_bytes
        token = secrets.token_hex(8).encode()
        out_marker, err_marker = b"\n" + token + b":", b"\n" + token + b"\n"
        async with self._slots:
            if self.ended is not None:  # ended (idle) while waiting for the slot
                raise SandboxSessionClosed(f"sandbox session has ended: {self.ended}")
            self._resume()
            t0 = time.monotonic()
            if not await send(token.decode()):
                return await self._exited(b"", b"", t0)
            turn_out = turn_err = None
            exit_code = None
            reads: dict[str, asyncio.Future] = {}
            streams = {"out": self.process.stdout, "err": self.process.stderr}
            buffers = {"out": self._pending_out, "err": self._pending_err}
            try:
                while True:
                    if turn_out is None and (i := self._pending_out.find(out_marker)) >= 0:
                        j = self._pending_out.find(b"\n", i + len(out_marker))
                        if j >= 0:
                            exit_code = int(self._pending_out[i + len(out_marker):j] or b"1")
                            turn_out = bytes(self._pending_out[:i])
                            del self._pending_out[:j + 1]
                    if turn_err is None and (i := self._pending_err.find(err_marker)) >= 0:
                        turn_err = bytes(self._pending_err[:i])
                        del self._pending_err[:i + len(err_marker)]
                    if turn_out is not None and turn_err is not None:
                        break
                    if len(self._pending_out) > cap + len(out_marker) + 8 or len(self._pending_err) > cap + len(err_marker):
                        return await self._killed(SandboxStatus.OUTPUT_LIMIT, t0,
                                                  f"killed after output_bytes={cap} on one stream in a session turn")
                    waiting_for = [name for name, done in (("out", turn_out), ("err", turn_err))
                                   if done is None and not self._eof[name]]
                    if not waiting_for:  # the interpreter or shell is gone
                        return await self._exited(bytes(self._pending_out), bytes(self._pending_err), t0)
                    for name in waiting_for:
                        if name not in reads:
                            reads[name] = asyncio.ensure_future(streams[name].read(READ_CHUNK))
                    done, _ = await asyncio.wait(reads.values(), timeout=max(0.0, t0 + wall_s - time.monotonic()),
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if not done:
                        return await self._killed(SandboxStatus.TIMEOUT, t0, f"session turn killed after wall_s={wall_s}")
                    for name in [n for n, task in reads.items() if task in done]:
                        chunk = reads.pop(name).result()
                        if chunk:
                            buffers[name] += chunk
                        else:
                            self._eof[name] = True
            finally:
                for task in reads.values():
                    task.cancel()  # safe: a cancelled read consumes nothing
                await asyncio.gather(*reads.values(), return_exceptions=True)
        if len(turn_out) > cap or len(turn_err) > cap:  # it all came at once, marker included
            self._pending_out[:0], self._pending_err[:0] = turn_out, turn_err
            return await self._killed(SandboxStatus.OUTPUT_LIMIT, t0,
                                      f"killed after output_bytes={cap} on one stream in a session turn")
        self._pause()
        status, code, sig = classify_exit(exit_code, turn_err, from_bwrap=True)
        return SandboxResult(status, turn_out.decode(errors="replace"), turn_err.decode(errors="replace"), code, sig,
                             time.monotonic() - t0)

    async def _killed(self, status: SandboxStatus, t0: float, error: str) -> SandboxResult:
        out, err = bytes(self._pending_out[:self.limits.output_bytes]), bytes(self._pending_err[:self.limits.output_bytes])
        await self._end(f"a turn ended {status.value} ({error})")
        return SandboxResult(status, out.decode(errors="replace"), err.decode(errors="replace"), None, signal.SIGKILL,
                             time.monotonic() - t0, error)

    async def _exited(self, out: bytes, err: bytes, t0: float) -> SandboxResult:
        """The sandbox ended during a turn: read why from its exit."""
        try:
            returncode = await asyncio.wait_for(self.process.wait_exit(), KILL_GRACE_S)
            status_bytes = await asyncio.wait_for(self.process.read_status(), KILL_GRACE_S)
        except TimeoutError:
            returncode, status_bytes = None, self.process.status_bytes
        oom = self.process.cgroup is not None and self.process.cgroup.oom_killed()  # read before teardown
        await self._end(f"the sandbox exited (exit {returncode})")
        wall_s = time.monotonic() - t0
        text_out, text_err = out.decode(errors="replace"), err.decode(errors="replace")
        if returncode is None or not status_bytes.startswith(b"S"):
            detail = status_bytes[1:].split(b"\n", 1)[0].decode(errors="replace") or text_err.strip()[-2000:]
            return SandboxResult(SandboxStatus.SANDBOX_ERROR, text_out, text_err, None, None, wall_s,
                                 f"session sandbox failed (exit {returncode}): {detail}")
        if oom:
            return SandboxResult(SandboxStatus.MEMORY, text_out, text_err, None, signal.SIGKILL, wall_s,
                                 f"killed by the kernel at the session's memory limit ({self.limits.memory_bytes} bytes)")
        status, code, sig = self.process.outcome(err, self.limits.cpu_s, supervised=self.supervised)
        return SandboxResult(status, text_out, text_err, code, sig, wall_s, "the session's process exited")


class PythonSession(_Session):
    """`await session.run("x = 1")`, then `await session.run("x + 1")` → stdout "2"."""

    supervised = True  # the session's interpreter is the supervised child of the runner

    def _setup_request(self, files: dict[str, bytes], runner_limits: dict[str, int]) -> dict:
        return {"mode": "python_session", "files": files, "stdin": b"", "limits": runner_limits,
                "workspace": self.process.launch.workspace}

    async def run(self, code: str, *, wall_s: float | None = None) -> SandboxResult:
        """Run one chunk of code in the session's namespace; exit code 1 if it raised."""
        message = {"code": code, "idle_timeout_s": self._idle_timeout_s}
        return await self._turn(lambda token: self.process.send({**message, "token": token}), wall_s)


class ShellSession(_Session):
    """`await session.run("cd sub && export A=1")`, then `await session.run("pwd; echo $A")`."""

    supervised = True  # bash is the supervised child of the runner

    def _setup_request(self, files: dict[str, bytes], runner_limits: dict[str, int]) -> dict:
        argv = ["bash", "--noprofile", "--norc", "-c", SHELL_LOOP.format(idle=self._idle_timeout_s)]
        return {"mode": "exec", "argv": argv, "keep_stdin": True, "files": files, "stdin": b"",
                "limits": runner_limits, "workspace": self.process.launch.workspace}

    async def run(self, command: str, *, wall_s: float | None = None) -> SandboxResult:
        """Run one command line (any bash, several lines allowed) with stdin from /dev/null."""
        async def send(token: str) -> bool:
            line = (f"eval {ansi_c_quote(command)} </dev/null; printf '\\n%s:%s\\n' {token} \"$?\"; "
                    f"printf '\\n%s\\n' {token} >&2\n")
            return await self.process.write(self.process.stdin_fd, line.encode())

        return await self._turn(send, wall_s)
