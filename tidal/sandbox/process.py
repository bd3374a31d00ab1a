"""One started sandbox: its runner process, the pipes to it, and how a run's result is read.

A `SandboxProcess` is started before its work is known (warm) or just for it (cold); the
same code serves both. The pipes are plain file descriptors read through the event loop
and the exit is watched through a pidfd: no thread per process (asyncio's subprocess
support starts one), which counts at hundreds of runs per second.

Start-up (on a starter thread): a fresh session keyring for the thread, and bubblewrap with
the syscall filter on a pipe (`--seccomp`), born in the run's cgroup: on cgroup v1 the
starter thread enters that cgroup alone for the start; on v2 bubblewrap reports its child
(`--json-status-fd`) and holds it (`--block-fd`) until it has been moved in. Either way
no code runs before every process of the sandbox is in the cgroup.

A run is over when the runner's supervisor reports the code's end on the status pipe (the
kernel's wait4 status and CPU time of the code's process; the supervisor is the sandbox's
PID 1, its /proc entry is masked, and it alone holds that pipe, so the code can neither
write it, nor signal or ptrace it), or when the sandbox exits without such a report, which is never
`ok`. Output is read as it comes, at most `output_bytes` per stream and a chunk at a time
between which other runs are served, so a flood never stalls the event loop nor sits in
host memory; the status pipe is read to a few hundred bytes at most. Past a cap or the
wall clock the whole sandbox is killed: through its cgroup, and SIGKILL to bubblewrap's
process group (the PID namespace dies with its init). Closing a sandbox kills what is
left in its cgroup, waits until it is empty and releases it. Nothing here waits
without a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import marshal
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal.sandbox import seccomp, thread_user
from tidal.sandbox.cgroup import CgroupError
from tidal.sandbox.cgroup_run import RunCgroup
from tidal.sandbox.config import SandboxConfig, SandboxLimits
from tidal.sandbox.launch import Launch, build_launch
from tidal.sandbox.result import SandboxResult, SandboxStatus, classify_exit, classify_signal

log = logging.getLogger("tidal.sandbox")

KILL_GRACE_S = 5.0  # how long a killed sandbox may take to exit before that is an error
SELF_END_WAIT_S = 0.5  # how long a sandbox whose supervisor reported the end may take to exit before it is killed
READ_CHUNK = 1 << 16
STATUS_CAP = 512  # bytes read of the status pipe at most ("S", a done report; anything else is noise)
SETUP_TIMEOUT_S = 30.0  # bubblewrap reporting its sandbox's init, before that init is released


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

    def read_available(self, limit: int) -> bytes:
        """What the pipe holds now, up to `limit` bytes, without waiting (bounded: a writer
        that never stops cannot keep it reading)."""
        chunks = []
        while self.fd >= 0 and limit > 0:
            try:
                chunk = os.read(self.fd, min(READ_CHUNK, limit))
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                break
            chunks.append(chunk)
            limit -= len(chunk)
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

    @property
    def room(self) -> int:
        """Bytes still kept, plus one to tell that the cap was passed."""
        return self.cap - len(self.data) + 1

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

    def __init__(self, popen: subprocess.Popen, launch: Launch, fds: dict[str, int], limits: SandboxLimits,
                 cgroup: RunCgroup | None):
        # Called once no process of this sandbox is left (the pool gives its uid back then).
        self.on_gone: Callable[[], None] | None = None
        self.popen = popen
        self.launch = launch
        self.limits = limits  # the tmpfs sizes it was started with
        self.cgroup = cgroup
        self.request_fd = fds["request"]  # our write end
        self.stdin_fd = fds.get("stdin", -1)  # our write end, sessions only
        self.json_status_fd = fds.get("json", -1)  # kept open: bubblewrap writes its exit there at the end
        self.stdout = PipeReader(fds["stdout"])
        self.stderr = PipeReader(fds["stderr"])
        self.status = PipeReader(fds["status"])
        self.status_bytes = b""
        self.started_at = time.monotonic()
        self._exit_watch = PipeReader(os.pidfd_open(popen.pid))
        self._closed = False
        self.teardown_error: str | None = None  # set by close() when the cgroup could not be emptied

    @classmethod
    def start(cls, config: SandboxConfig, limits: SandboxLimits, stdin_pipe: bool = False,
              cgroup: RunCgroup | None = None, uid: int | None = None) -> SandboxProcess:
        """Start a sandbox whose runner then waits for its request (synchronous, on a starter
        thread: a fork and an exec, and with a cgroup the wait for bubblewrap's init)."""
        ours: dict[str, int] = {}
        theirs: list[int] = []
        bwrap_fds: dict[str, int] = {}
        launch = None
        popen = None
        isolated = config.isolation == "bwrap"
        names = ["request", "status", "stdout", "stderr"] + (["stdin"] if stdin_pipe else [])
        if isolated and config.seccomp:
            names.append("seccomp")
        # Where a thread can enter a cgroup alone (v1), bubblewrap is started from inside the
        # run's cgroup; else (v2) it is held (--block-fd) until its child is moved there.
        admit_later = isolated and cgroup is not None and not cgroup.thread_entry
        if admit_later:
            names += ["json", "block"]
        try:
            for name in names:
                r, w = os.pipe()
                mine, child = (w, r) if name in ("request", "stdin", "seccomp", "block") else (r, w)
                ours[name] = mine
                theirs.append(child)
                os.set_blocking(mine, False)
            request_r, status_w, stdout_w, stderr_w = theirs[:4]
            child_fds = dict(zip(names, theirs))
            if "seccomp" in child_fds:
                bwrap_fds["seccomp"] = child_fds["seccomp"]
                program = seccomp.filter_program()
                if os.write(ours["seccomp"], program) != len(program):
                    raise OSError("the seccomp filter does not fit in a pipe buffer")
                os.close(ours.pop("seccomp"))  # bubblewrap reads it to EOF
            if "json" in child_fds:
                bwrap_fds["json-status-fd"] = child_fds["json"]
                bwrap_fds["block-fd"] = child_fds["block"]
            launch = build_launch(config, limits, request_r, status_w, bwrap_fds, uid)
            # Written before the runner exists: a pipe buffers 64 KiB, the runner is ~17 KiB
            # (a partial write, or BlockingIOError, would say it no longer fits).
            if os.write(ours["request"], launch.runner_frame) != len(launch.runner_frame):
                raise OSError("the sandbox runner does not fit in a pipe buffer")
            if isolated:
                seccomp.join_fresh_session_keyring()
            entered = (cgroup.entered_by_this_thread() if isolated and cgroup is not None and not admit_later
                       else contextlib.nullcontext())
            switched = (thread_user.thread_runs_as(*launch.run_as) if launch.run_as is not None
                        else contextlib.nullcontext())
            with entered, switched:  # the cgroup first: entering it takes root
                popen = subprocess.Popen(
                    launch.argv, stdin=child_fds["stdin"] if stdin_pipe else subprocess.DEVNULL, stdout=stdout_w,
                    stderr=stderr_w, pass_fds=(request_r, status_w, *bwrap_fds.values()), start_new_session=True,
                    env=launch.env, cwd=launch.host_workspace or "/")
            if "json" in child_fds:
                cls._admit_to_cgroup(popen, ours["json"], ours.pop("block"), cgroup)
        except BaseException:
            if popen is not None:
                _kill_group(popen.pid)
                popen.wait(KILL_GRACE_S)
            for fd in ours.values():
                os.close(fd)
            if launch is not None and launch.host_workspace:
                shutil.rmtree(launch.host_workspace, ignore_errors=True)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        return cls(popen, launch, ours, limits, cgroup)

    @staticmethod
    def _admit_to_cgroup(popen: subprocess.Popen, json_fd: int, block_fd: int, cgroup: RunCgroup) -> None:
        """Move the sandbox's init into the run's cgroup while bubblewrap holds it (before it
        starts the runner), then release it."""
        line = b""
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while b"\n" not in line:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([json_fd], [], [], left)[0]:
                raise OSError(f"bubblewrap did not report its sandbox's init within {SETUP_TIMEOUT_S:.0f} s")
            chunk = os.read(json_fd, 4096)
            if not chunk:
                raise OSError(f"bubblewrap exited while setting up the sandbox (exit {popen.wait(KILL_GRACE_S)})")
            line += chunk
        try:
            child_pid = int(json.loads(line.split(b"\n", 1)[0])["child-pid"])
        except (ValueError, KeyError, TypeError) as e:
            raise OSError(f"bubblewrap's status line is not understood: {line[:200]!r}") from e
        cgroup.add(child_pid)
        os.write(block_fd, b"x")
        os.close(block_fd)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None and not self._closed

    def fits(self, limits: SandboxLimits) -> bool:
        """Whether this sandbox's fixed sizes are those `limits` ask for."""
        return (self.limits.workspace_bytes, self.limits.tmp_bytes) == (limits.workspace_bytes, limits.tmp_bytes)

    def apply_limits(self, limits: SandboxLimits) -> None:
        """Set the run's memory and process limits on its cgroup (a warm sandbox was
        started with the pool's defaults)."""
        if self.cgroup is not None:
            self.cgroup.set_limits(limits.memory_bytes, limits.max_processes, limits.cpus)

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
        """Read the status pipe until the runner's done report, EOF, or STATUS_CAP bytes
        (what comes after is never read: a flood there only blocks its writer)."""
        while Done.parse(self.status_bytes) is None and len(self.status_bytes) < STATUS_CAP:
            chunk = await self.status.read(STATUS_CAP - len(self.status_bytes))
            if not chunk:
                break
            self.status_bytes += chunk
        return self.status_bytes

    def _read_status_available(self) -> None:
        self.status_bytes += self.status.read_available(max(0, STATUS_CAP - len(self.status_bytes)))

    def kill(self) -> None:
        """SIGKILL every process of the sandbox: its cgroup's members, and the process group
        of bubblewrap (whose sandbox init then dies with it, taking the PID namespace along)
        or, unsafe, of the runner and its children."""
        if self.cgroup is not None:
            self.cgroup.kill_members()
        _kill_group(self.popen.pid)

    async def close(self) -> None:
        """Kill (if still running), reap, verify through the cgroup that no process is left
        and remove it, release the pipes and, unsafe, the host workspace."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.popen.poll() is None and self.launch.isolated and Done.parse(self.status_bytes) is not None:
                # The supervisor reported the code's end and exits right after: the PID namespace
                # dies with it, then bubblewrap exits. Waiting for that spares a kill and a round
                # of the cgroup check below; a sandbox that does not end soon is killed.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wait_exit(), SELF_END_WAIT_S)
            if self.popen.poll() is None or not self.launch.isolated:
                self.kill()  # else the run is over: its PID namespace is gone (the cgroup check below verifies)
            await asyncio.wait_for(self.wait_exit(), KILL_GRACE_S)
            if self.cgroup is not None:
                await self.cgroup.destroy(KILL_GRACE_S)
        except TimeoutError:
            self.teardown_error = f"sandbox process {self.popen.pid} did not exit {KILL_GRACE_S:.0f} s after SIGKILL"
            log.error("%s", self.teardown_error)
        except CgroupError as e:
            self.teardown_error = str(e)
            log.error("sandbox teardown: %s", e)
        finally:  # also when cancelled (a loop shutting down), possibly before the kill above
            if self.popen.returncode is None or (self.cgroup is not None and not self.cgroup.removed):
                if self.popen.poll() is None:
                    self.kill()
                self._finish_teardown_sync()
            for fd in (self.request_fd, self.stdin_fd, self.json_status_fd):
                if fd >= 0:
                    os.close(fd)
            self.request_fd = self.stdin_fd = self.json_status_fd = -1
            for reader in (self.stdout, self.stderr, self.status, self._exit_watch):
                reader.close()
            if self.launch.host_workspace:
                shutil.rmtree(self.launch.host_workspace, ignore_errors=True)
            gone = self.popen.returncode is not None and (self.cgroup is None or self.cgroup.removed)
            if gone and self.on_gone is not None:  # a survivor keeps its uid out of use
                self.on_gone()
                self.on_gone = None

    def _finish_teardown_sync(self) -> None:
        """The rest of `close` without the event loop (it was cancelled: a loop shutting
        down cancels what is left). Blocks, boundedly, so that the process is reaped and
        its cgroup emptied and released even then."""
        try:
            self.popen.wait(KILL_GRACE_S)
            if self.cgroup is not None:
                self.cgroup.destroy_sync(KILL_GRACE_S)
        except (subprocess.TimeoutExpired, CgroupError) as e:
            self.teardown_error = str(e)
            log.error("sandbox teardown: %s", e)

    async def run(self, request: dict, limits: SandboxLimits) -> SandboxResult:
        """Send the one request of this sandbox and collect its result. The caller closes
        the sandbox afterwards (that may happen in the background)."""
        t0 = time.monotonic()
        stdout, stderr = OutputBuffer(limits.output_bytes), OutputBuffer(limits.output_bytes)
        over_cap = asyncio.Event()

        async def pump(reader: PipeReader, buffer: OutputBuffer) -> None:
            while chunk := await reader.read(min(READ_CHUNK, buffer.room)):
                buffer.add(chunk)
                if buffer.exceeded:
                    over_cap.set()
                    return
                await asyncio.sleep(0)  # a stream that always has data must not hold the loop

        try:
            self.apply_limits(limits)
        except CgroupError as e:
            return self._result(SandboxStatus.SANDBOX_ERROR, stdout, stderr, t0, error=str(e))
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
                    break  # the supervisor reported the code's end: its output is in the pipes
                if tasks["exit"].done():
                    break  # the sandbox is gone (with or without a report)
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
        wall_s = time.monotonic() - t0
        for reader, buffer in ((self.stdout, stdout), (self.stderr, stderr)):
            if not buffer.exceeded:
                buffer.add(reader.read_available(buffer.room))
        self._read_status_available()
        if not self.status_bytes.startswith(b"S"):
            if host_kill is SandboxStatus.TIMEOUT:
                error = f"sandbox set-up did not finish within wall_s={limits.wall_s}"
            else:
                detail = (self.status_bytes[1:].split(b"\n", 1)[0].decode(errors="replace")
                          or stderr.text().strip()[-2000:])
                error = f"sandbox failed before running the code (exit {self.popen.returncode}): {detail}"
            return self._result(SandboxStatus.SANDBOX_ERROR, stdout, stderr, t0, error=error, wall_s=wall_s)
        if self.cgroup is not None and self.cgroup.oom_killed():
            return self._result(SandboxStatus.MEMORY, stdout, stderr, t0, sig=signal.SIGKILL, wall_s=wall_s,
                                error=f"killed by the kernel at the run's memory limit ({limits.memory_bytes} bytes)")
        if host_kill is SandboxStatus.TIMEOUT:
            return self._result(host_kill, stdout, stderr, t0, sig=signal.SIGKILL, wall_s=wall_s,
                                error=f"killed after wall_s={limits.wall_s}")
        if host_kill is SandboxStatus.OUTPUT_LIMIT or stdout.exceeded or stderr.exceeded:
            return self._result(SandboxStatus.OUTPUT_LIMIT, stdout, stderr, t0, sig=signal.SIGKILL, wall_s=wall_s,
                                error=f"killed after output_bytes={limits.output_bytes} on one stream")
        status, exit_code, sig = self.outcome(bytes(stderr.data), limits.cpu_s)
        error = "" if Done.parse(self.status_bytes) else "the sandbox ended without its supervisor's report"
        return self._result(status, stdout, stderr, t0, exit_code=exit_code, sig=sig, wall_s=wall_s, error=error)

    def outcome(self, stderr: bytes, cpu_limit_s: int,
                supervised: bool = True) -> tuple[SandboxStatus, int | None, int | None]:
        """Status, exit code and signal of code that ended by itself, from the supervisor's
        report (the kernel's wait4 status of the code's process). Without one, a supervised
        run is `killed` (its supervisor was killed: bubblewrap's exit status alone can be
        forged from inside, through its init's event descriptor); an unsupervised one (a
        Python session, whose code is the runner) is read from that exit status."""
        returncode = self.popen.returncode
        done = Done.parse(self.status_bytes)
        if done is None and supervised and self.launch.isolated:
            sig = returncode - 128 if returncode is not None and 128 < returncode < 128 + signal.NSIG else None
            return SandboxStatus.KILLED, None, sig
        if done is None:
            return classify_exit(returncode, stderr, self.launch.isolated)
        if done.signal is not None:
            return classify_signal(done.signal, done.cpu_s, cpu_limit_s), None, done.signal
        return classify_exit(done.exit_code, stderr, from_bwrap=False)

    @staticmethod
    def _result(status: SandboxStatus, stdout: OutputBuffer, stderr: OutputBuffer, t0: float,
                exit_code: int | None = None, sig: int | None = None, error: str = "",
                wall_s: float | None = None) -> SandboxResult:
        wall_s = time.monotonic() - t0 if wall_s is None else wall_s
        return SandboxResult(status, stdout.text(), stderr.text(), exit_code, sig, wall_s, error)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
