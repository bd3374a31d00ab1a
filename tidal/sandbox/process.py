"""One started sandbox: its runner process, the pipes to it, and how a run's result is read.

A `SandboxProcess` is started before its work is known (warm) or just for it (cold); the
same code serves both. The pipes are plain file descriptors read through the event loop
and the exit is watched through a pidfd: no thread per process (asyncio's subprocess
support starts one), which counts at hundreds of runs per second.

A run is over when the runner reports the code done on the status pipe (its output is
then complete in the pipes; the sandbox's teardown, a few milliseconds of kernel work,
happens after the result is returned), or when the sandbox exits. Output is read as it
comes, at most `output_bytes` per stream, so a flood never sits in host memory; past the
cap, or past the wall clock, the whole sandbox is killed (SIGKILL to bubblewrap's process
group; its PID namespace dies with its init, so no process of the code survives).
Nothing here waits without a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import marshal
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from tidal.sandbox.config import SandboxConfig, SandboxLimits
from tidal.sandbox.launch import Launch, build_launch
from tidal.sandbox.result import SandboxResult, SandboxStatus, classify_exit, classify_signal

log = logging.getLogger("tidal.sandbox")

KILL_GRACE_S = 5.0  # how long a killed sandbox may take to exit before that is an error
READ_CHUNK = 1 << 16


def encode_frame(message: dict) -> bytes:
    payload = marshal.dumps(message)
    return len(payload).to_bytes(8, "little") + payload


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class PipeReader:
    """The read end of a pipe, read through the event loop. `read` returns b"" at EOF (and
    once closed) and may be cancelled without losing data."""

    def __init__(self, fd: int):
        self.fd = fd
        self.eof = False
        self._waiter: asyncio.Future | None = None
        os.set_blocking(fd, False)

    async def read(self, n: int = READ_CHUNK) -> bytes:
        while self.fd >= 0:
            try:
                data = os.read(self.fd, n)
            except BlockingIOError:
                await self.wait_readable()
                continue
            self.eof = not data
            return data
        return b""

    async def wait_readable(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        loop.add_reader(self.fd, _resolve, self._waiter)
        try:
            await self._waiter
        finally:
            self._unregister()

    def _unregister(self) -> None:
        if self._waiter is not None:
            asyncio.get_running_loop().remove_reader(self.fd)
            _resolve(self._waiter)
            self._waiter = None

    def read_available(self) -> bytes:
        """Whatever the pipe holds now, without waiting."""
        chunks = []
        while self.fd >= 0:
            try:
                chunk = os.read(self.fd, READ_CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        """Close the pipe; a read waiting on it returns b"" (its registration goes first, so
        the descriptor number can be reused safely)."""
        if self.fd >= 0:
            self._unregister()
            os.close(self.fd)
            self.fd = -1


async def write_all(fd: int, data: bytes) -> None:
    """Write to a non-blocking pipe without blocking the event loop."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            writable = loop.create_future()
            loop.add_writer(fd, _resolve, writable)
            try:
                await writable
            finally:
                loop.remove_writer(fd)


@dataclass
class OutputBuffer:
    """Bytes read from one stream, never more than `cap` (what comes after is dropped)."""

    cap: int
    data: bytearray = field(default_factory=bytearray)
    exceeded: bool = False

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.data += chunk[:room]
            self.exceeded = True
        else:
            self.data += chunk

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


@dataclass
class Done:
    """The runner's report that the code has finished."""

    exit_code: int | None
    signal: int | None
    cpu_s: float

    @staticmethod
    def parse(status: bytes) -> Done | None:
        """From the status pipe's bytes ("S", then "D<exit> <signal> <cpu>\\n"); None when
        there is no well-formed report (what the code wrote there is ignored)."""
        start = status.find(b"D", 1)
        end = status.find(b"\n", start)
        if not status.startswith(b"S") or start < 0 or end < 0:
            return None
        try:
            exit_code, sig, cpu_s = status[start + 1:end].split()
            return Done(None if int(sig) else int(exit_code), int(sig) or None, float(cpu_s))
        except ValueError:
            return None


