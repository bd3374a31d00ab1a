"""A watchdog for the local Ray instance a run starts: when the driver dies without closing it
(kill -9, the OOM killer), it ends the processes that instance's raylet started.

Why it is needed: Ray ties its GCS and raylet to the driver (PR_SET_PDEATHSIG, SIGKILL), and an
actor's worker leaves within seconds of its raylet; but the raylet's agents (the dashboard agent,
the runtime-env agent), finding their raylet killed rather than stopped, first publish an error to
the GCS, which died with it, under a fixed 60 s timeout (Ray 2.60,
ray/_private/process_watcher.py): measured here, they outlived a killed driver by 62 s.

How: a small process in its own session reads a pipe from the driver. End of file without
`done` means the driver died: it then sends SIGTERM, and after 1 s SIGKILL, to every process
whose environment names the raylet (`RAY_RAYLET_PID=<pid>`, which Ray gives the processes the
raylet starts: agents and workers). A driver that closes Ray itself writes `done` first and the
watchdog leaves quietly. Only for an instance the run started (never a cluster it joined).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time


def start(raylet_pid: int) -> subprocess.Popen:
    """The watchdog of the raylet `raylet_pid`, watching this process."""
    return subprocess.Popen([sys.executable, "-m", "tidal.runtime.ray_watchdog", str(raylet_pid)],
                            stdin=subprocess.PIPE, start_new_session=True)  # a Ctrl-C to the run's group spares it


def stop(proc: subprocess.Popen | None) -> None:
    """The driver closed Ray itself: the watchdog leaves without ending anything."""
    if proc is None:
        return
    with contextlib.suppress(OSError):
        proc.stdin.write(b"done\n")
        proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def started_by(raylet_pid: int) -> list[int]:
    """The processes whose environment names `raylet_pid` as their raylet."""
    mark = f"RAY_RAYLET_PID={raylet_pid}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if mark in env:
            found.append(int(name))
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def main(argv: list[str]) -> int:
    raylet_pid = int(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    told = sys.stdin.buffer.read()  # until the driver writes `done` and closes, or dies
    if b"done" in told:
        return 0
    pids = started_by(raylet_pid)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and started_by(raylet_pid):
        time.sleep(0.1)
    _signal_all(started_by(raylet_pid), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