class SandboxProcess:
    """A runner inside a fresh sandbox, waiting for its one request (or a session's turns)."""

    def __init__(self, popen: subprocess.Popen, launch: Launch, fds: dict[str, int], limits: SandboxLimits):
        self.popen = popen
        self.launch = launch
        self.limits = limits  # the tmpfs sizes it was started with
        self.request_fd = fds["request"]  # our write end
        self.stdin_fd = fds.get("stdin", -1)  # our write end, sessions only
        self.stdout = PipeReader(fds["stdout"])
        self.stderr = PipeReader(fds["stderr"])
        self.status = PipeReader(fds["status"])
        self.status_bytes = b""
        self.started_at = time.monotonic()
        self._exit_watch = PipeReader(os.pidfd_open(popen.pid))
        self._closed = False

    @classmethod
    def start(cls, config: SandboxConfig, limits: SandboxLimits, stdin_pipe: bool = False) -> SandboxProcess:
        """Start a sandbox whose runner then waits for its request (synchronous: a fork and
        an exec, about a millisecond)."""
        ours: dict[str, int] = {}
        theirs: list[int] = []
        launch = None
        try:
            for name in ("request", "status", "stdout", "stderr") + (("stdin",) if stdin_pipe else ()):
                r, w = os.pipe()
                mine, child = (w, r) if name in ("request", "stdin") else (r, w)
                ours[name] = mine
                theirs.append(child)
                os.set_blocking(mine, False)
            request_r, status_w, stdout_w, stderr_w = theirs[:4]
            launch = build_launch(config, limits, request_r, status_w)
            # Written before the runner exists: a pipe buffers 64 KiB, the runner is ~17 KiB
            # (a partial write, or BlockingIOError, would say it no longer fits).
            if os.write(ours["request"], launch.runner_frame) != len(launch.runner_frame):
                raise OSError("the sandbox runner does not fit in a pipe buffer")
            popen = subprocess.Popen(
                launch.argv, stdin=theirs[4] if stdin_pipe else subprocess.DEVNULL, stdout=stdout_w, stderr=stderr_w,
                pass_fds=(request_r, status_w), start_new_session=True, env=launch.env,
                cwd=launch.host_workspace or "/")
        except BaseException:
            for fd in ours.values():
                os.close(fd)
            if launch is not None and launch.host_workspace:
                shutil.rmtree(launch.host_workspace, ignore_errors=True)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        return cls(popen, launch, ours, limits)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None and not self._closed

    def fits(self, limits: SandboxLimits) -> bool:
        """Whether this sandbox's fixed sizes are those `limits` ask for."""
        return (self.limits.workspace_bytes, self.limits.tmp_bytes) == (limits.workspace_bytes, limits.tmp_bytes)

    async def send(self, message: dict) -> bool:
        """Write one frame to the runner; False when it is gone (the pipe is broken)."""
        return await self.write(self.request_fd, encode_frame(message))

    @staticmethod
    async def write(fd: int, data: bytes) -> bool:
        try:
            await write_all(fd, data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    async def wait_exit(self) -> int:
        """The exit code of bubblewrap (or, unsafe, the runner), once it has exited."""
        while self.popen.poll() is None:
            await self._exit_watch.wait_readable()  # a pidfd turns readable at the process's exit
        return self.popen.returncode

    async def read_status(self) -> bytes:
        """Read the status pipe until the runner's done report or EOF."""
        while Done.parse(self.status_bytes) is None:
            chunk = await self.status.read(4096)
            if not chunk:
                break
            self.status_bytes += chunk
        return self.status_bytes

    def kill(self) -> None:
        """SIGKILL the process group: bubblewrap (whose sandbox init then dies with it, taking
        the PID namespace along) or, unsafe, the runner and the children in its group."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    async def close(self) -> None:
        """Kill (if still running), reap, release the pipes and, unsafe, the host workspace."""
        if self._closed:
            return
        self._closed = True
        self.kill()
        try:
            await asyncio.wait_for(self.wait_exit(), KILL_GRACE_S)
        except TimeoutError:
            log.error("sandbox process %d did not exit %.0f s after SIGKILL", self.popen.pid, KILL_GRACE_S)
        finally:  # also when cancelled (a loop shutting down): the process is killed already
            for fd in (self.request_fd, self.stdin_fd):
                if fd >= 0:
                    os.close(fd)
            self.request_fd = self.stdin_fd = -1
            for reader in (self.stdout, self.stderr, self.status, self._exit_watch):
                reader.close()
            if self.launch.host_workspace:
                shutil.rmtree(self.launch.host_workspace, ignore_errors=True)

    async def run(self, request: dict, limits: SandboxLimits) -> SandboxResult:
        """Send the one request of this sandbox and collect its result. The caller closes
        the sandbox afterwards (that may happen in the background)."""
        t0 = time.monotonic()
        stdout, stderr = OutputBuffer(limits.output_bytes), OutputBuffer(limits.output_bytes)
        over_cap = asyncio.Event()

        async def pump(reader: PipeReader, buffer: OutputBuffer) -> None:
            while chunk := await reader.read():
                buffer.add(chunk)
                if buffer.exceeded:
                    over_cap.set()
                    return

        if await self.send(request):
            os.close(self.request_fd)  # one frame per run; a dead runner is seen on the status pipe
            self.request_fd = -1
        tasks = {"stdout": asyncio.ensure_future(pump(self.stdout, stdout)),
                 "stderr": asyncio.ensure_future(pump(self.stderr, stderr)),
                 "status": asyncio.ensure_future(self.read_status()),
                 "exit": asyncio.ensure_future(self.wait_exit()),
                 "over_cap": asyncio.ensure_future(over_cap.wait())}
        host_kill = None
        try:
            while True:
                done, _ = await asyncio.wait([t for t in tasks.values() if not t.done()],
                                             timeout=max(0.0, t0 + limits.wall_s - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    host_kill = SandboxStatus.TIMEOUT
                    break
                if over_cap.is_set():
                    host_kill = SandboxStatus.OUTPUT_LIMIT
                    break
                if tasks["status"].done() and Done.parse(self.status_bytes) is not None:
                    break  # the code is done: its output is in the pipes
                if tasks["exit"].done() and tasks["status"].done():
                    break
        finally:
            for task in tasks.values():
                task.cancel()  # cancelled reads consume nothing; the rest is read below
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        if host_kill is not None:
            self.kill()
            try:
                await asyncio.wait_for(self.wait_exit(), KILL_GRACE_S)
            except TimeoutError:
                return self._result(SandboxStatus.SANDBOX_ERROR, stdout, stderr, t0, error=(
                    f"sandbox process {self.popen.pid} did not exit {KILL_GRACE_S:.0f} s after SIGKILL"))
        for reader, buffer in ((self.stdout, stdout), (self.stderr, stderr)):
            if not buffer.exceeded:
                buffer.add(reader.read_available())
        self.status_bytes += self.status.read_available()
        if not self.status_bytes.startswith(b"S"):
            if host_kill is SandboxStatus.TIMEOUT:
                error = f"sandbox set-up did not finish within wall_s={limits.wall_s}"
            else:
                detail = self.status_bytes[1:].decode(errors="replace") or stderr.text().strip()[-2000:]
                error = f"sandbox failed before running the code (exit {self.popen.returncode}): {detail}"
            return self._result(SandboxStatus.SANDBOX_ERROR, stdout, stderr, t0, error=error)
        if host_kill is SandboxStatus.TIMEOUT:
            return self._result(host_kill, stdout, stderr, t0, sig=signal.SIGKILL,
                                error=f"killed after wall_s={limits.wall_s}")
        if host_kill is SandboxStatus.OUTPUT_LIMIT or stdout.exceeded or stderr.exceeded:
            return self._result(SandboxStatus.OUTPUT_LIMIT, stdout, stderr, t0, sig=signal.SIGKILL,
                                error=f"killed after output_bytes={limits.output_bytes} on one stream")
        status, exit_code, sig = self.outcome(bytes(stderr.data), limits.cpu_s)
        return self._result(status, stdout, stderr, t0, exit_code=exit_code, sig=sig)

    def outcome(self, stderr: bytes, cpu_limit_s: int) -> tuple[SandboxStatus, int | None, int | None]:
        """Status, exit code and signal of code that ended by itself: from the runner's done
        report when there is one (exact), else from the sandbox's exit code."""
        done = Done.parse(self.status_bytes)
        if done is None:
            return classify_exit(self.popen.returncode, stderr, self.launch.isolated)
        if done.signal is not None:
            return classify_signal(done.signal, done.cpu_s, cpu_limit_s), None, done.signal
        return classify_exit(done.exit_code, stderr, from_bwrap=False)

    @staticmethod
    def _result(status: SandboxStatus, stdout: OutputBuffer, stderr: OutputBuffer, t0: float,
                exit_code: int | None = None, sig: int | None = None, error: str = "") -> SandboxResult:
        return SandboxResult(status, stdout.text(), stderr.text(), exit_code, sig, time.monotonic() - t0, error)
